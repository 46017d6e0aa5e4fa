"""Every way users start ranks, on one host, with no SDP_JOB_SECRET and a script that never imports
sdp_jupyter (torch loads the smddp backend through its entry point): mp.spawn with the rank and the
world size passed to init_process_group and no rendezvous environment (tcp://, file://), env://
with only MASTER_ADDR/MASTER_PORT, plain torchrun, and two jobs at once on one machine. Before,
the one-host secret took its publisher from $RANK and its file name from MASTER_ADDR:MASTER_PORT,
so with the rank passed as an argument every rank published its own secret ("wrong signature")."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from sdp_jupyter._net import free_port as _free_port

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, os, sys
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank, world, init, out):
    kwargs = {} if init is None else {"init_method": init}
    if rank is None:  # torchrun: everything from the environment
        dist.init_process_group("smddp")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        dist.init_process_group("smddp", rank=rank, world_size=world, **kwargs)
    t = torch.full((4,), float(rank + 1))
    dist.all_reduce(t)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).sum().backward()
        opt.step()
    got = torch.zeros(3)
    if rank == 0:
        for peer in range(1, world):
            dist.send(torch.arange(3.0) + peer, peer)
    else:
        dist.recv(got, 0)
    with open(f"{out}.{rank}", "w") as f:
        json.dump({"sum": t.tolist(), "weight": model.module.weight.flatten().tolist(), "recv": got.tolist(),
                   "backend": dist.get_backend()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mode, world, init, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if mode == "torchrun":
        work(None, None, None, out)
    else:
        mp.spawn(work, args=(world, None if init == "-" else init, out), nprocs=world)
'''

_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "SDP_JOB_SECRET", "SDP_BACKEND", "PYTEST_CURRENT_TEST")


def _clean_env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
    env.update({"TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": "", "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def _run(tmp_path, mode: str, world: int, init: str, env: dict, tag: str = "job", timeout: float = 150):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / tag
    if mode == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world),
               "--master-port", str(_free_port()), str(script), mode, str(world), init, str(out)]
    else:
        cmd = [sys.executable, str(script), mode, str(world), init, str(out)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(tmp_path))
    assert p.returncode == 0, f"{mode} {init}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return [json.loads((tmp_path / f"{tag}.{r}").read_text()) for r in range(world)]


def _check(vals, world: int):
    total = float(sum(range(1, world + 1)))
    for r, v in enumerate(vals):
        assert v["backend"] == "smddp"
        assert v["sum"] == [total] * 4
        assert v["weight"] == vals[0]["weight"]  # DDP kept every rank's weights equal
        assert v["recv"] == ([0.0] * 3 if r == 0 else [float(r), r + 1.0, r + 2.0])


def _no_secret_left(tmp_path):
    assert not list(tmp_path.glob("sdp-*/secret-*")), list(tmp_path.glob("sdp-*/*"))


@pytest.mark.parametrize("init", ["tcp", "file", "env"])
def test_mp_spawn_with_the_rank_passed_and_no_secret(tmp_path, init):
    """PyTorch's DDP-tutorial pattern: mp.spawn, init_process_group(rank=..., world_size=...)."""
    port = _free_port()
    extra = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)} if init == "env" else {}
    method = {"tcp": f"tcp://127.0.0.1:{port}", "file": f"file://{tmp_path}/rendezvous", "env": "env://"}[init]
    vals = _run(tmp_path, "spawn", 3, method, _clean_env(tmp_path, **extra))
    _check(vals, 3)
    _no_secret_left(tmp_path)


def test_plain_torchrun_without_secret(tmp_path):
    vals = _run(tmp_path, "torchrun", 2, "-", _clean_env(tmp_path))
    _check(vals, 2)
    _no_secret_left(tmp_path)


def test_two_jobs_at_once_on_one_machine(tmp_path):
    """Two jobs started the same way at the same time, with no environment to tell them apart:
    each group's secret file has a random name, so neither reads the other's."""
    results, errors = {}, []

    def one(tag, method):
        try:
            results[tag] = _run(tmp_path, "spawn", 2, method, _clean_env(tmp_path), tag=tag)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(f"{tag}: {exc}")

    jobs = [threading.Thread(target=one, args=("a", f"tcp://127.0.0.1:{_free_port()}")),
            threading.Thread(target=one, args=("b", f"file://{tmp_path}/rendezvous-b"))]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join()
    assert not errors, errors
    _check(results["a"], 2)
    _check(results["b"], 2)
    _no_secret_left(tmp_path)


def test_the_flight_recorder_writes_one_file_per_rank_without_a_launcher(tmp_path):
    """mp.spawn passes the rank to init_process_group and sets no RANK: with SDP_FLIGHT_DIR each rank
    still writes its own flight file, named by its rank (not every rank into rank 0's)."""
    flight = tmp_path / "flight"
    vals = _run(tmp_path, "spawn", 3, f"file://{tmp_path}/rendezvous",
                _clean_env(tmp_path, SDP_FLIGHT_DIR=str(flight), SDP_FLIGHT_POLL_S="0.05", SDP_HANG_WARN_S="0.1"))
    _check(vals, 3)
    names = sorted(p.name for p in flight.glob("flight-rank-*.jsonl"))
    assert names == ["flight-rank-0.jsonl", "flight-rank-1.jsonl", "flight-rank-2.jsonl"], names
    for r in range(3):
        ranks = {json.loads(line)["rank"] for line in (flight / f"flight-rank-{r}.jsonl").read_text().splitlines()}
        assert ranks == {r}, (r, ranks)
