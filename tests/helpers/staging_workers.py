"""Rank functions for the chunked staging tests (tests/torch/test_staging.py; run by tests/helpers/ranks.py
with this folder on PYTHONPATH). The chunked path is the one large CUDA tensors take (sdp_jupyter.torch.
tensors.Staging); `staging.chunk_cpu` sends CPU tensors through it, so that it runs without a GPU.
Every rank sets the same staging at the same point: chunking changes the collectives the engine sees."""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

import sdp_jupyter.torch  # noqa: F401 - registers smddp
from sdp_jupyter.torch import ProcessGroupSMDDP

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}


def _group() -> ProcessGroupSMDDP:
    dist.init_process_group("smddp")
    pg = dist.group.WORLD
    assert isinstance(pg, ProcessGroupSMDDP), type(pg)
    return pg


def _chunking(pg: ProcessGroupSMDDP, chunk_bytes: int | None) -> None:
    """chunk_bytes None: nothing chunked (a contiguous CPU tensor is reduced in place, a CUDA one
    staged whole); else CPU and CUDA tensors over chunk_bytes go in chunks."""
    pg.staging.chunk_cpu = chunk_bytes is not None
    pg.staging.chunk_bytes = chunk_bytes or 1 << 62


def _collectives_run(pg, device: str, n: int) -> tuple[dict, list, int]:
    """Every case once: (results by name on the CPU, the bytes of each tensor every rank handed to
    a collective, the engine collectives they took)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(1000 + rank)
    before = pg.comm.stats()["collectives"]
    out, calls = {}, []

    def counted(f):  # records the bytes of the tensor each call hands over
        def call(t, *args, **kwargs):
            calls.append(t.numel() * t.element_size())
            return f(t, *args, **kwargs)
        return call
    all_reduce, broadcast, reduce = counted(dist.all_reduce), counted(dist.broadcast), counted(dist.reduce)
    for dtype in DTYPES:
        for name, op in OPS.items():
            t = torch.randn(n, generator=gen).to(dtype).to(dev)
            ptr = t.data_ptr()
            all_reduce(t, op=op)
            assert t.data_ptr() == ptr  # in place
            out[f"all_reduce {dtype} {name}"] = t.cpu()
    # a contiguous view inside a larger tensor: only the view changes
    whole = torch.full((n + 10,), -7.0, device=dev)
    view = whole[5:5 + n]
    view.copy_(torch.randn(n, generator=gen))
    all_reduce(view)
    assert torch.equal(whole[:5].cpu(), torch.full((5,), -7.0)) and torch.equal(whole[-5:].cpu(), torch.full((5,), -7.0))
    out["all_reduce view"] = whole.cpu()
    # non-contiguous (a transposed matrix): chunked from a contiguous copy, as a contiguous one would be
    cols = torch.randn(n // 4, 4, generator=gen).to(dev).t()
    all_reduce(cols)
    out["all_reduce non-contiguous"] = cols.cpu()
    # async: two in flight, waited for in the other order; the result lands in each tensor
    a, b = torch.randn(n, generator=gen).to(dev), torch.randn(n, 2, generator=gen).to(dev)
    wa, wb = all_reduce(a, async_op=True), all_reduce(b, op=dist.ReduceOp.MAX, async_op=True)
    assert wb.wait(timeout=datetime.timedelta(seconds=60)) is True
    assert wa.wait() is True and wa.is_completed() and wa.is_success() and wb.is_completed()
    assert wa.wait() is True  # a second wait is a no-op
    out["async a"], out["async b"] = a.cpu(), b.cpu()
    # a future (DDP's reducer asks for one): completed by the process group's thread
    c = torch.randn(n, generator=gen).to(dev)
    fut = all_reduce(c, async_op=True).get_future()
    got = fut.wait()
    assert got[0] is c, got
    out["future"] = c.cpu()
    # several tensors in one call (the coalesced form): one work
    ts = [torch.randn(n, generator=gen).to(dev), torch.randn(3, generator=gen).to(dev),
          torch.randn(n + 1, generator=gen).to(dev)]
    pg.allreduce(ts).wait()
    calls += [t.numel() * t.element_size() for t in ts]
    out["coalesced"] = [t.cpu() for t in ts]
    d = torch.randn(n, generator=gen).to(dev)
    broadcast(d, src=world - 1)
    out["broadcast"] = d.cpu()
    if dev.type == "cuda":
        # on a stream of the caller's, behind a long kernel: the copies to the host wait for the
        # work queued before the call, and the result is there for the work queued after wait()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            f = torch.randn(n, generator=gen).to(dev)
            torch.cuda._sleep(50_000_000)
            f.mul_(3)
            all_reduce(f)
            out["caller's stream"] = (f + 1).cpu()
    e = torch.randn(n, generator=gen).to(dev)
    before_e = e.clone()
    reduce(e, dst=0)
    if rank == 0:
        out["reduce"] = e.cpu()
    else:  # a non-root's tensor is left as it was
        assert torch.equal(e, before_e)
    return out, calls, pg.comm.stats()["collectives"] - before


def collectives(chunk_sizes: list, device: str = "cpu", n: int = 10007) -> dict:
    """The same cases on the same inputs once per staging: None (not chunked) and each chunk size.
    Returns {chunk size: (results, bytes of each call, engine collectives taken)}."""
    pg = _group()
    runs = {}
    for chunk in [None, *chunk_sizes]:
        _chunking(pg, chunk)
        runs[chunk] = _collectives_run(pg, device, n)
    dist.destroy_process_group()
    return runs


def ddp(chunk_sizes: list, steps: int = 3) -> dict:
    """A few steps of stock DDP on a small MLP (about 34k parameters: one 1 MiB bucket of fp32)
    in fp32 and bf16, per staging; returns {chunk size: {dtype: (parameters, engine collectives)}}."""
    pg = _group()
    rank = dist.get_rank()
    runs = {}
    for chunk in [None, *chunk_sizes]:
        _chunking(pg, chunk)
        runs[chunk] = {}
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0 + rank)  # different starting weights: DDP's broadcast makes them rank 0's
            model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 64)).to(dtype)
            before = pg.comm.stats()["collectives"]
            ddp_model = torch.nn.parallel.DistributedDataParallel(model)
            opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05)
            data = torch.randn(steps, 2, 8, 64, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)
            for x, y in data:  # this rank's batches
                opt.zero_grad()
                torch.nn.functional.mse_loss(ddp_model(x), y).backward()
                opt.step()
            runs[chunk][str(dtype)] = ([p.detach().clone() for p in model.parameters()],
                                       pg.comm.stats()["collectives"] - before)
    dist.destroy_process_group()
    return runs


def same(a, b) -> bool:
    """Equal to the bit: two tensors, or two lists of them."""
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def differences(runs: dict) -> list[str]:
    """What `collectives` returned on one rank, checked (by the test): every chunked run equals the
    unchunked one to the bit, on the same calls, and took more engine collectives (it did chunk)."""
    base, calls, taken = runs[None]
    found = [] if taken == len(calls) else [f"unchunked: {taken} engine collectives for {len(calls)} calls"]
    for chunk, (got, calls_c, taken_c) in runs.items():
        if chunk is None:
            continue
        if calls_c != calls or taken_c <= taken:
            found.append(f"chunks of {chunk} B: {taken_c} engine collectives for {len(calls_c)} calls")
        found += [f"chunks of {chunk} B: {k} differs" for k in base if k not in got or not same(base[k], got[k])]
    return found


def mismatch(chunk_bytes: int) -> str:
    """Chunked on every rank, but rank 1's tensor is longer: the chunks agree up to the last one of
    rank 0, whose element count differs. Every rank gets torch's backend error, nothing hangs."""
    pg = _group()
    _chunking(pg, chunk_bytes)
    rank = dist.get_rank()
    t = torch.ones(2500 + 700 * rank)
    try:
        dist.all_reduce(t)
    except dist.DistBackendError as exc:
        return str(exc)
    finally:
        pg.comm.close()
    raise AssertionError(f"rank {rank}: the mismatched all_reduce did not fail")
