"""The older smdistributed API: `import smdistributed.dataparallel.torch.distributed as dist`.

`dist.init_process_group()` takes no backend; it uses the job's backend (SDP_BACKEND, default smddp).
The other calls are torch.distributed's, plus get_local_rank/get_local_size from the launcher's env.
"""
from __future__ import annotations

import os

import torch.distributed as _dist
from torch.distributed import (  # noqa: F401  re-exported API
    ReduceOp, all_gather, all_reduce, barrier, broadcast, gather, get_rank, get_world_size,
    is_initialized, new_group, reduce, scatter,
)
from sdp_jupyter.backends import job_backend


def is_available() -> bool:
    return True


def init_process_group(*args, **kwargs) -> None:
    backend = kwargs.pop("backend", None) or job_backend()
    if backend == "smddp":
        import sdp_jupyter.torch  # noqa: F401  registers the backend
    if not _dist.is_initialized():
        _dist.init_process_group(backend=backend, *args, **kwargs)


def get_local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def get_local_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def destroy_process_group() -> None:
    if _dist.is_initialized():
        _dist.destroy_process_group()
