"""The SSH and Ray targets' own option rows (JobSpec.ssh, JobSpec.ray), in a leaf: the option table
(spec.all_options) reads them without importing the targets, which import spec (launch/kernel/ssh.py
and ray.py use them from here). The SageMaker target's rows: launch/kernel/sagemaker/options.py.
"""
from __future__ import annotations

from sdp_jupyter.launch.options import Option

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
