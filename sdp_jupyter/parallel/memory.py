"""Activation memory: checkpointing per block (plain or selective) and offloading saved tensors
(DTensors included) to the CPU."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn


def _keep_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default}
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


def apply_checkpointing(model: nn.Module, mode: str = "layer") -> nn.Module:
    """Wrap every block with ``checkpoint_wrapper``: ``"layer"`` keeps only block inputs,
    ``"selective"`` also keeps matmul/attention outputs and recomputes the cheap ops."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             checkpoint_wrapper)

    if mode == "none":
        return model
    if mode not in ("layer", "selective"):
        raise ValueError(f"checkpointing={mode!r}: allowed none, selective, layer")
    for name, block in list(model.layers.items()):
        if mode == "layer":
            wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        else:
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                         context_fn=partial(create_selective_checkpoint_contexts,
                                                            _keep_matmuls))
        model.layers[name] = wrapped
    return model


# ------------------------------------------------------------------------------ offloading


@dataclass
class OffloadStats:
    tensors: int = 0
    dtensors: int = 0
    bytes: int = 0  # bytes copied to the CPU (local shards for DTensors)
    restored: int = 0


@dataclass
class _Packed:
    local: torch.Tensor  # on the CPU
    device: torch.device
    spec: tuple | None  # (mesh, placements, shape, stride) for a DTensor


def offload_saved_tensors(stats: OffloadStats | None = None, pin_memory: bool | None = None,
                          min_bytes: int = 0):
    """A ``saved_tensors_hooks`` context that keeps activations saved for backward on the CPU.

    Unlike ``torch.autograd.graph.save_on_cpu`` it accepts DTensors (tensor/sequence parallel
    activations): only the local shard travels, and the DTensor is rebuilt from it with its mesh and
    placements on unpack. Parameters (leaves that require grad) are never copied: they stay on the
    device anyway. ``stats`` counts what was offloaded."""
    from torch.distributed.tensor import DTensor

    stats = stats if stats is not None else OffloadStats()
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory

    def pack(t):
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t
        is_d = isinstance(t, DTensor)
        local = t.to_local() if is_d else t
        if local.numel() * local.element_size() < min_bytes:
            return t
        cpu = torch.empty(local.size(), dtype=local.dtype, layout=local.layout,
                          pin_memory=pin and local.device.type == "cuda")
        cpu.copy_(local, non_blocking=local.device.type == "cuda")
        stats.tensors += 1
        stats.dtensors += int(is_d)
        stats.bytes += local.numel() * local.element_size()
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if is_d else None
        return _Packed(cpu, local.device, spec)

    def unpack(p):
        if not isinstance(p, _Packed):
            return p
        stats.restored += 1
        local = p.local.to(p.device, non_blocking=True)
        if p.spec is None:
            return local
        mesh, placements, shape, stride = p.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class Offloaded(nn.Module):
    """Runs ``inner`` with saved activations offloaded (the stage module a pipeline sees)."""

    def __init__(self, inner: nn.Module, stats: OffloadStats):
        super().__init__()
        self.inner = inner
        self.stats = stats

    def forward(self, *args, **kwargs):
        with offload_saved_tensors(self.stats):
            return self.inner(*args, **kwargs)
