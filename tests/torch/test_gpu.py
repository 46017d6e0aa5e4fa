"""The GPU checks: smddp against gloo on CUDA tensors in real rank processes, and the NVML sampler.

    pytest --noconftest -q tests/torch/test_gpu.py      # on a GPU machine; tools/gpu_check.sh runs it

Every test is marked `gpu` and skips when torch.cuda.is_available() is False. The module is
self-contained: it needs nothing from tests/conftest.py (whose imports pull in the Ray, sshd and
moto helpers) and no notebook package (no IPython, ipywidgets, plotly), so `--noconftest` runs it
on a bare GPU machine. tests/helpers/ranks.py (standard library only) starts the ranks; each rank
imports this module for `rank_main` (tests/ is on its PYTHONPATH).

Two ranks share GPU 0 (torch.cuda.set_device(0); NCCL would need one GPU per rank, smddp and gloo
do not). Each rank process runs the smddp case, then the gloo case, as two process groups one after
the other (`init_process_group(rank=, world_size=, init_method="tcp://127.0.0.1:PORT")`, a port
each), so both backends see the same seeds, inputs and GPU, and the test compares their results
bit for bit: with 2 ranks a sum has one order, and fp16/bf16 round once either way.

Where gloo cannot serve the case on CUDA tensors, its reference is computed another way: send/recv
run on CPU tensors of the same values (gloo's send and recv hand the tensor's pointer to the socket
as host memory); AVG is gloo's sum, halved (gloo has no AVG; exact in every float type); FSDP2's full
parameters come from FSDP's own unshard(), because DTensor.full_tensor() on gloo with CUDA tensors
crashed both ranks (SIGSEGV; smddp's full_tensor() is checked against unshard()).

On one H200 (torch 2.11, 16 cores) the module took about 45 s.
"""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers (--noconftest)
from helpers.ranks import ROOT, assert_all_ok, free_port, run_ranks  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA (torch.cuda.is_available() is False): run on a GPU machine, "
                                          "e.g. with tools/gpu_check.sh")]

TESTS = os.path.dirname(os.path.abspath(__file__))
BACKENDS = ("smddp", "gloo")
SIZES = (37, 300_001)  # one small message; one of 1.2 MB in fp32, through the engine's chunked paths
WORLD = 2


# ---- rank side ---------------------------------------------------------------------------------

def rank_main(what: str, device: str, ports: list[int]) -> dict:
    """One rank: `what` ("collectives", "messages", "ddp", "fsdp2") under smddp, then under gloo,
    on tensors of `device` ("cuda": GPU 0, shared by the ranks; "cpu" to try the code without a GPU).
    Returns {backend: results on the CPU}."""
    import sdp_jupyter.torch  # noqa: F401 - registers smddp (the entry point does too)

    if device == "cuda":
        torch.cuda.set_device(0)
        # cuBLAS picks one algorithm per shape: the two backends' steps compute the same floats
        torch.use_deterministic_algorithms(True, warn_only=True)
    out = {}
    for backend, port in zip(BACKENDS, ports):
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
        try:
            out[backend] = _WORK[what](backend, torch.device(device))
        finally:
            dist.destroy_process_group()
    return out


class _Results:
    """Values by name, moved to the CPU, and the devices the backend left them on."""

    def __init__(self, rank: int):
        self.gen = torch.Generator().manual_seed(1000 + rank)
        self.values: dict = {}
        self.devices: set = set()

    def data(self, n: int, dev, dtype=torch.float32) -> torch.Tensor:
        """The next n random values: the same sequence whichever backend or device asks."""
        return torch.randn(n, generator=self.gen).to(dtype).to(dev)

    def keep(self, key: str, *ts: torch.Tensor) -> None:
        self.devices.update(str(t.device) for t in ts)
        self.values[key] = [t.cpu() for t in ts]

    def done(self) -> dict:
        return {"values": self.values, "devices": sorted(self.devices)}


