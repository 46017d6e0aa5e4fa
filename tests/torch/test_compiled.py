"""Compiled training on smddp (issue 59): torch.compile over stock DistributedDataParallel (its graph split at
the buckets by dynamo's DDPOptimizer, and whole), over our DDP wrapper, over FSDP2 and a tensor-parallel
model, and functional collectives inside a compiled function end with gloo's weights. Before torch/compiled.py, dynamo traced into our process
group's Python and failed: "UnsafeScriptObjectError: Attempted to access unregistered member on an
OpaqueObject". aot_eager: dynamo's tracing and the graph split are what broke, not inductor's code."""
from __future__ import annotations

import pytest
import torch

from helpers.ranks import assert_all_ok, run_ranks

pytestmark = pytest.mark.slow


def test_compiled_recipes_train_on_smddp_to_the_weights_of_gloo():
    runs = {backend: assert_all_ok(run_ranks("compile_workers:compiled_recipes", 2, 2, args=(backend, "aot_eager"),
                                             timeout=240), f"the {backend} run")
            for backend in ("gloo", "smddp")}
    for recipe in runs["gloo"][0]:
        for rank in range(2):
            ours, theirs = runs["smddp"][rank][recipe], runs["gloo"][rank][recipe]
            for a, b in zip(ours, theirs):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{recipe}, rank {rank}: {m}")
    assert len(runs["gloo"][0]) == 6
