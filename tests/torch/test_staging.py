"""Chunked staging (sdp_jupyter.torch.tensors.Staging), the path large CUDA tensors take, run on CPU
tensors with `staging.chunk_cpu` set: all_reduce (SUM, AVG, MAX in fp32, bf16 and fp16), broadcast,
reduce and stock DDP give the same bits with chunking as without, for chunk sizes that do and do not
divide the tensors, and in-place results, async works, futures and coalesced calls behave as they do
unchunked. tests/torch/test_gpu.py runs the same cases on CUDA tensors on a GPU machine."""
from __future__ import annotations

import math
import os

import pytest
import torch

from helpers.ranks import ROOT, assert_all_ok, run_ranks
from helpers.staging_workers import differences, same
from sdp_jupyter.torch.tensors import DEFAULT_STAGE_CHUNK_BYTES, Staging, stage_chunk_bytes_from_env

_ENV = {"PYTHONPATH": os.path.join(ROOT, "tests", "helpers") + os.pathsep + ROOT}
# 4096 B: 1024 fp32 elements (the tests' 10007 are 9 whole chunks and a part); 6000 B: 1500 fp32 and
# 3000 bf16, neither dividing 10007; 40000 B: four chunks, the last one short
CHUNKS = [4096, 6000, 40000]


def _engine_collectives(calls: list[int], chunk: int | None) -> int:
    """What the engine runs for these calls: one collective per chunk of a tensor over `chunk` bytes."""
    return sum(math.ceil(b / chunk) if chunk and b > chunk else 1 for b in calls)


@pytest.mark.parametrize("world,per_node", [(2, 2), (3, 3), (2, 1)])
def test_chunked_collectives_equal_unchunked_bit_for_bit(world, per_node):
    """One node of 2 and of 3 ranks (shared memory), and 2 nodes of one rank (TCP)."""
    vals = assert_all_ok(run_ranks("staging_workers:collectives", world, per_node, args=(CHUNKS,), env=_ENV,
                                   timeout=120))
    for rank, runs in enumerate(vals):
        assert not differences(runs), (rank, differences(runs))
        calls = runs[None][1]
        for chunk in CHUNKS:  # exactly one engine collective per chunk
            assert runs[chunk][2] == _engine_collectives(calls, chunk), (rank, chunk, runs[chunk][2])
    # the same result on every rank (the reduce's root alone holds one)
    for key, value in vals[0][CHUNKS[0]][0].items():
        if key != "reduce":
            assert all(same(value, v[CHUNKS[0]][0][key]) for v in vals), key


def test_stock_ddp_gradients_equal_unchunked_bit_for_bit():
    """DDP's bucket all_reduces (and its first broadcast of the parameters), chunked, in fp32 and bf16."""
    vals = assert_all_ok(run_ranks("staging_workers:ddp", 2, 2, args=([4096, 10000],), env=_ENV, timeout=120))
    for rank, runs in enumerate(vals):
        for chunk in (4096, 10000):
            for dtype, (params, taken) in runs[None].items():
                got, taken_c = runs[chunk][dtype]
                assert taken_c > taken, (chunk, dtype, taken_c, taken)  # the buckets went in chunks
                for i, (a, b) in enumerate(zip(params, got, strict=True)):
                    assert torch.equal(a, b), (rank, chunk, dtype, i, (a.float() - b.float()).abs().max())
                    assert torch.equal(b, vals[0][chunk][dtype][0][i]), ("ranks differ", chunk, dtype, i)


def test_a_mismatch_inside_the_chunks_fails_every_rank_with_torchs_error():
    """Rank 1's tensor is longer: the chunks agree until rank 0's last. Both ranks raise
    DistBackendError naming the element counts; nothing hangs."""
    res = run_ranks("staging_workers:mismatch", 2, 2, args=(4096,), env={**_ENV, "SDP_TIMEOUT": "20"}, timeout=60)
    msgs = assert_all_ok(res)
    for msg in msgs:
        assert "element count differs" in msg and "rank 0 has 452, rank 1 has 1024" in msg, msg


def test_chunk_size_setting(monkeypatch):
    monkeypatch.delenv("SDP_STAGE_CHUNK_BYTES", raising=False)
    assert stage_chunk_bytes_from_env() == DEFAULT_STAGE_CHUNK_BYTES == 4 << 20
    monkeypatch.setenv("SDP_STAGE_CHUNK_BYTES", "8388608")
    assert stage_chunk_bytes_from_env() == 8 << 20
    for bad in ("1000", "4MiB", "nan"):
        monkeypatch.setenv("SDP_STAGE_CHUNK_BYTES", bad)
        with pytest.raises(ValueError, match="SDP_STAGE_CHUNK_BYTES"):
            stage_chunk_bytes_from_env()


def test_which_tensors_are_chunked():
    """By device type and size alone (every rank must split a collective alike): a CUDA tensor over
    the chunk size, contiguous or not; a CPU tensor only when the tests ask for it."""
    s = Staging(4096)
    big, small = torch.empty(1025), torch.empty(1024)
    assert not s.takes(big) and not s.takes(small)
    s.chunk_cpu = True
    assert s.takes(big) and s.takes(torch.empty(2, 1025).t()) and not s.takes(small)
    assert s.takes(torch.empty(4097, dtype=torch.uint8)) and not s.takes(torch.empty(4096, dtype=torch.bool))
    if torch.cuda.is_available():
        s.chunk_cpu = False
        assert s.takes(big.cuda()) and not s.takes(small.cuda())