def _collectives(backend: str, dev) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    res = _Results(rank)
    ops = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}
    for n in SIZES:
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for name, op in ops.items():
                t = res.data(n, dev, dtype)
                if name == "avg" and backend == "gloo":  # gloo has no AVG: the sum, halved (exact)
                    dist.all_reduce(t)
                    t.div_(world)
                else:
                    dist.all_reduce(t, op=op)
                res.keep(f"all_reduce {dtype} {name} n={n}", t)
        t = res.data(n, dev)
        dist.all_reduce(t, async_op=True).wait()
        res.keep(f"all_reduce async_op n={n}", t * 1)  # read on the current stream after wait()
        t = res.data(n, dev)
        dist.broadcast(t, src=1)
        res.keep(f"broadcast n={n}", t)
        t = res.data(n, dev)
        dist.reduce(t, dst=0)
        if rank == 0:  # what a non-root holds afterwards is not specified
            res.keep(f"reduce n={n}", t)
        parts = [torch.empty(n, device=dev) for _ in range(world)]
        dist.all_gather(parts, res.data(n, dev))
        res.keep(f"all_gather n={n}", *parts)
        flat = torch.empty(world * n, device=dev)
        dist.all_gather_into_tensor(flat, res.data(n, dev))
        res.keep(f"all_gather_into_tensor n={n}", flat)
        mine = torch.empty(n, device=dev)
        dist.reduce_scatter_tensor(mine, res.data(world * n, dev))
        res.keep(f"reduce_scatter_tensor n={n}", mine)
        got = [torch.empty(n, device=dev) for _ in range(world)] if rank == 0 else None
        dist.gather(res.data(n, dev), got, dst=0)
        if rank == 0:
            res.keep(f"gather n={n}", *got)
        s = torch.empty(n, device=dev)
        dist.scatter(s, [res.data(n, dev) for _ in range(world)] if rank == 1 else None, src=1)
        res.keep(f"scatter n={n}", s)
        a2a = torch.empty(world * n, device=dev)
        dist.all_to_all_single(a2a, res.data(world * n, dev))
        res.keep(f"all_to_all_single n={n}", a2a)
        # uneven blocks: rank i sends (i + j + 1) * k elements to rank j, which is what j expects from i
        k = max(1, n // 16)
        splits = [(rank + j + 1) * k for j in range(world)]
        uneven = torch.empty(sum(splits), device=dev)
        dist.all_to_all_single(uneven, res.data(sum(splits), dev), splits, splits)
        res.keep(f"all_to_all_single uneven n={n}", uneven)
    dist.barrier()
    res.values["barrier"] = True
    return res.done()


def _messages(backend: str, dev) -> dict:
    """send/recv, isend/irecv (both ways at once, with a tag) and batch_isend_irecv. gloo runs on
    CPU tensors: its send and recv give the tensor's pointer to the socket as host memory."""
    if backend == "gloo":
        dev = torch.device("cpu")
    rank = dist.get_rank()
    peer = 1 - rank
    res = _Results(rank)
    for n in SIZES:
        for dtype in (torch.float32, torch.bfloat16):
            mine = res.data(n, dev, dtype)
            got = torch.empty(n, dtype=dtype, device=dev)
            if rank == 0:
                dist.send(mine, 1)
                dist.recv(got, 1)
            else:
                dist.recv(got, 0)
                dist.send(mine, 0)
            res.keep(f"send/recv {dtype} n={n}", got)
        mine, got = res.data(n, dev), torch.empty(n, device=dev)
        works = [dist.irecv(got, peer, tag=7), dist.isend(mine, peer, tag=7)]
        for w in works:
            w.wait()
        res.keep(f"isend/irecv n={n}", got)
        mine, got = res.data(n, dev), torch.empty(n, device=dev)
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, mine, peer), dist.P2POp(dist.irecv, got, peer)]):
            w.wait()
        res.keep(f"batch_isend_irecv n={n}", got)
    return res.done()


