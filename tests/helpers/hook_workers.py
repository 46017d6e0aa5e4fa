"""Functions that run inside rank processes for the DDP communication hook tests (see helpers/ranks.py
and tests/torch/test_comm_hooks.py)."""
from __future__ import annotations


def ddp_hook(steps: int, backend: str, hook: str, seed: int = 0):
    """Stock DDP with torch's comm hook `hook` ("powerSGD" or "fp16") on `backend`: the final parameters
    (the same seeds and data on every backend; engine_workers.torch_ddp)."""
    from engine_workers import torch_ddp

    return torch_ddp(steps, backend, seed, hook)


def future_at_shutdown():
    """A future that the peer never lets complete (a receive it never sends to), then the group is
    destroyed: the future fails, it is not left pending. Returns what waiting for it raised."""
    import torch
    import torch.distributed as dist

    import sdp_jupyter.torch  # noqa: F401 - registers smddp

    dist.init_process_group("smddp")
    rank = dist.get_rank()
    out = {}
    if rank == 0:
        fut = dist.irecv(torch.zeros(4), src=1, tag=7).get_future()
        assert not fut.done()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        try:
            fut.wait()
            out["error"] = None
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            out["error"] = f"{type(exc).__name__}: {exc}"
        out["done"] = fut.done()
    return out
