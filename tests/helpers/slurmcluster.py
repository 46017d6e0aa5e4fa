"""The Slurm target's test fixture: slurmctld on h0 and slurmd on h1..h3 of the shared cluster-in-a-box
(sdp_jupyter.testing.slurm), started on first use and stopped by PID at the end of the session."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def slurm_hosts(cluster4, tmp_path_factory):
    """A running Slurm cluster on the test hosts; skipped without slurm-wlm and munge, with the reason."""
    from sdp_jupyter.testing.slurm import SlurmHosts, missing

    why = missing()
    if why:
        pytest.skip(why)
    hosts = SlurmHosts(cluster4, tmp_path_factory.mktemp("slurm"))
    try:
        hosts.start()
        yield hosts
    finally:
        hosts.stop()
