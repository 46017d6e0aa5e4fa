"""What every target does on a host to run that host's ranks, in one place.

The node agent (launch/host/agent.py: every node of a local, SSH, Ray or Slurm job) builds a rank's
environment here, starts it in its own session, stops it (SIGINT, then SIGTERM, then SIGKILL to its
process group) and starts the node's utilization sampler.
A leaf of the launch package: it imports only jobdir and pythonpath, never a widget or torch.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sdp_jupyter import jobdir
from sdp_jupyter.launch.process import rank_pythonpath

WORKER = [sys.executable, "-u", "-m", "sdp_jupyter.launch.rank.worker"]


_NVIDIA_DEVICES = ("/dev/nvidiactl", "/proc/driver/nvidia", "/dev/dxg")  # the driver's, or WSL2's GPU device


def gpu_count() -> int:
    """GPUs this machine offers (NVML, limited by CUDA_VISIBLE_DEVICES); 0 without a GPU or driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    if sys.platform.startswith("linux") and not any(os.path.exists(p) for p in _NVIDIA_DEVICES):
        return 0  # no NVIDIA driver here: not worth NVML's import (every node agent asks, at its start)
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            n = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


def signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_rank(proc, sig: int) -> None:
    """`sig` to a live rank's own process, not its group: a session's cell interrupt must not reach the
    rank's helpers (DataLoader workers would die of SIGUSR2)."""
    if proc.poll() is None:
        try:
            os.kill(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def environment(spec, *, rank: int, world_size: int, job_dir: str, job_name: str, secret: str,
                master_addr: str, master_port: int, bind_addr: str, attempt: int, gpus: int,
                ranks_here: int, split_gpus: bool) -> dict:
    """The environment of one rank: torchrun's and SageMaker's variables plus ours.

    `ranks_here`: ranks sharing this machine (threads per rank are divided among them);
    `split_gpus`: several "nodes" share this machine's GPUs (the local target), so each node sees
    its own slice, as separate hosts would.
    """
    ppn = spec.procs_per_node
    node, local_rank = divmod(rank, ppn)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, ranks_here))))
    env.update(spec.env)
    env.update(spec.parallel_env())  # SDP_TP, SDP_PP, ...: only for a job with hybrid-parallel options
    hosts = [f"algo-{i + 1}" for i in range(spec.nodes)]
    env.update({
        "PYTHONPATH": rank_pythonpath(env.get("PYTHONPATH")),
        "PYTHONUNBUFFERED": "1",
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(ppn), "GROUP_RANK": str(node), "NODE_RANK": str(node),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": hosts[node],
        "SM_NUM_GPUS": str(min(ppn, gpus)),
        "SM_MODEL_DIR": os.path.join(job_dir, jobdir.MODEL),
        "SM_OUTPUT_DATA_DIR": os.path.join(job_dir, jobdir.OUTPUT),
        "SM_HPS": json.dumps(spec.hyperparameters),
        "SDP_JOB_DIR": job_dir, "SDP_JOB_NAME": job_name, "SDP_JOB_SECRET": secret,
        "SDP_BIND_ADDR": bind_addr, "SDP_NUM_NODES": str(spec.nodes), "SDP_BACKEND": spec.backend,
        "SDP_RESTART": str(attempt), "SDP_LAUNCHER_PID": str(os.getpid()),
    })
    if spec.min_nodes is not None:
        env["SDP_ELASTIC"] = "1"
    if spec.heal:  # its ranks train through sdp_jupyter.heal, a client of the launcher's store
        env["SDP_HEAL"] = "1"
    if spec.min_nodes is not None or (spec.nodes > 1 and not split_gpus):
        # nodes on hosts of their own: a restart or re-formation reads each host's default checkpoint
        # folder, so every node keeps a copy and load() gives every rank node 0's (sdp_jupyter.checkpoint)
        env["SDP_CHECKPOINT_PER_NODE"] = "1"
    env.setdefault("SM_CHANNEL_TRAIN", os.path.join(job_dir, jobdir.TRAIN_CHANNEL))
    if split_gpus and gpus >= spec.world_size and "CUDA_VISIBLE_DEVICES" not in spec.env:
        parent = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [v.strip() for v in parent.split(",")] if parent else [str(i) for i in range(gpus)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[node * ppn:(node + 1) * ppn])
    for key, value in spec.hyperparameters.items():
        env[f"SM_HP_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    env["SDP_CHECKPOINT_DIR"] = str(Path(spec.checkpoint_dir).expanduser().absolute()) \
        if spec.checkpoint_dir else os.path.join(job_dir, jobdir.CHECKPOINTS)
    return env


def spawn(env: dict) -> subprocess.Popen:
    """A rank started cold: its own session, output (stdout and stderr) on one pipe."""
    return subprocess.Popen(WORKER, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)


def stop(procs: list, sigint_grace: float, sigterm_grace: float) -> list:
    """SIGINT every live rank's process group, then SIGTERM, then SIGKILL; then kill what a rank
    left in its session (data-loader workers). Returns the exit codes."""
    for sig, grace in ((signal.SIGINT, sigint_grace), (signal.SIGTERM, sigterm_grace), (signal.SIGKILL, 5.0)):
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            break
        for p in alive:
            signal_group(p.pid, sig)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.02)
    kill_groups(procs)
    return [p.returncode for p in procs]


def kill_groups(procs: list) -> None:
    for p in procs:
        signal_group(p.pid, signal.SIGKILL)


def start_sampler(job_dir: str | os.PathLike, node: int) -> subprocess.Popen | None:
    """This host's utilization sampler for `node` (metrics/system-node-<node>.jsonl), dying with us."""
    import importlib.util

    if importlib.util.find_spec("sdp_jupyter.monitor.sampler") is None:
        return None
    env = dict(os.environ, SDP_LAUNCHER_PID=str(os.getpid()),
               PYTHONPATH=rank_pythonpath(os.environ.get("PYTHONPATH"), compat=False))
    with jobdir.open_private(jobdir.sampler_log_path(job_dir, node)) as log:
        return subprocess.Popen(
            [sys.executable, "-m", "sdp_jupyter.launch.rank.worker", "--module", "sdp_jupyter.monitor.sampler",
             "--job-dir", str(job_dir), "--node", str(node)],
            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True)


def stop_samplers(samplers: list) -> None:
    for p in samplers:
        if p.poll() is None:
            signal_group(p.pid, signal.SIGTERM)
    for p in samplers:
        try:
            p.wait(timeout=3)
        except subprocess.TimeoutExpired:
            signal_group(p.pid, signal.SIGKILL)
            p.wait()
