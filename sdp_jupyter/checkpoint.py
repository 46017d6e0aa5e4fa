"""Checkpoints that make `--max-restarts` resume a job: one line to save, one line to load.

    state = sdp_jupyter.checkpoint.load() or {"step": 0, "model": model.state_dict(), ...}
    ...
    sdp_jupyter.checkpoint.save({"step": step, "model": model.state_dict(), ...})

The directory is SDP_CHECKPOINT_DIR (set by the launcher: --checkpoint-dir, default
<job dir>/checkpoints; it survives restarts of the job and re-runs with the same --name). Only rank 0
writes (every rank holds the same replica in data-parallel training); the file is written to a
temporary name and renamed, so a rank killed mid-save never leaves a torn checkpoint. Call load()
before the first collective, so every rank reads the same file before rank 0 writes a newer one.
Objects are stored with torch.save when torch is importable, else with pickle.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

from sdp_jupyter._files import private_writer
from sdp_jupyter._env import env_str

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


def save(obj, name: str = DEFAULT_NAME, *, all_ranks: bool = False) -> Path | None:
    """Write `obj` to <checkpoint dir>/<name> atomically; only rank 0 writes unless all_ranks."""
    if not all_ranks and os.environ.get("RANK", "0") != "0":
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
    older checkpoint with a pickled optimizer class, say)."""
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
