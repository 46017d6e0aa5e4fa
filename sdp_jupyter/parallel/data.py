"""Plain data parallelism: the gradient average over the dp group (DTensor shards included)."""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist


def average_gradients(params: Iterable[torch.Tensor], group, world: int) -> None:
    """All-reduce (sum) and divide every gradient over ``group``; DTensor gradients reduce their
    local shards (the dp group only ever holds replicas of the same shard)."""
    from torch.distributed.tensor import DTensor

    if world == 1:
        return
    locals_ = []
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        locals_.append(g)
    if not locals_:
        return
    flat = torch.cat([g.reshape(-1) for g in locals_])  # one collective, like a fusion buffer
    dist.all_reduce(flat, group=group)
    flat /= world
    off = 0
    for g in locals_:
        n = g.numel()
        g.copy_(flat[off:off + n].view_as(g))
        off += n
