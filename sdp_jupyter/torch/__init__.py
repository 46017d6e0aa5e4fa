"""The `smddp` backend for torch.distributed, served by the native engine.

    import sdp_jupyter.torch            # registers the backend "smddp"
    import torch.distributed as dist
    dist.init_process_group("smddp")    # under torchrun, sdp-train, %%sdp_train or SageMaker
    model = torch.nn.parallel.DistributedDataParallel(model)   # stock DDP works unchanged

CPU tensors are reduced in place. CUDA tensors are staged through pinned host memory (the
engine reduces on the CPUs of the training hosts), large ones in chunks whose copies to and from
the GPU overlap the reduction of the others (SDP_STAGE_CHUNK_BYTES). fp16/bf16 tensors travel as 16-bit and are
summed in float32.

A thin adapter over sdp_jupyter.comm, which runs and routes every collective: process_group.py
(`ProcessGroupSMDDP`: torch's calls to the communicator's, on tensor pointers), work.py (torch's
work handles and error types), tensors.py (dtype/op codes, staging), ddp.py (the engine's own
DDP wrapper); here, registration and the public names.
"""
from __future__ import annotations

import os

import torch.distributed as dist

from sdp_jupyter.comm import SmddpError
from sdp_jupyter.torch.process_group import BACKEND_NAME, ProcessGroupSMDDP
from sdp_jupyter.torch.work import SmddpBackendError, SmddpUnsupportedError, SmddpWork
from sdp_jupyter.backends import job_backend


def create_process_group(store, rank, world_size, timeout):
    """torch.distributed's creator for "smddp" (also called by sdp_jupyter.torch_plugin, the entry
    point torch loads at `import torch`)."""
    return ProcessGroupSMDDP(store, rank, world_size, timeout)


def register() -> None:
    """Register "smddp" with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cpu", "cuda"])


register()


def init(backend: str | None = None, **kwargs) -> None:
    """`dist.init_process_group` with the job's backend (SDP_BACKEND, default smddp) and env://."""
    backend = backend or job_backend()
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing and "init_method" not in kwargs:
            raise RuntimeError(f"sdp_jupyter.torch.init() needs {', '.join(missing)} in the environment: "
                               "start the script with %%sdp_train, sdp-train or torchrun")
        dist.init_process_group(backend, **kwargs)


from sdp_jupyter.torch.ddp import DistributedDataParallel  # noqa: E402

__all__ = ["ProcessGroupSMDDP", "SmddpWork", "SmddpError", "SmddpBackendError", "SmddpUnsupportedError",
           "DistributedDataParallel", "init", "register", "BACKEND_NAME", "create_process_group"]
