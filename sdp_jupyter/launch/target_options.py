"""Each target as JobSpec sees it, one record per target: its name, the JobSpec dict field its own
options fill, where its option rows are, whether its ranks can start warm, and whether its options
are refused with another target. spec.py derives the target names, the option table and those checks
from TARGETS. The other half of a target, its launcher, is in launch/kernel/targets.py: the launchers
import spec, so spec must not import them (a leaf here; the SSH, Ray and Slurm rows live here too, the
SageMaker rows beside the rest of that target's options).
"""
from __future__ import annotations

from dataclasses import dataclass

from sdp_jupyter.launch.options import Option


@dataclass(frozen=True)
class Target:
    """One target, everything the rest of the package asks of it; every list of targets (the magic's and
    the CLI's --target, the setup form, the session check, the reference pages) is derived from TARGETS.
    Its launcher is named in launch/kernel/targets.py (LAUNCHERS, under the same name): the launchers import
    the spec, which reads these records, so naming them here would close an import cycle."""

    field: str | None = None      # the JobSpec dict field its own options fill ("ssh" -> JobSpec.ssh)
    options: str | None = None    # "module:ATTRIBUTE", a tuple of Option rows, loaded when the table is built
    warm: bool = False            # --warm/--preload apply (ranks forked from a warm pool)
    exclusive: bool = False       # its options are refused with another --target
    nodes_from_hosts: bool = False  # --nodes left out: one node per host given (else 1 node)
    sessions: bool = False        # %sdp_session runs on it: ranks stay up between cells, a channel reaches them
    hybrid: bool = False          # the hybrid-parallel options (--tp, --pp, ...) reach its workers' environment
    own_hosts: bool = False       # its nodes are hosts you have (no instance type to pick); the job view names them
    catalogue: bool = False       # its nodes are instance types of the catalogue (sdp_jupyter.instances), priced
    elastic: bool = False         # --nodes MIN:MAX: a lost node is left out, a returning one rejoins (docs/failures.md)
    elastic_refusal: str | None = None  # why --nodes MIN:MAX is refused there (a target that is not elastic)
    heal: bool = False            # --heal: a dead rank's peers re-form without restarting (sdp_jupyter.heal)


SSH_OPTIONS = (
    Option("--hosts", "ssh.hosts", "--target ssh: host names, as `ssh HOST` reaches them (user@host works)",
           kind="csv", metavar="H1,H2"),
    Option("--hostfile", "ssh.hostfile", '--target ssh: a DeepSpeed-style host file ("gpu1 slots=8" per line)',
           metavar="FILE"),
    Option("--python", "ssh.python", "--target ssh: the interpreter on the hosts (default: this one's path)",
           metavar="PATH"),
    Option("--ssh-config", "ssh.config", "--target ssh: an ssh_config file for these hosts (ssh -F)",
           metavar="FILE"),
)
SSH_KEYS = {"hosts", "hostfile", "python", "config"}

RAY_OPTIONS = (
    Option("--address", "ray.address",
           "--target ray: the cluster, HOST:PORT, auto or ray://HOST:10001 (default: $RAY_ADDRESS, else auto)",
           metavar="ADDRESS"),
)
RAY_KEYS = {"address"}

SLURM_OPTIONS = (
    Option("--partition", "slurm.partition", "--target slurm: the partition (sbatch -p; default: the cluster's)",
           metavar="NAME"),
    Option("--account", "slurm.account", "--target slurm: the account charged (sbatch -A)", metavar="NAME"),
    Option("--time", "slurm.time", "--target slurm: the allocation's wall-clock limit, as Slurm writes it "
           "(30, 1:30:00, 2-0)", metavar="LIMIT"),
    Option("--slurm-args", "slurm.args", '--target slurm: more sbatch options, e.g. --slurm-args "--qos=high '
           '--constraint=v100"', metavar="ARGS"),
)
SLURM_KEYS = {"partition", "account", "time", "args"}


TARGETS: dict[str, Target] = {
    "local": Target(warm=True, sessions=True, hybrid=True, heal=True, elastic=True),
    "ssh": Target("ssh", "sdp_jupyter.launch.target_options:SSH_OPTIONS",
                  warm=True, exclusive=True, nodes_from_hosts=True, sessions=True, own_hosts=True, elastic=True,
                  heal=True),
    "ray": Target("ray", "sdp_jupyter.launch.target_options:RAY_OPTIONS",
                  warm=True, exclusive=True, sessions=True, own_hosts=True, elastic=True, heal=True),
    "slurm": Target("slurm",
                    "sdp_jupyter.launch.target_options:SLURM_OPTIONS", exclusive=True, sessions=True, own_hosts=True,
                    elastic=True, heal=True),
    "sagemaker": Target("sagemaker",
                        "sdp_jupyter.launch.kernel.sagemaker.options:SAGEMAKER_OPTIONS", hybrid=True, catalogue=True,
                        elastic_refusal="a training job's instance count is fixed when it starts (SageMaker "
                                        "restarts a failed job whole: --max-restarts)"),
}


def register(name: str, target: Target) -> None:
    """Add a target (before the spec, the magics or the CLI are imported: they build their tables from
    TARGETS once). The test suite registers a throwaway one to show every list follows."""
    if name in TARGETS:
        raise ValueError(f"a target named {name!r} is registered already")
    TARGETS[name] = target


def having(flag: str) -> tuple[str, ...]:
    """The targets whose record sets `flag` ("sessions", "hybrid", "warm", ...), in registry order."""
    return tuple(name for name, t in TARGETS.items() if getattr(t, flag))


def listed() -> str:
    """The targets as a sentence says them ("local, ssh, ray, slurm or sagemaker"), for the help texts
    that name them (--target, sdp-train --help): a new target is named there with no edit."""
    return sentence(tuple(TARGETS), "or")


def sentence(names: tuple[str, ...], last: str = "and") -> str:
    """Names as a sentence lists them: "ssh, ray and slurm"."""
    names = list(names)
    return f"{', '.join(names[:-1])} {last} {names[-1]}" if len(names) > 1 else "".join(names)


def nodes_default() -> str:
    """What --nodes left out means, as its help says it: 1, except on the targets whose nodes are their
    hosts (nodes_from_hosts), where it is one node per host given."""
    per_host = [f"--target {name}" for name, t in TARGETS.items() if t.nodes_from_hosts]
    return "default 1" + (f"; with {' or '.join(per_host)}: one per host given" if per_host else "")