def _train(backend: str, dev, wrap, full, steps: int = 4) -> dict:
    """A few SGD steps of a small MLP wrapped by `wrap`, each rank on its own batches. Returns the
    full parameters (`full(model)`: name -> tensor) on the CPU with the devices they were on, and
    the initial ones to show that it trained."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 4)).to(dev)
    first = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    model = wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(32, 16, generator=gen).to(dev), torch.randn(32, 4, generator=gen).to(dev)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    params = {n: p.detach() for n, p in full(model).items()}
    return {"params": {n: p.cpu() for n, p in params.items()}, "devices": sorted({str(p.device) for p in params.values()}),
            "first": first}


def _ddp(backend: str, dev) -> dict:
    return _train(backend, dev, torch.nn.parallel.DistributedDataParallel, lambda m: dict(m.module.named_parameters()))


def _fsdp2(backend: str, dev) -> dict:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    def wrap(model):
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer)
        return fully_shard(model)

    def full(model):
        """The full parameters through FSDP's own all-gather (unshard): DTensor.full_tensor() goes
        through functional collectives, and on gloo with CUDA tensors that crashed both ranks (SIGSEGV
        in wait_tensor, torch 2.11; gloo serves it with its coalesced all-gather, which has no CUDA
        path). On smddp full_tensor() is checked against unshard() as well."""
        dtensor_full = {n: p.full_tensor() for n, p in model.named_parameters()} if backend == "smddp" else None
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.unshard()
        got = dict(model.named_parameters())
        if dtensor_full is not None:
            for n, p in got.items():
                assert torch.equal(p, dtensor_full[n]), f"smddp: {n}: full_tensor() differs from FSDP's unshard()"
        return got

    return _train(backend, dev, wrap, full)


_WORK = {"collectives": _collectives, "messages": _messages, "ddp": _ddp, "fsdp2": _fsdp2}


# ---- test side ---------------------------------------------------------------------------------

def _run(what: str, device: str = "cuda") -> list[dict]:
    """`what` on 2 ranks sharing GPU 0; a fresh 32-hex SDP_JOB_SECRET, as a launcher would give."""
    ports = [free_port(), free_port()]
    return assert_all_ok(run_ranks("test_gpu:rank_main", WORLD, WORLD, args=(what, device, ports), env=_env(),
                                   timeout=120), what)


def _env() -> dict:
    return {"PYTHONPATH": os.pathsep.join([TESTS, os.path.dirname(TESTS), ROOT, os.environ.get("PYTHONPATH", "")]),
            "SDP_JOB_SECRET": secrets.token_hex(16), "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "OMP_NUM_THREADS": "2"}


def _assert_same(smddp: dict, gloo: dict, what: str) -> None:
    assert smddp.keys() == gloo.keys(), (what, sorted(set(smddp) ^ set(gloo)))
    for key in smddp:
        if isinstance(smddp[key], bool):
            assert smddp[key] == gloo[key], (what, key)
            continue
        for a, b in zip(smddp[key], gloo[key], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, (what, key)
            assert torch.equal(a, b), f"{what}: {key}: smddp differs from gloo by up to {(a.float() - b.float()).abs().max()}"


@pytest.fixture(scope="module")
def collectives():
    return _run("collectives")


def test_every_collective_on_cuda_tensors_equals_gloo(collectives):
    for rank, out in enumerate(collectives):
        s, g = out["smddp"], out["gloo"]
        assert s["devices"] == ["cuda:0"], s["devices"]  # results stay on the tensors' device
        _assert_same(s["values"], g["values"], f"rank {rank}")
        for dtype in ("float32", "float16", "bfloat16"):
            for op in ("sum", "avg", "max"):
                assert f"all_reduce torch.{dtype} {op} n={SIZES[1]}" in s["values"]
    # every rank holds the same all_reduce result
    for key, value in collectives[0]["smddp"]["values"].items():
        if key.startswith("all_reduce") or key.startswith("all_gather") or key.startswith("broadcast"):
            assert all(torch.equal(a, b) for a, b in zip(value, collectives[1]["smddp"]["values"][key])), key


def test_send_recv_isend_irecv_on_cuda_tensors_equal_gloo_on_the_same_values():
    out = _run("messages")
    for rank, o in enumerate(out):
        assert o["smddp"]["devices"] == ["cuda:0"] and o["gloo"]["devices"] == ["cpu"]
        _assert_same(o["smddp"]["values"], o["gloo"]["values"], f"rank {rank}")


@pytest.mark.parametrize("what", ["ddp", "fsdp2"])
def test_training_steps_on_cuda_parameters_equal_gloo(what):
    """Stock DistributedDataParallel, and FSDP2 (fully_shard per layer and on the root): after 4 SGD
    steps on each rank's own batches, the full parameters equal gloo's and each other rank's."""
    out = _run(what)
    for rank, o in enumerate(out):
        assert o["smddp"]["devices"] == ["cuda:0"] and o["gloo"]["devices"] == ["cuda:0"]
        for name, p in o["smddp"]["params"].items():
            assert torch.equal(p, o["gloo"]["params"][name]), (what, rank, name, (p - o["gloo"]["params"][name]).abs().max())
            assert torch.equal(p, out[0]["smddp"]["params"][name]), (what, "ranks differ", name)
            assert not torch.equal(p, o["smddp"]["first"][name]), (what, "did not train", name)


