"""A session rank reads SDP_SESSION_CONNECT_TIMEOUT as every numeric setting is read: empty means the
default (300 s), and a bad number is an error naming the variable, raised before anything connects."""
from __future__ import annotations

import datetime
import socket

import pytest

from sdp_jupyter.launch.rank.cell_loop import RankSession


@pytest.fixture
def one_rank(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "SDP_BACKEND": "gloo", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(name, value)
    return RankSession({})


def test_an_empty_connect_timeout_means_the_default(one_rank, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("SDP_SESSION_CONNECT_TIMEOUT", "")
    one_rank.connect()
    try:
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert one_rank._store.timeout == datetime.timedelta(seconds=300)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("value, error", [("soon", "is not a number"), ("nan", "must be a finite number"),
                                          ("0", "must be at least")])
def test_a_bad_connect_timeout_is_an_error_naming_the_variable(one_rank, monkeypatch, value, error):
    import torch.distributed as dist

    monkeypatch.setenv("SDP_SESSION_CONNECT_TIMEOUT", value)
    with pytest.raises(ValueError, match=f"SDP_SESSION_CONNECT_TIMEOUT='{value}' {error}"):
        one_rank.connect()
    assert one_rank._store is None and not dist.is_initialized()
