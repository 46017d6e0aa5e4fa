"""smddp under torchrun's elastic agent, and a DDP rank whose peer dies.

torchrun's c10d rendezvous hands every attempt of the worker group the same store: the first
attempt's rendezvous keys (signed with its one-host secret) were read by the second attempt, which
failed in init_process_group with "wrong signature" (issue 42 item 4). And when a peer died during
backward, DDP's reducer read the failed future's value (torch keeps a Python exception as a value)
and crashed the surviving rank with SIGSEGV and no message. Under `--nnodes 1:2` a node that leaves
(its agent killed) leaves the other to go on alone from the checkpoint."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers.gloo_exit import aborted_at_exit
from sdp_jupyter._net import free_port

pytestmark = pytest.mark.slow

_JOB_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "SDP_JOB_SECRET", "SDP_BACKEND", "PYTEST_CURRENT_TEST")

# One training, two ways to lose a rank. argv: backend, checkpoint, mode, steps, the step after which rank 0
# saves, lr. mode "fail": on the first attempt rank 1 raises after the checkpoint (the restarted group
# resumes from it: the weights of a run that never failed). mode "leave": the node started with LEAVER=1
# leaves after the checkpoint, its agent first, then its rank (the others' restarted group resumes).
TRAIN = r'''
import os, signal, sys, time, torch, torch.distributed as dist
backend, ck, mode, steps, save_at, lr = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=lr)
start = 0
if os.path.exists(ck):
    state = torch.load(ck)
    model.module.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
g = torch.Generator().manual_seed(1 + rank)
X = torch.randn(64, 4, generator=g); y = X @ torch.tensor([2., -1., .5, 3.]) + 1
for step in range(start, steps):
    if mode == "leave":
        time.sleep(0.02)  # time for the agents to see the node go
    opt.zero_grad(); ((model(X).squeeze(1) - y) ** 2).mean().backward(); opt.step()
    if step == save_at - 1 and start == 0:
        dist.barrier()
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": save_at}, ck)
        dist.barrier()
        if mode == "fail" and attempt == 0 and rank == 1:
            raise SystemExit("rank 1 fails on the first attempt")
        if mode == "leave" and os.environ.get("LEAVER") == "1":
            pid = os.getppid()
            while pid > 1 and b"torch.distributed.run" not in open(f"/proc/{pid}/cmdline", "rb").read():
                pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            os.kill(pid, signal.SIGKILL)
            os._exit(1)
if rank == 0:
    print("WEIGHTS", attempt, world, " ".join(f"{v:.7f}" for v in model.module.weight.flatten().tolist()), flush=True)
dist.destroy_process_group()
'''

# Rank 1 leaves (os._exit) in the middle of training; rank 0 reports what its backward raised.
PEER_DIES = r'''
import os, sys, torch, torch.distributed as dist
dist.init_process_group("smddp")
rank = dist.get_rank()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
X = torch.randn(32, 4)
for step in range(200):
    if rank == 1 and step == 5:
        os._exit(0)
    try:
        model(X).pow(2).mean().backward()
    except Exception as exc:
        print("RAISED", type(exc).__name__, exc, flush=True)
        os._exit(3)
'''


def _env(tmp_path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
    env.update({"TMPDIR": str(tmp_path), "XDG_RUNTIME_DIR": "", "OMP_NUM_THREADS": "1"})
    env.update(extra)
    return env


def _weights(tmp_path, backend: str, fail: bool) -> tuple[str, str]:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{free_port()}", "--nnodes", "1", "--max-restarts", "1" if fail else "0", "--nproc-per-node", "2",
           str(script), backend, str(tmp_path / f"{backend}.pt"), "fail" if fail else "-", "40", "20", "0.1"]
    p = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
    out = p.stdout + p.stderr
    lines = [ln.split(None, 3) for ln in p.stdout.splitlines() if ln.startswith("WEIGHTS")]
    if backend == "gloo" and not fail and lines and lines[0][1] == "0" and aborted_at_exit(out):
        # the reference finished attempt 0 (rank 0 prints after the last collective), then torch's gloo
        # aborted a rank at interpreter exit (helpers/gloo_exit.py). The reference runs without restarts:
        # a second attempt of gloo under this rendezvous can hang on the first one's addresses (CI, 180 s)
        lines = lines[:1]
    else:
        assert p.returncode == 0, f"{backend} under torchrun: exit {p.returncode}\n{out[-4000:]}"
    assert len(lines) == 1, out[-4000:]
    _, attempt, _world, weights = lines[0]
    return attempt, weights


def test_smddp_resumes_after_torchrun_restarts_the_worker_group(tmp_path):
    """gloo is the reference without a failure, and without restarts: under this rendezvous gloo itself
    reads the first attempt's addresses now and then ("Gloo connectFullMesh failed ... Connection
    refused"), and a restarted gloo group has hung for the whole timeout."""
    gloo = _weights(tmp_path, "gloo", fail=False)
    smddp = _weights(tmp_path, "smddp", fail=True)
    assert (gloo[0], smddp[0]) == ("0", "1"), (gloo, smddp)  # smddp finished in the second attempt
    assert smddp[1] == gloo[1], (smddp, gloo)
    assert not list(tmp_path.glob("sdp-*/secret-*")), list(tmp_path.glob("sdp-*/*"))


