"""Checkpoints that make `--max-restarts` resume a job: one line to save, one line to load.

    state = sdp_jupyter.checkpoint.load() or {"step": 0, "model": model.state_dict(), ...}
    ...
    sdp_jupyter.checkpoint.save({"step": step, "model": model.state_dict(), ...})

The directory is SDP_CHECKPOINT_DIR (set by the launcher: --checkpoint-dir, default
<job dir>/checkpoints; it survives restarts of the job and re-runs with the same --name). Only rank 0
writes (every rank holds the same replica in data-parallel training); the file is written to a
temporary name and renamed, so a rank killed mid-save never leaves a torn checkpoint. Call load()
on every rank before the first collective, so every rank reads the same file before rank 0 writes a
newer one. Where the nodes run on hosts of their own (SSH, Ray, Slurm) or the job is elastic, the
default folder is each host's own: local rank 0 of every node writes its copy, and load(), called
after init_process_group, gives every rank node 0's by a broadcast.
Objects are stored with torch.save when torch is importable, else with pickle.

Preemption (a spot host reclaimed, a Slurm job preempted, `scancel`): what arrives is SIGTERM, on the
ranks of one node or of all. Register what to save, and call `step_boundary()` once per step on every
rank:

    sdp_jupyter.checkpoint.on_preemption(lambda: sdp_jupyter.checkpoint.save(state()))
    for step in range(start, steps):
        train_step()
        sdp_jupyter.checkpoint.step_boundary()

SIGTERM then only marks the rank. At the next boundary every rank learns whether any rank was marked
(one 4-byte all_reduce over the default group), and if one was, every rank runs the hooks (so rank 0
saves, whichever node was told) and leaves, killed by SIGTERM as it would have been: `--max-restarts`
starts the job again and `load()` resumes from the step it left. A rank that reaches no boundary within
SDP_PREEMPT_GRACE_S of its SIGTERM (60 s) leaves without running the hooks; a second SIGTERM ends it at once.
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from sdp_jupyter._files import private_writer
from sdp_jupyter._env import env_float, env_str

DEFAULT_NAME = "checkpoint.pt"


def checkpoint_dir() -> Path:
    """SDP_CHECKPOINT_DIR, else ./checkpoints (outside a job)."""
    return Path(env_str("SDP_CHECKPOINT_DIR") or "checkpoints")


def _torch():
    try:
        import torch
    except ImportError:
        return None
    return torch


def _per_node() -> bool:
    """Every node keeps a copy and load() gives every rank node 0's: set by the launcher where the
    nodes run on hosts of their own (a restarted rank reads its own host's folder) and in elastic
    jobs (any node may be node 0 after a re-formation)."""
    return bool(env_str("SDP_CHECKPOINT_PER_NODE"))


def save(obj, name: str = DEFAULT_NAME, *, all_ranks: bool = False) -> Path | None:
    """Write `obj` to <checkpoint dir>/<name> atomically; only rank 0 writes unless all_ranks. Where
    the nodes run on hosts of their own (SSH, Ray, Slurm) and in elastic jobs, local rank 0 of every
    node writes, so each host keeps a copy and a restart or re-formation resumes from it whichever
    node is node 0 then."""
    writes = all_ranks or os.environ.get("RANK", "0") == "0" \
        or (_per_node() and os.environ.get("LOCAL_RANK", "0") == "0")
    if not writes:
        return None
    directory = checkpoint_dir()
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / name
    torch = _torch()
    with private_writer(path, fsync=True) as f:
        if torch is not None:
            torch.save(obj, f)
        else:
            pickle.dump(obj, f)
    return path


def load(name: str = DEFAULT_NAME, default=None, map_location="cpu", *, weights_only: bool = True):
    """The object saved under `name`, or `default` when there is no checkpoint yet.

    `weights_only=True` (the default) loads tensors, numbers, strings and containers of them, and
    refuses anything that would run code while loading: a checkpoint directory others can write
    to (a shared --checkpoint-dir) cannot be used to run code in your job. Pass
    `weights_only=False` only for a checkpoint you wrote yourself that holds other objects (an
    older checkpoint with a pickled optimizer class, say).

    Where the nodes run on hosts of their own (SSH, Ray, Slurm) and in elastic jobs, called after
    init_process_group on every rank, every rank gets node 0's copy (a broadcast): the other hosts'
    copies may be older (a host that rejoins, a node that died mid-save). Before init_process_group
    each rank reads its own host's copy."""
    dist = _group() if _per_node() else None
    if dist is not None and dist.get_world_size() > 1:
        box = [_read(name, default, map_location, weights_only) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return _read(name, default, map_location, weights_only)


def _read(name: str, default, map_location, weights_only: bool):
    path = checkpoint_dir() / name
    if not path.is_file():
        return default
    torch = _torch()
    if torch is not None:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    if weights_only:
        raise RuntimeError(f"{path}: loading a checkpoint without torch needs pickle, which can run code; "
                           "call sdp_jupyter.checkpoint.load(..., weights_only=False) if you trust this file")
    with open(path, "rb") as f:
        return pickle.load(f)


def exists(name: str = DEFAULT_NAME) -> bool:
    """Whether a checkpoint `name` is in the checkpoint directory (so a restarted job can resume)."""
    return (checkpoint_dir() / name).is_file()


class _Preemption:
    """This process's SIGTERM watch: the hooks, when the signal came, the grace timer."""

    def __init__(self):
        self.hooks: list[Callable[[], object]] = []
        self.signalled: float | None = None  # time.monotonic() of the first SIGTERM
        self.grace = 60.0
        self.lock = threading.Lock()

    def handler(self, signum, frame) -> None:
        if self.signalled is not None:
            return
        self.signalled = time.monotonic()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the rank at once; so does _leave
        print(f"[sdp_jupyter] rank {os.environ.get('RANK', '0')}: SIGTERM (preemption?): saving at the next step "
              f"boundary, leaving within {self.grace:g} s (a second SIGTERM ends it now)", file=sys.stderr, flush=True)
        threading.Thread(target=self._deadline, name="sdp-preemption-grace", daemon=True).start()

    def _deadline(self) -> None:
        time.sleep(self.grace)
        print(f"[sdp_jupyter] rank {os.environ.get('RANK', '0')}: no step boundary within {self.grace:g} s of "
              "SIGTERM (SDP_PREEMPT_GRACE_S): leaving without the preemption hooks", file=sys.stderr, flush=True)
        _leave()


_PREEMPTION = _Preemption()


def _leave() -> None:
    """End this process as SIGTERM would have (so the launcher sees a rank killed by SIGTERM)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGTERM)  # the handler put SIGTERM back to its default
    time.sleep(5)
    os._exit(128 + signal.SIGTERM)


def broadcast_state(*objects, src: int = 0) -> None:
    """Give every rank rank `src`'s state of each object, in memory, not through a file: a module's
    parameters and buffers are broadcast in place (the same architecture must exist on every rank),
    anything else with state_dict()/load_state_dict() (an optimizer, a scheduler) travels pickled. What an
    interactive session's replaced rank needs after `sdp_replaced` rebuilt its objects: call it on every
    rank with the same objects in the same order."""
    dist = _group()
    if dist is None:
        raise RuntimeError("broadcast_state needs a process group: call it on the ranks of a job or session")
    torch = _torch()
    for obj in objects:
        if isinstance(obj, torch.nn.Module):
            with torch.no_grad():
                for tensor in obj.state_dict().values():
                    dist.broadcast(tensor, src=src)
            continue
        box = [obj.state_dict() if dist.get_rank() == src else None]
        dist.broadcast_object_list(box, src=src)
        if dist.get_rank() != src:
            obj.load_state_dict(box[0])


def _group():
    """torch.distributed when this process has a default group, else None."""
    torch = _torch()
    if torch is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return torch.distributed


def on_preemption(hook: Callable[[], object]) -> None:
    """Run `hook` (save a checkpoint) on every rank at the first `step_boundary()` after any rank was sent
    SIGTERM; from now on SIGTERM only marks this rank (see the module's docstring). Call it from the
    main thread, on every rank."""
    with _PREEMPTION.lock:
        if not _PREEMPTION.hooks:
            _PREEMPTION.grace = env_float("SDP_PREEMPT_GRACE_S", 60.0, min=0.0)
            signal.signal(signal.SIGTERM, _PREEMPTION.handler)
        _PREEMPTION.hooks.append(hook)


def preempted() -> bool:
    """Whether any rank of the default process group was sent SIGTERM since `on_preemption`: every rank
    gets the same answer (a collective: call it on every rank, at the same point of each step). Without
    a process group, whether this process was."""
    mine = _PREEMPTION.signalled is not None
    dist = _group()
    if dist is None:
        return mine
    torch = _torch()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    flag = torch.tensor([1 if mine else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def step_boundary() -> None:
    """Call once per step on every rank: when any rank was sent SIGTERM, every rank runs the
    `on_preemption` hooks and leaves (killed by SIGTERM); otherwise it returns at once."""
    if not preempted():
        return
    for hook in _PREEMPTION.hooks:
        hook()
    dist = _group()
    if dist is not None:
        # nobody leaves before every hook has run: the launcher stops the others when the first rank ends,
        # which would interrupt rank 0 still saving
        dist.barrier()
    print(f"[sdp_jupyter] rank {os.environ.get('RANK', '0')}: preempted: the preemption hooks ran; leaving",
          file=sys.stderr, flush=True)
    _leave()
