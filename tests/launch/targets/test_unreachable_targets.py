"""A target this machine cannot reach says so in its own words, naming the target (a Slurm controller, a
Ray head, an SSH host), and blames an option only when the user gave it: sbatch's words for "no controller
here" are told apart from a refusal of the request, with a real sbatch and no cluster."""
from __future__ import annotations

import os
import shutil
import sys
import time
import types

import pytest

from sdp_jupyter.launch import JobSpec, SpecError
from sdp_jupyter.launch.targets.slurm import launcher as slurm

# what Debian's Slurm 22.05 writes (recorded on this machine)
NO_CONFIGURATION = """sbatch: error: resolve_ctls_from_dns_srv: res_nsearch error: Unknown host
sbatch: error: fetch_config: DNS SRV lookup failed
sbatch: error: _establish_config_source: failed to fetch config
sbatch: fatal: Could not establish a configuration source
"""
EMPTY_CONFIGURATION = """sbatch: s_p_parse_file: file "/etc/x/slurm.conf" is empty
sbatch: error: ClusterName needs to be specified
sbatch: fatal: Unable to process configuration file
"""
NO_ANSWER = "allocation failure: Unable to contact slurm controller (connect failure)\n"
REFUSED = "sbatch: error: Batch job submission failed: Invalid qos specification\n"


def test_sbatchs_words_for_no_controller_are_told_apart_from_a_refusal(monkeypatch, tmp_path):
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=c\nSlurmctldHost=head1(10.0.0.1)\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    said = {name: slurm.no_controller(text) for name, text in
            (("none", NO_CONFIGURATION), ("empty", EMPTY_CONFIGURATION), ("down", NO_ANSWER), ("refused", REFUSED))}
    assert said["none"].startswith("no Slurm configuration here") and "Could not establish a configuration source" \
        in said["none"], said
    assert said["empty"] == f"the Slurm configuration {conf} cannot be used; Slurm says: Unable to process " \
                            "configuration file", said
    assert said["down"].startswith("the controller at head1(10.0.0.1) does not answer from here"), said
    assert said["refused"] is None


def test_only_an_option_the_user_gave_is_blamed():
    plain = JobSpec(code="x", target="slurm")
    with_args = JobSpec(code="x", target="slurm", slurm={"args": "--qos=high"})
    for spec in (plain, with_args):  # no controller: the target is named, never --slurm-args
        e = slurm.explain_refusal(spec, NO_CONFIGURATION)
        assert e.option == "--target" and "this machine reaches no Slurm controller" in str(e), e
        assert "run the notebook on the cluster's login node" in str(e), e
    e = slurm.explain_refusal(with_args, REFUSED)
    assert e.option == "--slurm-args" and "sbatch refuses the request: Batch job submission failed" in str(e), e
    e = slurm.explain_refusal(plain, REFUSED)  # a refusal with no --slurm-args given: Slurm's own words
    assert e.option == "--target" and str(e).startswith("--target: Slurm refuses the job: Batch job"), e


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed (Debian: slurm-client)")
def test_a_real_sbatch_without_a_cluster_says_this_machine_reaches_no_controller(monkeypatch, tmp_path):
    spec = JobSpec(code="x", target="slurm", slurm={"args": "--qos=high"})
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    empty = tmp_path / "empty.conf"
    empty.write_text("")
    down = tmp_path / "down.conf"  # a controller on a port of this machine where nothing listens
    down.write_text("ClusterName=c\nSlurmctldHost=nowhere(127.0.0.1)\nSlurmctldPort=1\nMessageTimeout=2\n"
                    "NodeName=n1 CPUs=1 State=UNKNOWN\nPartitionName=p Nodes=n1 Default=YES\n")
    cases = {empty: "the Slurm configuration", down: "the controller at nowhere(127.0.0.1) does not answer",
             tmp_path / "absent.conf": "names no file"}
    if not os.path.exists("/etc/slurm/slurm.conf"):
        cases[None] = "no Slurm configuration here"
    for conf, said in cases.items():
        if conf is None:
            monkeypatch.delenv("SLURM_CONF", raising=False)
        else:
            monkeypatch.setenv("SLURM_CONF", str(conf))
        t0 = time.monotonic()
        with pytest.raises(SpecError) as e:
            slurm.SlurmLauncher().resolve(spec)
        assert e.value.option == "--target", e.value
        assert str(e.value).startswith("--target: this machine reaches no Slurm controller (") and said in \
            str(e.value), e.value
        assert time.monotonic() - t0 < 15, conf


def _no_ray_here(monkeypatch):
    """A stand-in `ray` that has joined nothing and finds no head (a real ray.init("auto") could find a
    cluster another test started on this machine)."""
    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: False

    def init(**kwargs):
        raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to by "
                              "setting `--address` flag or `RAY_ADDRESS` environment variable.")

    fake.init = init
    monkeypatch.setitem(sys.modules, "ray", fake)


def test_ray_says_no_head_was_found_and_where_the_address_came_from(monkeypatch):
    from sdp_jupyter.launch.targets.ray import launcher as ray_target

    _no_ray_here(monkeypatch)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(SpecError) as e:
        ray_target.connect("auto")
    assert str(e.value).startswith("--address: this machine finds no Ray cluster to join (address auto: no "
                                   "--address given, RAY_ADDRESS not set), and no Ray head runs here"), e.value
    assert "cluster at auto" not in str(e.value)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # the address came from the kernel's environment
    with pytest.raises(SpecError, match=r"cannot reach the Ray cluster at 127\.0\.0\.1:1 within .*\(RAY_ADDRESS of "
                                        r"this kernel; no --address given\)"):
        ray_target.connect("127.0.0.1:1")
    with pytest.raises(SpecError) as e:  # the job's own --address: no word of RAY_ADDRESS
        ray_target.connect("127.0.0.1:1", given="127.0.0.1:1")
    assert "RAY_ADDRESS" not in str(e.value)


@pytest.mark.skipif(shutil.which("ssh") is None, reason="no OpenSSH client")
@pytest.mark.parametrize("how", ["hosts", "hostfile"])
def test_an_unreachable_ssh_host_is_named_under_the_option_that_named_it(tmp_path, how):
    from sdp_jupyter.launch.targets.ssh.launcher import SSHLauncher

    host = "no-such-host.invalid"  # .invalid never resolves (RFC 2606)
    if how == "hostfile":
        (tmp_path / "hosts").write_text(f"{host} slots=1\n")
        ssh = {"hostfile": str(tmp_path / "hosts")}
    else:
        ssh = {"hosts": host}
    with pytest.raises(SpecError) as e:
        SSHLauncher().start(JobSpec(code="x", target="ssh", ssh=ssh, jobs_dir=str(tmp_path / "jobs")))
    assert e.value.option == f"--{how}", e.value
    assert f"{host}: ssh cannot reach it" in str(e.value) and "resolve" in str(e.value), e.value
