"""The SSH target: hosts you reach with `ssh HOST`, one node agent per host over ssh (launcher.py;
docs/ssh.md). Its record and option rows; the launcher imports the spec, so it is named as a string."""
from sdp_jupyter.launch.options import Option
from sdp_jupyter.launch.targets.record import FormField, Target

OPTIONS = (
    Option("--hosts", "ssh.hosts", "--target ssh: host names, as `ssh HOST` reaches them (user@host works)",
           kind="csv", metavar="H1,H2"),
    Option("--hostfile", "ssh.hostfile", '--target ssh: a DeepSpeed-style host file ("gpu1 slots=8" per line)',
           metavar="FILE"),
    Option("--python", "ssh.python", "--target ssh: the interpreter on the hosts (default: this one's path)",
           metavar="PATH"),
    Option("--ssh-config", "ssh.config", "--target ssh: an ssh_config file for these hosts (ssh -F)",
           metavar="FILE"),
)
KEYS = frozenset({"hosts", "hostfile", "python", "config"})

RECORD = Target(
    "ssh", ".launcher:SSHLauncher", "ssh", "sdp_jupyter.launch.targets.ssh:OPTIONS", KEYS,
    form=(FormField("hosts", OPTIONS[0], "SSH hosts", "gpu1,gpu2 (as `ssh HOST` reaches them)",
                    required="SSH hosts: enter the host names, e.g. gpu1,gpu2"),),
    warm=True, exclusive=True, nodes_from_hosts=True, sessions=True, own_hosts=True, elastic=True, heal=True)