def test_a_ddp_rank_whose_peer_dies_mid_backward_raises_naming_the_peer(tmp_path):
    script = tmp_path / "peer_dies.py"
    script.write_text(PEER_DIES)
    env = _env(tmp_path, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               LOCAL_WORLD_SIZE="2", SDP_TIMEOUT="60")
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == 0, outs[1]
    assert procs[0].returncode == 3, f"rank 0 exited {procs[0].returncode} (-11 is the old SIGSEGV)\n{outs[0][-3000:]}"
    raised = [ln for ln in outs[0].splitlines() if ln.startswith("RAISED")]
    assert raised and "SmddpBackendError: rank 1 " in raised[0] and "exited or closed its connection" in raised[0], \
        outs[0][-3000:]


def _expected_after_the_leave() -> list[float]:
    """The same training in one process: steps 0-99 average the three nodes' gradients (DDP divides each
    by the world size, then sums), steps 100-149 those of the two that stayed."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = []
    for rank in range(3):
        g = torch.Generator().manual_seed(1 + rank)
        X = torch.randn(64, 4, generator=g)
        data.append((X, X @ torch.tensor([2., -1., .5, 3.]) + 1))
    for step in range(150):
        ranks = data if step < 100 else data[:2]
        grads = []
        for X, y in ranks:
            model.zero_grad()
            ((model(X).squeeze(1) - y) ** 2).mean().backward()
            grads.append([p.grad.clone() / len(ranks) for p in model.parameters()])
        for p, *gs in zip(model.parameters(), *grads):
            p.grad = sum(gs)
        opt.step()
    return model.weight.flatten().tolist()


def _wait_listening(port: int, proc, timeout: float = 90.0) -> None:
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise AssertionError(f"the first torchrun agent did not listen on {port} within {timeout:g} s "
                         f"(exit {proc.poll()})")


def test_smddp_goes_on_with_two_nodes_when_the_third_leaves_under_torchrun_nnodes_2_3(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    port = free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d", "--rdzv-endpoint",
           f"127.0.0.1:{port}", "--rdzv-id", "leave", "--nnodes", "2:3", "--max-restarts", "1",
           "--nproc-per-node", "1", "--rdzv-conf",
           "join_timeout=90,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3",
           str(script), "smddp", str(tmp_path / "ck.pt"), "leave", "150", "100", "0.01"]
    env = _env(tmp_path, PYTHONUNBUFFERED="1")
    logs = [tmp_path / f"agent-{i}.log" for i in range(3)]
    agents = []
    for i, leaver in enumerate(("0", "0", "1")):
        with open(logs[i], "w") as log:
            agents.append(subprocess.Popen(cmd, env={**env, "LEAVER": leaver}, stdout=log,
                                           stderr=subprocess.STDOUT, cwd=str(tmp_path)))
        if i == 0:  # the first agent must host the rendezvous store: the others start once it listens.
            _wait_listening(port, agents[0])  # (a fixed 0.5 s head start lost to a loaded machine: the
            # leaver hosted the store, and its death took the rendezvous with it)
    try:
        for p in agents:
            p.wait(timeout=180)
    finally:
        for p in agents:
            p.kill()
    # What is judged is the training, not the agents' exit codes: when the agent that hosts the rendezvous
    # store ends first, another's goodbye to the rendezvous fails ("Broken pipe") and that torchrun exits 1
    # after the group has finished (seen once under the full suite's load). Rank 0 is in either of the
    # two agents that stay.
    out = logs[0].read_text() + logs[1].read_text()
    lines = [ln.split() for ln in out.splitlines() if ln.startswith("WEIGHTS")]
    assert len(lines) == 1 and lines[0][1:3] == ["1", "2"], out[-4000:]  # attempt 1, a world of two nodes
    got = [float(v) for v in lines[0][3:]]
    want = _expected_after_the_leave()
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-5, (got, want)
