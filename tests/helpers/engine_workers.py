"""Functions that run inside rank processes for the engine tests (see helpers/ranks.py)."""
from __future__ import annotations

import os
import time

import numpy as np

from sdp_jupyter import comm

DT = {"float32": np.float32, "float64": np.float64, "float16": np.float16, "int32": np.int32,
      "int64": np.int64, "uint8": np.uint8, "int8": np.int8}


def rank_data(rank: int, n: int, dtype: str, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed * 1000 + rank)
    if dtype.startswith("float"):
        return rng.uniform(-2, 2, n).astype(DT[dtype])
    if dtype in ("uint8",):
        return rng.integers(0, 4, n).astype(DT[dtype])
    return rng.integers(-3, 4, n).astype(DT[dtype])


def collectives(cases):
    """Run every (kind, n, dtype, op) case and return the outputs for the parent to check."""
    c = comm.init()
    out = []
    try:
        for kind, n, dtype, op, root in cases:
            x = rank_data(c.rank, n, dtype)
            if kind == "all_reduce":
                c.all_reduce(x, op=op)
                out.append(x)
            elif kind == "broadcast":
                c.broadcast(x, root=root)
                out.append(x)
            elif kind == "reduce":
                c.reduce(x, root=root, op=op)
                out.append(x)
            elif kind == "all_gather":
                o = np.zeros(n * c.world_size, dtype=x.dtype)
                c.all_gather(o, x)
                out.append(o)
            elif kind == "all_gather_list":
                outs = [np.zeros(n, dtype=x.dtype) for _ in range(c.world_size)]
                c.all_gather(outs, x)
                out.append(np.concatenate(outs))
            elif kind == "reduce_scatter":
                big = rank_data(c.rank, n * c.world_size, dtype)
                o = np.zeros(n, dtype=big.dtype)
                c.reduce_scatter(o, big, op=op)
                out.append(o)
            elif kind == "ring":  # a message to the next rank, one from the previous (tagged by n)
                o = np.zeros_like(x)
                w = c.send(x, (c.rank + 1) % c.world_size, tag=n, async_op=True)
                src = c.recv(o, (c.rank - 1) % c.world_size, tag=n)
                w.wait()
                assert src == (c.rank - 1) % c.world_size
                out.append(o)
            elif kind == "barrier":
                c.barrier()
                out.append(None)
        return {"out": out, "node": c.node, "local_rank": c.local_rank, "num_nodes": c.num_nodes}
    finally:
        comm.shutdown()


def mismatch(kind: str):
    c = comm.init(timeout=20)
    x = np.ones(10 if kind != "count" or c.rank == 0 else 12, dtype=np.float32)
    if kind == "dtype" and c.rank == c.world_size - 1:
        x = x.astype(np.float64)
    last = c.rank == c.world_size - 1
    if kind == "barrier":  # the others in what a barrier used to be: one uint8 all-reduced with max
        x = np.zeros(1, dtype=np.uint8)
    before = x.copy()
    try:
        c.barrier() if kind == "barrier" and last else c.all_reduce(x, op="max" if kind == "barrier" else "sum")
    except comm.SmddpError as exc:
        assert np.array_equal(x, before), "buffer changed although the collective failed"
        if kind == "barrier":
            from sdp_jupyter.comm import recorder

            return str(exc) + " | " + recorder.entry(tuple(c._engine.flight(1)[0]))[1]
        return str(exc)
    finally:
        comm.shutdown()
    return "no error"


def die_mid_training(victim: int):
    c = comm.init(timeout=60)
    x = np.ones(1000, dtype=np.float32)
    c.all_reduce(x)
    if c.rank == victim:
        os._exit(17)
    t0 = time.monotonic()
    try:
        for _ in range(100):
            c.all_reduce(x)
            time.sleep(0.01)
    except comm.SmddpError as exc:
        return {"error": str(exc), "after": time.monotonic() - t0}
    return {"error": "no error", "after": time.monotonic() - t0}


def stall(victim: int):
    c = comm.init(timeout=3)
    x = np.ones(100, dtype=np.float32)
    c.all_reduce(x)
    if c.rank == victim:
        time.sleep(8)
        return "slept"
    try:
        c.all_reduce(x)
    except comm.SmddpError as exc:
        return str(exc)
    return "no error"


def just_init():
    c = comm.init(timeout=10)
    x = np.ones(4, dtype=np.float32)
    c.all_reduce(x)
    comm.shutdown()
    return x.tolist()


