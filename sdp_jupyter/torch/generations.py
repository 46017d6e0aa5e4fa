"""Making the default process group again, of other ranks, in a process that lives on: what an
interactive session does after a shrink (launch/rank/cell_loop.py) and a --heal job after a death or a
join (sdp_jupyter.heal). Each membership is a numbered generation: smddp rendezvouses under the
generation (one store prefix for the process's life, process_group.set_generation); another backend
under a store prefix per generation, so keys an earlier generation left are never read.
"""
from __future__ import annotations

import datetime


def make_default_group(backend: str, store, name: str, generation: int, rank: int, world_size: int,
                       timeout: datetime.timedelta | None = None) -> None:
    """init_process_group for `generation` of this process's memberships, over the shared `store`."""
    import torch.distributed as dist

    if backend == "smddp":
        from sdp_jupyter.torch.process_group import set_generation

        set_generation(generation)
        prefix = name
    else:
        prefix = f"{name}-{generation}"
    extra = {"timeout": timeout} if timeout is not None else {}
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank, world_size=world_size, **extra)


def leave_every_group(backend: str) -> None:
    """Destroy every process group of this process, one a dead peer broke included; smddp's engines are
    closed and forgotten (process_group.forget_groups), so no later reconnect touches them."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a group whose engine the loss broke
            pass
    if backend == "smddp":
        from sdp_jupyter.torch.process_group import forget_groups

        forget_groups()