def test_chunked_staging_of_cuda_tensors_equals_staging_whole():
    """The chunked path of large CUDA tensors (sdp_jupyter.torch.tensors.Staging: copies on two side
    streams, an event per chunk, copies back while the engine reduces the next chunk) gives the same
    bits as staging the tensor whole, for SUM, AVG and MAX in fp32, bf16 and fp16, chunk sizes that
    do and do not divide the tensors and the default one; in place, async, futures, coalesced calls,
    broadcast, reduce, and on a stream of the caller's behind a long kernel. The CPU half of this
    test is tests/torch/test_staging.py (the same rank function, CPU tensors)."""
    from helpers.staging_workers import differences
    from sdp_jupyter.torch.tensors import DEFAULT_STAGE_CHUNK_BYTES

    chunks = [(64 << 10) + 4, 1 << 20, DEFAULT_STAGE_CHUNK_BYTES]  # the first divides no tensor here
    n = 1_200_007  # 4.8 MB in fp32: two chunks of the default size; 2.4 MB in 16 bits: one
    vals = assert_all_ok(run_ranks("staging_workers:collectives", WORLD, WORLD, args=(chunks, "cuda", n), env=_env(),
                                   timeout=180), "chunked staging")
    for rank, runs in enumerate(vals):
        assert "caller's stream" in runs[None][0]
        assert not differences(runs), (rank, differences(runs))


# ---- the NVML sampler and the dashboard -------------------------------------------------------

LOAD = """
import time, torch
a = torch.randn(8192, 8192, device="cuda")
torch.cuda.synchronize()
end = time.time() + 5
while time.time() < end:
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
"""


@pytest.fixture(scope="module")
def sampled_job(tmp_path_factory):
    """A job directory whose node-0 sampler ran at 2 Hz while another process kept GPU 0 busy
    with fp32 matmuls for about 5 s: (job dir, sampler stderr, its lines)."""
    job = tmp_path_factory.mktemp("gpu-job")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("PYTEST_CURRENT_TEST", None)
    samp = subprocess.Popen([sys.executable, "-m", "sdp_jupyter.monitor.sampler", "--job-dir", str(job), "--node", "0",
                             "--interval", "0.5"], stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        load = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True, text=True, timeout=90)
        assert load.returncode == 0, load.stdout + load.stderr
    finally:
        samp.send_signal(signal.SIGTERM)
        _, err = samp.communicate(timeout=20)
    with open(job / "metrics" / "system-node-0.jsonl") as f:
        got = [json.loads(line) for line in f if line.strip()]
    return job, err, got


def test_nvml_sampler_reads_real_gpu_utilization(sampled_job):
    job, err, got = sampled_job
    assert got[0]["kind"] == "sampler" and got[0]["source"] == "nvml", (got[0], err)
    gpu0 = [x for x in got if x["kind"] == "system" and x["device"] == "gpu0"]
    assert gpu0 and all(x["source"] == "nvml" and "error" not in x for x in gpu0), gpu0
    assert all(0 <= x["util"] <= 100 and 0 < x["mem_used"] <= x["mem_total"] for x in gpu0), gpu0
    busy = max(x["util"] for x in gpu0)
    assert busy >= 50, f"the sampler never saw GPU 0 busy during 5 s of matmuls: {[x['util'] for x in gpu0]}"
    # the kernel-side reader (no plotly) sees GPU utilization, not CPU
    from sdp_jupyter.monitor.reader import read

    fr = read(str(job))
    assert fr.util_kind == "GPU" and (0, "gpu0") in fr.system
    assert max(v for v in fr.system[(0, "gpu0")]["util"] if v is not None) == busy


def test_dashboard_draws_the_gpu_traces(sampled_job):
    try:
        from sdp_jupyter.ui.dashboard import Dashboard

        dash = Dashboard(str(sampled_job[0]), start=False)
    except ImportError as exc:  # the GPU machine has neither plotly nor anywidget
        pytest.skip(f"the dashboard needs plotly and anywidget, not installed here ({exc})")
    try:
        trace = dash.trace("node 0 GPU0")
        utils = [x["util"] for x in sampled_job[2] if x["kind"] == "system" and x["device"] == "gpu0"]
        assert trace is not None and list(trace.y) == utils, dash.trace_names()
        assert dash.layout.annotations[1].text.startswith("GPU utilization")
    finally:
        dash.close()