def torch_ddp(steps: int, backend: str, seed: int = 0, hook: str | None = None):
    """Train a small model with stock DDP on `backend` (with torch's comm hook `hook`: "powerSGD" or
    "fp16"); return the final parameters."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    import sdp_jupyter.torch  # noqa: F401 - registers smddp

    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(seed)
    # Linear(6, 16)'s weight is compressed by PowerSGD at rank 1 (16 + 6 < 96 / 2); the biases and the
    # small Linear(16, 2) travel uncompressed: both of the hook's chains of futures run
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if hook == "powerSGD":
        # plain all_reduce for the first 3 steps, then PowerSGD: its callbacks run in the thread that
        # settles the future and ask for further futures there (all_reduce(...).get_future().wait())
        state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=3)
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    elif hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif hook is not None:
        raise ValueError(f"unknown hook {hook!r}")
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(123)
    for _ in range(steps):
        x = torch.randn(8 * world, 6, generator=g)
        y = torch.randn(8 * world, 2, generator=g)
        xs, ys = x[rank * 8:(rank + 1) * 8], y[rank * 8:(rank + 1) * 8]
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(xs), ys).backward()
        opt.step()
    params = [p.detach().clone() for p in model.parameters()]
    dist.destroy_process_group()
    return params


def torch_features():
    """find_unused_parameters, BatchNorm buffers, fp16_compress_hook, new_group, all_gather_object."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    import sdp_jupyter.torch  # noqa: F401

    dist.init_process_group("smddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    class Branchy(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.bn = torch.nn.BatchNorm1d(4)
            self.unused = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.bn(self.a(x))

    model = Branchy()
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        ddp(torch.randn(8, 4) + rank).sum().backward()
        opt.step()
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank, "w": model.a.weight.sum().item()})
    sub = dist.new_group([0, world - 1])
    sub_val = None
    if rank in (0, world - 1):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=sub)
        sub_val = t.item()
    out = {"objs": objs, "sub": sub_val, "bn_mean": model.bn.running_mean.tolist(),
           "weight": model.a.weight.detach().clone()}
    dist.destroy_process_group()
    return out


def torch_dtypes():
    import torch
    import torch.distributed as dist

    import sdp_jupyter.torch  # noqa: F401

    dist.init_process_group("smddp")
    rank = dist.get_rank()
    out = {}
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.bool):
        t = (torch.arange(5) % 2 == rank % 2) if dt == torch.bool else (torch.arange(5, dtype=torch.float32) * (rank + 1)).to(dt)
        dist.all_reduce(t)
        out[str(dt)] = t.tolist()
    dist.destroy_process_group()
    return out


def slow_job(seconds: float):
    c = comm.init(timeout=30)
    time.sleep(seconds)
    x = np.ones(10, dtype=np.float32)
    c.all_reduce(x)
    comm.shutdown()
    return x.tolist()


def wrapper_vs_stock(steps: int, accumulate: int, dtype: str, fusion: int, unused: bool):
    """Our DDP wrapper and stock DDP, same data, same seed: return both final parameter sets."""
    import torch
    import torch.distributed as dist

    import sdp_jupyter.torch as sdt

    dist.init_process_group("smddp")
    rank, world = dist.get_rank(), dist.get_world_size()
    dt = getattr(torch, dtype)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(6, 32)
            self.b = torch.nn.Linear(32, 32)
            self.c = torch.nn.Linear(32, 2)
            self.spare = torch.nn.Linear(32, 2)  # used only on rank 0 when `unused`

        def forward(self, x):
            h = torch.tanh(self.b(torch.tanh(self.a(x))))
            out = self.c(h)
            if not unused or rank == 0:
                out = out + 0.1 * self.spare(h)
            return out

    results = {}
    for kind in ("ours", "stock"):
        torch.manual_seed(0)
        net = Net().to(dt)
        if kind == "ours":
            model = sdt.DistributedDataParallel(net, fusion_threshold=fusion, find_unused_parameters=unused)
        else:
            model = torch.nn.parallel.DistributedDataParallel(net, find_unused_parameters=unused)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(7)
        for step in range(steps):
            opt.zero_grad()
            for micro in range(accumulate):
                x = torch.randn(4 * world, 6, generator=g).to(dt)
                y = torch.randn(4 * world, 2, generator=g).to(dt)
                xs, ys = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
                ctx = model.no_sync() if micro < accumulate - 1 else _nullcontext()
                with ctx:
                    torch.nn.functional.mse_loss(model(xs).float(), ys.float()).backward()
            opt.step()
        results[kind] = [p.detach().float().clone() for p in net.parameters()]
        if kind == "ours":
            results["last_step"] = dict(model.last_step)
            results["buckets"] = len(model.buckets)
    dist.destroy_process_group()
    return results


