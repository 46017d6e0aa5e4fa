"""Training step time on smddp vs gloo, same run: FSDP2 and the hybrid (tp x pp) mesh, CPU.

    python benchmarks/parallel_step.py           # FSDP2 on 2 and 4 ranks; tp=2 x pp=2 on 4 ranks
    python benchmarks/parallel_step.py --quick   # fewer steps

fsdp2: an MLP of `--fsdp-layers` Linear(H, H) layers (GELU between), `fully_shard` on every Linear
and on the root, AdamW, batch 32, all ranks on one node. A step is zero_grad, forward, backward and
optimizer step: FSDP2's all-gathers and reduce-scatters on the backend under test.
hybrid: notebook 05's job: GPT(layers=4, hidden=64, heads=4, vocab=32, seq_len=16), batch 16,
ParallelConfig(tp=2, pp=2, microbatches=4, checkpointing="layer") on 2 nodes x 2 ranks (tp within
a node, pp across), sdp_jupyter.parallel.setup(config, backend=B): with smddp every group (tp's
collectives, the pipeline's sends and receives, dp) is on the engine. A step is hp.step,
hp.finish_gradients, opt.step, zero_grad.
Reported: the median step time of the slowest rank after warm-up steps, and the last loss (the same
work on both backends). Writes benchmarks/results/parallel_step.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def _timed_steps(step, warmup: int, steps: int) -> tuple[float, float]:
    """(median seconds per step, the last step's loss); `step()` returns a loss or None."""
    from _spawn import timed

    median, loss = timed(step, steps, warmup)
    return median, (float(loss) if loss is not None else float("nan"))


def fsdp2_worker(backend: str, hidden: int, layers: int, warmup: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group(backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    model = torch.nn.Sequential(*mods)
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(100 + rank)
    x, y = torch.randn(32, hidden, generator=gen), torch.randn(32, hidden, generator=gen)

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()
    median, loss = _timed_steps(step, warmup, steps)
    dist.barrier()
    dist.destroy_process_group()
    return {"case": "fsdp2", "median_s": median, "loss": loss,
            "params_MiB": layers * (hidden * hidden + hidden) * 4 / 2**20}


def hybrid_worker(backend: str, warmup: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from sdp_jupyter import parallel
    from sdp_jupyter.parallel_config import ParallelConfig
    from sdp_jupyter.parallel import gpt

    if backend != "smddp":  # with smddp, setup() makes the default group (on the engine)
        dist.init_process_group(backend)
    hp = parallel.setup(ParallelConfig(tp=2, pp=2, microbatches=4, checkpointing="layer"), backend=backend)
    cfg = gpt.GPTConfig(layers=4, hidden=64, heads=4, vocab=32, seq_len=16)
    torch.manual_seed(0)
    stage = hp.parallelize(gpt.GPT(cfg))
    opt = hp.optimizer(stage.parameters(), torch.optim.AdamW, lr=3e-3)
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, cfg.vocab, (16, 1), generator=g)
    seq = (start + torch.arange(cfg.seq_len + 1)) % cfg.vocab
    x, y = seq[:, :-1], seq[:, 1:]

    def step():
        loss = hp.step(stage, x, y, gpt.lm_loss)
        hp.finish_gradients(stage)
        opt.step()
        opt.zero_grad()
        return loss.item() if loss is not None else None
    median, loss = _timed_steps(step, warmup, steps)
    groups = sorted({dist.get_backend()} | {dist.get_backend(gr) for gr in hp.mesh.get_all_groups()})
    dist.barrier()
    dist.destroy_process_group()
    return {"case": "hybrid", "median_s": median, "loss": loss, "group_backends": groups}


def worker(a) -> None:
    import torch

    import sdp_jupyter.torch  # noqa: F401  (registers smddp)

    torch.set_num_threads(1)
    if a.case == "fsdp2":
        row = fsdp2_worker(a.backend, a.fsdp_hidden, a.fsdp_layers, a.warmup, a.steps)
    else:
        row = hybrid_worker(a.backend, a.warmup, a.steps)
    print(json.dumps({"rank": int(os.environ["RANK"]), "rows": [row]}))


def main() -> None:
    from _spawn import bench_parser

    ap = bench_parser(__doc__)
    ap.add_argument("--case", default="fsdp2", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="fewer steps")
    ap.add_argument("--ranks", default="2,4", help='FSDP2 world sizes ("": the hybrid case only)')
    ap.add_argument("--fsdp-hidden", type=int, default=1024)
    ap.add_argument("--fsdp-layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (default 20; quick 8)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "parallel_step.json"))
    a = ap.parse_args()
    a.steps = a.steps or (8 if a.quick else 20)
    if a.worker:
        worker(a)
        return
    from _spawn import machine_info, run_ranks, slowest, write_results

    info = machine_info()
    print(f"machine: {info['cpus']} cpus, load {info['loadavg_1min']}", flush=True)
    common = ["--warmup", str(a.warmup), "--steps", str(a.steps)]
    runs = [("fsdp2", int(w), int(w), "1 node",
             ["--case", "fsdp2", "--fsdp-hidden", str(a.fsdp_hidden), "--fsdp-layers", str(a.fsdp_layers)])
            for w in a.ranks.split(",") if w]
    runs.append(("hybrid tp2 x pp2", 4, 2, "2 nodes x 2", ["--case", "hybrid"]))
    rows = []
    for name, world, per_node, layout, args in runs:
        res = {b: run_ranks(os.path.abspath(__file__), world, per_node, ["--backend", b, *args, *common])
               for b in ("smddp", "gloo")}
        t = {b: slowest(res[b], 0, "median_s") for b in res}
        loss = {b: next((o["rows"][0]["loss"] for o in res[b] if o["rows"][0]["loss"] == o["rows"][0]["loss"]),
                        None) for b in res}
        row = {"case": name, "world": world, "layout": layout, "smddp_ms": t["smddp"] * 1e3,
               "gloo_ms": t["gloo"] * 1e3, "speedup": t["gloo"] / t["smddp"], "smddp_loss": loss["smddp"],
               "gloo_loss": loss["gloo"], "steps": a.steps, "loadavg_1min": os.getloadavg()[0]}
        if "group_backends" in res["smddp"][0]["rows"][0]:
            row["smddp_group_backends"] = res["smddp"][0]["rows"][0]["group_backends"]
        if "params_MiB" in res["smddp"][0]["rows"][0]:
            row["params_MiB"] = res["smddp"][0]["rows"][0]["params_MiB"]
        rows.append(row)
        print(f"{name:17s} {world} ranks {layout:11s} | smddp {row['smddp_ms']:8.1f} ms | gloo {row['gloo_ms']:8.1f} ms"
              f" | x{row['speedup']:5.2f} | last loss smddp {loss['smddp']:.5f} gloo {loss['gloo']:.5f}", flush=True)
    write_results(a.out, info, rows)


if __name__ == "__main__":
    main()
