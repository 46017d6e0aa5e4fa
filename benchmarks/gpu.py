"""smddp against gloo (and NCCL) on CUDA tensors, measured in the same run.

    python benchmarks/gpu.py                     # 2 ranks: all_reduce fp32 4 KiB, 1 MiB, 64 MiB and bf16 64 MiB,
                                                 # and a stock DDP step of the 25M-parameter MLP
    python benchmarks/gpu.py --ranks 2,4         # also at 4 ranks
    python benchmarks/gpu.py --cpu               # the same cases on CPU tensors (no GPU needed; no NCCL)
    python benchmarks/gpu.py --out DIR/gpu.json  # where the JSON goes (default benchmarks/results/gpu.json)

Rank r uses GPU LOCAL_RANK % device_count: on a machine with one GPU every rank shares GPU 0, which
smddp and gloo allow (both stage CUDA tensors through host memory) and NCCL does not, so NCCL runs
only where there is a GPU per rank (device_count >= ranks), as "cpu:gloo,cuda:nccl". Each backend
runs in its own set of rank processes, one after the other, on the same tensors and model.

Prints per case each backend's median time (the slowest rank's; a CUDA synchronize ends every
call), all_reduce bus bandwidth (size/time x 2(n-1)/n) and gloo/smddp, gloo's time over smddp's
(above 1: smddp is faster), and nccl/smddp where NCCL ran. smddp stages a large CUDA tensor in
chunks (SDP_STAGE_CHUNK_BYTES, default 4 MiB: a chunk's copies to and from the GPU overlap the
engine's reduction of the next); on CUDA its ranks also time the 64 MiB fp32 case staged whole (one
copy each way, as before the chunks), and a last line compares the two and gloo (target: gloo/smddp
at least 2 at 2 ranks). The JSON has the machine (with the GPU and memcpy bandwidth), the command
and the rows.

Without CUDA and without --cpu it says so, writes a JSON that records that nothing was measured,
and exits 0 (tools/gpu_check.sh runs it on machines with and without a GPU). On one H200 (16
cores) it took about 33 s at 2 ranks and about 33 s at --ranks 4.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# (dtype, bytes) of the all_reduce cases
ALL_REDUCE = [("float32", 4 << 10), ("float32", 1 << 20), ("float32", 64 << 20), ("bfloat16", 64 << 20)]
WHOLE = ("float32", 64 << 20)  # the case smddp also times staged whole (CUDA tensors)
MODEL = "mlp25m"


def _size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def worker(backend: str, device: str, budget: float, ddp_budget: float) -> None:
    import torch
    import torch.distributed as dist

    import sdp_jupyter.torch  # noqa: F401 - registers smddp
    from _spawn import agree, call_times
    from models import mlp25m, param_count

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dev, sync = torch.device("cuda", torch.cuda.current_device()), torch.cuda.synchronize
    else:
        dev, sync = torch.device("cpu"), (lambda: None)
    # NCCL takes CUDA tensors only: agree()'s CPU tensor goes through gloo
    dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else backend)
    rows = []
    for dtype, size in ALL_REDUCE:
        dt = getattr(torch, dtype)
        t = torch.ones(size // dt.itemsize, dtype=dt, device=dev)

        def call():
            dist.all_reduce(t)
            sync()

        median, mean = call_times(call, budget, agree)
        rows.append({"case": f"all_reduce {dtype} {_size(size)}", "kind": "all_reduce", "dtype": dtype,
                     "bytes": size, "median_s": median, "mean_s": mean})
        if backend == "smddp" and device == "cuda" and (dtype, size) == WHOLE:
            staging = dist.group.WORLD.staging
            rows[-1]["stage_chunk_bytes"] = chunk = staging.chunk_bytes
            staging.chunk_bytes = 1 << 62  # every rank alike: one copy each way, no chunks
            rows[-1]["whole_median_s"] = call_times(call, budget, agree)[0]
            staging.chunk_bytes = chunk
    torch.manual_seed(0)
    model = mlp25m().to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(dist.get_rank())
    x, y = torch.randn(8, 1024, generator=gen).to(dev), torch.randn(8, 1024, generator=gen).to(dev)

    def step():
        opt.zero_grad(set_to_none=False)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        sync()

    median, mean = call_times(step, ddp_budget, agree)  # its warm-up covers DDP's bucket rebuild
    rows.append({"case": f"DDP step {MODEL}", "kind": "ddp", "params": param_count(model),
                 "median_s": median, "mean_s": mean})
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "device": str(dev), "rows": rows}
    dist.destroy_process_group()
    print(json.dumps(out))


def gpu_info(cuda: bool) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": cuda}
    if cuda:
        info["gpus"] = torch.cuda.device_count()
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main() -> int:
    from _spawn import bench_parser

    ap = bench_parser(__doc__)
    ap.add_argument("--ranks", default="2", help="comma list of world sizes (default 2)")
    ap.add_argument("--cpu", action="store_true", help="CPU tensors instead of CUDA ones (no GPU needed; no NCCL)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # the parent sets it for its ranks
    ap.add_argument("--backends", default=None,
                    help="comma list (default smddp,gloo, and nccl where there is a GPU per rank)")
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per all_reduce case (3..100 calls)")
    ap.add_argument("--ddp-budget", type=float, default=3.0, help="seconds of timed DDP steps (3..100 steps)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds one backend's ranks may take before they are killed")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gpu.json"))
    a = ap.parse_args()
    if a.worker:
        worker(a.backend, a.device, a.budget, a.ddp_budget)
        return 0

    import torch

    from _spawn import machine_info, run_ranks, slowest, write_results

    cuda = torch.cuda.is_available()
    info = {**machine_info(), **gpu_info(cuda)}
    ranks = [int(r) for r in a.ranks.split(",")]
    if not cuda and not a.cpu:
        print("benchmarks/gpu.py: no CUDA here (torch.cuda.is_available() is False): nothing measured. "
              "--cpu measures the same cases on CPU tensors.", flush=True)
        write_results(a.out, info, [], skipped="no CUDA", ranks=ranks)
        return 0
    device = "cpu" if a.cpu else "cuda"
    where = (f"CUDA tensors on {info['gpus']} x {info['gpu']}" if device == "cuda" else "CPU tensors")
    print(f"machine: {info['cpus']} cpus, single-core memcpy {info['memcpy_GBps']:.2f} GB/s; {where}; torch {info['torch']}",
          flush=True)
    script = os.path.abspath(__file__)
    args = ["--device", device, "--budget", str(a.budget), "--ddp-budget", str(a.ddp_budget)]
    rows = []
    print(f"{'ranks':>5} {'case':26s} {'smddp ms':>10} {'gloo ms':>10} {'nccl ms':>10} {'gloo/smddp':>10}"
          f" {'nccl/smddp':>10} {'smddp GB/s':>10}", flush=True)
    for world in ranks:
        if a.backends:
            backends = a.backends.split(",")
        else:
            nccl = device == "cuda" and info["gpus"] >= world
            backends = ["smddp", "gloo"] + (["nccl"] if nccl else [])
        res = {b: run_ranks(script, world, world, ["--backend", b, *args], timeout=a.timeout) for b in backends}
        for i, r0 in enumerate(res[backends[0]][0]["rows"]):
            row = {"world": world, "device": device, **{k: v for k, v in r0.items() if k not in ("median_s", "mean_s")}}
            for b in backends:
                t = slowest(res[b], i, "median_s")
                row[f"{b}_median_s"] = t
                row[f"{b}_mean_s"] = slowest(res[b], i, "mean_s")
                if r0["kind"] == "all_reduce":
                    row[f"{b}_busbw_GBps"] = r0["bytes"] / t * 2 * (world - 1) / world / 1e9
                else:
                    row[f"{b}_steps_per_s"] = 1 / t
            if "smddp" in backends:
                for b in ("gloo", "nccl"):
                    if b in backends:
                        row[f"{b}_over_smddp"] = row[f"{b}_median_s"] / row["smddp_median_s"]
                smddp_row = res["smddp"][0]["rows"][i]
                if "whole_median_s" in smddp_row:
                    row["stage_chunk_bytes"] = smddp_row["stage_chunk_bytes"]
                    row["smddp_whole_median_s"] = slowest(res["smddp"], i, "whole_median_s")
                    row["whole_over_chunked"] = row["smddp_whole_median_s"] / row["smddp_median_s"]
            rows.append(row)

            def cell(key, digits, scale=1.0):
                return f"{row[key] * scale:10.{digits}f}" if key in row else f"{'-':>10}"

            print(f"{world:>5} {row['case']:26s} {cell('smddp_median_s', 3, 1e3)} {cell('gloo_median_s', 3, 1e3)}"
                  f" {cell('nccl_median_s', 3, 1e3)} {cell('gloo_over_smddp', 2)} {cell('nccl_over_smddp', 2)}"
                  f" {cell('smddp_busbw_GBps', 2)}", flush=True)
        for row in rows:
            if row["world"] == world and "whole_over_chunked" in row:
                gloo = f"; gloo/smddp {row['gloo_over_smddp']:.2f}" if "gloo_over_smddp" in row else ""
                print(f"{world:>5} staging, {row['case']}: smddp {row['smddp_median_s'] * 1e3:.3f} ms in chunks of "
                      f"{_size(row['stage_chunk_bytes'])}, {row['smddp_whole_median_s'] * 1e3:.3f} ms staged whole "
                      f"(x{row['whole_over_chunked']:.2f}){gloo} (target at 2 ranks: 2 or more)", flush=True)
    write_results(a.out, info, rows, ranks=ranks, device=device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
