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

DEFAULT_NAME = "checkpoint.pt"


def checkpoint_dir() -> Path:
    """SDP_CHECKPOINT_DIR, else ./checkpoints (outside a job)."""
    return Path(os.environ.get("SDP_CHECKPOINT_DIR") or "checkpoints")


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
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    tmp = directory / f".{name}.{os.getpid()}.tmp"
    torch = _torch()
    with open(tmp, "wb") as f:
        if torch is not None:
            torch.save(obj, f)
        else:
            pickle.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def load(name: str = DEFAULT_NAME, default=None, map_location="cpu"):
    """The object saved under `name`, or `default` when there is no checkpoint yet."""
    path = checkpoint_dir() / name
    if not path.is_file():
        return default
    torch = _torch()
    if torch is not None:
        return torch.load(path, map_location=map_location, weights_only=False)
    with open(path, "rb") as f:
        return pickle.load(f)


def exists(name: str = DEFAULT_NAME) -> bool:
    return (checkpoint_dir() / name).is_file()
