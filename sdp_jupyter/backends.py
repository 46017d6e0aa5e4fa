"""The backends a job can ask for (`--backend`): the one list, which of them need a GPU per process and
the one sentence when a place to run has too few, and how a rank reads its job's backend. A leaf: the
spec, the scaling advisor, the form, every launcher and every rank-side reader take them from here."""
from __future__ import annotations

from sdp_jupyter._env import env_str

SMDDP, GLOO, NCCL = "smddp", "gloo", "nccl"
BACKENDS = (SMDDP, GLOO, NCCL)  # --backend's choices; the first is the default
DEFAULT = SMDDP
NEEDS_GPUS = frozenset({NCCL})  # one GPU per process, or it does not start


def needs_gpus(backend: str) -> bool:
    """True when `backend` runs only with a GPU per process."""
    return backend in NEEDS_GPUS


def gpu_shortfall(backend: str, procs: int, gpus: int, where: str, fix: str) -> tuple[str, str] | None:
    """None when `where` ("this machine", "it" for a host, an instance type) has the GPUs `backend` needs
    for `procs` processes; else the option to name and the sentence, ending with `fix` when it has none."""
    if not needs_gpus(backend):
        return None
    if gpus <= 0:
        return "--backend", f"{backend} needs a GPU per process and {where} has none. Fix: {fix}"
    if procs > gpus:
        return "--procs-per-node", (f"{procs} processes for {backend} but {where} has {gpus} GPU(s). "
                                    f"Fix: --procs-per-node {gpus}")
    return None


def job_backend(default: str | None = DEFAULT) -> str | None:
    """The backend a rank's job asked for: $SDP_BACKEND (every launcher sets it from --backend), else
    `default`. The one place a rank reads it."""
    return env_str("SDP_BACKEND") or default