def _nullcontext():
    import contextlib
    return contextlib.nullcontext()


def init_without_import():
    """A script written for torchrun that never imports sdp_jupyter."""
    import sys

    import torch
    import torch.distributed as dist

    dist.init_process_group("smddp")
    t = torch.ones(3) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.tolist(), "sdp_jupyter.torch" in sys.modules


def mismatch_repeated(iterations: int, budget_s: float):
    """A fresh 4-rank group per iteration, the last rank passing 12 elements and the others 10:
    every rank must raise every time. Returns how many times this rank saw a success."""
    from sdp_jupyter.comm.store import TCPKeyValueStore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = TCPKeyValueStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), server=rank == 0, timeout=30)
    successes, runs = [], 0
    t0 = time.monotonic()
    for i in range(iterations):
        # All ranks agree on when to stop: rank 0 decides by the time budget, through the store.
        if rank == 0:
            store.set(f"go/{i}", b"0" if time.monotonic() - t0 > budget_s else b"1")
        if store.get(f"go/{i}") != b"1":
            break
        c = comm.Communicator(rank, world, store, prefix=f"rep{i}", timeout=10)
        x = np.ones(12 if rank == world - 1 else 10, dtype=np.float32)
        try:
            c.all_reduce(x)
            successes.append(i)
        except comm.SmddpError as exc:
            if "mismatch" not in str(exc) and "lost" not in str(exc):
                raise AssertionError(f"iteration {i}: unexpected error {exc}") from None
        finally:
            c.close()
        runs += 1
    if rank == 0:
        time.sleep(0.5)  # let the others read the last key before the store goes
    store.close()
    return {"runs": runs, "successes": successes}


def where_am_i():
    """Host facts, for the test-host checks."""
    import socket as s

    return {"hostname": s.gethostname(), "shm": sorted(os.listdir("/dev/shm"))}


def all_reduce_until_error(n: int, seconds: float):
    """all_reduce in a loop for up to `seconds`; return the error text (or 'no error') and when."""
    c = comm.init()
    x = np.ones(n, dtype=np.float32)
    c.all_reduce(x)
    print("ready", flush=True)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            c.all_reduce(x)
    except comm.SmddpError as exc:
        return {"error": str(exc), "after": time.monotonic() - t0}
    finally:
        try:
            comm.shutdown()
        except Exception:  # noqa: BLE001 - the group is broken, shutting down is best effort
            pass
    return {"error": "no error", "after": time.monotonic() - t0}


def all_reduce_timed(n: int, repeats: int):
    """`repeats` all_reduces of n float32; returns the elapsed time and the first element."""
    c = comm.init()
    x = np.ones(n, dtype=np.float32)
    c.all_reduce(x)
    t0 = time.monotonic()
    for _ in range(repeats):
        x[:] = 1
        c.all_reduce(x)
    took = time.monotonic() - t0
    comm.shutdown()
    return {"took": took, "first": float(x[0])}


def leader_leaves_after_last_barrier(folder: str):
    """Two ranks of one node. Rank 1 writes its pid to folder/pid and enters an all_reduce once
    folder/go exists (the test has slowed its health probes meanwhile); rank 0, the leader, arrives
    a moment later, so it is the last into the collective's barrier, then shuts down at once. Rank
    1 must still get the sum: every rank reached the barrier."""
    c = comm.init(timeout=30)
    x = np.full(4, float(c.rank + 1), dtype=np.float32)
    c.all_reduce(x)  # set-up done on both sides
    if c.rank == 1:
        with open(os.path.join(folder, "pid.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(folder, "pid.tmp"), os.path.join(folder, "pid"))
    while not os.path.exists(os.path.join(folder, "go")):
        time.sleep(0.01)
    if c.rank == 0:
        # rank 1 is in the barrier by now, and half-way through one of its slowed probes: they
        # take 3 s each, back to back from the tracer's attach 1 s before `go` (test_barrier_race)
        time.sleep(6.5)
    x[:] = c.rank + 1
    c.all_reduce(x)
    if c.rank == 0:
        comm.shutdown()  # closes the node's connections while rank 1 may still be asleep
    return x.tolist()
