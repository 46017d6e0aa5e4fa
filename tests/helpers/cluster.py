"""One cluster-in-a-box for the whole test session (set-up costs under a second, but every test
module that needs hosts shares it). Use it as a fixture: `from helpers.cluster import cluster4`."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def cluster4():
    """4 test hosts (h0..h3, 10.213.0.1-4) joined by 2 Gbit/s links; skipped where namespaces
    cannot be made (not root, no iproute2), with the reason."""
    from sdp_jupyter.testing import cluster

    why = cluster.available()
    if why:
        pytest.skip(f"no test hosts: {why}")
    with cluster.Cluster(hosts=4, rate="2gbit") as c:
        yield c


@pytest.fixture
def hosts(cluster4):
    """The shared cluster, with every link healed and back at 2 Gbit/s after the test."""
    yield cluster4
    for h in range(cluster4.n):
        cluster4.heal(h)
        cluster4.shape(h, "2gbit")
