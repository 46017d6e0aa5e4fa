"""The SSH target's test fixture: sshd on h1..h3 of the shared cluster-in-a-box (sdp_jupyter.testing.sshd)."""
from __future__ import annotations

import os
import shutil

import pytest

from sdp_jupyter.testing.sshd import SSHD, SSHHosts


@pytest.fixture(scope="session")
def ssh_hosts(cluster4, tmp_path_factory):
    """sshd on h1..h3 of the shared cluster; the client config for h0. Skipped without sshd."""
    if not os.path.exists(SSHD) or shutil.which("ssh") is None:
        pytest.skip("openssh-server / openssh-client are not installed (./dev.sh test installs them)")
    root = tmp_path_factory.mktemp("ssh")
    os.chmod(root, 0o700)
    hosts = SSHHosts(cluster4, root)
    try:
        hosts.start()
        yield hosts
    finally:
        hosts.stop()


