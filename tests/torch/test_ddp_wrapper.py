"""sdp_jupyter.torch.DistributedDataParallel gives the same parameters as stock DDP."""
from __future__ import annotations

import pytest
import torch

from helpers.ranks import assert_all_ok, run_ranks


@pytest.mark.slow
@pytest.mark.parametrize("world,per_node,accumulate,dtype,fusion,unused", [
    (2, 2, 1, "float32", 4096, False),          # several fusion buffers
    (2, 1, 2, "float32", 1 << 20, False),       # gradient accumulation with no_sync, over TCP
    (3, 1, 1, "float32", 4096, True),           # a parameter only rank 0 uses
    (2, 2, 1, "bfloat16", 1024, False),         # 16-bit gradients stay 16-bit on the wire
])
def test_wrapper_matches_stock_ddp(world, per_node, accumulate, dtype, fusion, unused):
    vals = assert_all_ok(run_ranks("engine_workers:wrapper_vs_stock", world, per_node,
                                   args=(3, accumulate, dtype, fusion, unused), timeout=240))
    tol = {"float32": dict(rtol=1e-5, atol=1e-6), "bfloat16": dict(rtol=2e-2, atol=2e-2)}[dtype]
    for v in vals:
        for ours, stock in zip(v["ours"], v["stock"]):
            torch.testing.assert_close(ours, stock, **tol)
        for a, b in zip(v["ours"], vals[0]["ours"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)  # every rank holds identical weights
        assert v["last_step"]["bytes_reduced"] > 0
        assert 0 <= v["last_step"]["exposed_comm"] <= v["last_step"]["comm_time"] + 1e-3
    if fusion <= 4096:
        assert vals[0]["buckets"] > 1
