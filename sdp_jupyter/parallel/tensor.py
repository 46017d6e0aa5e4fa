"""Tensor parallelism (and sequence parallelism) for the GPT block layout, with torch's
``torch.distributed.tensor.parallel`` over the ``tp`` mesh dimension."""
from __future__ import annotations

from functools import partial

import torch.nn as nn


def tp_plan_for_block(sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    if not sequence_parallel:
        return {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    gather = partial(PrepareModuleInput, input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"ln_1": SequenceParallel(), "attn": gather(),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(), "mlp": gather(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}


class _ScatterSequence(nn.Module):
    """Replicated (B, T, h) -> this tp rank's (B, T/tp, h); backward all-gathers (DTensor's
    Replicate -> Shard(1) redistribution), so embedding gradients stay correct."""

    def __init__(self, tp_mesh):
        super().__init__()
        self.tp_mesh = tp_mesh

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        d = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        return d.redistribute(self.tp_mesh, [Shard(1)]).to_local()


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    """Megatron-style tensor parallelism with torch.distributed.tensor.parallel: a vocabulary-parallel
    token embedding (rows sharded, output all-reduced), column/row-parallel attention and MLP, a
    column-parallel head whose logits stay sharded over the vocabulary (compute the loss inside
    ``Hybrid.loss_context()``, torch's ``loss_parallel``). Position embeddings are replicated.
    With sequence parallelism the activations between blocks are (B, T/tp, h) sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if tp_mesh.size() == 1:
        return model
    if getattr(model, "tok_emb", None) is not None:
        parallelize_module(model, tp_mesh, {"tok_emb": RowwiseParallel(input_layouts=Replicate(),
                                                                       output_layouts=Replicate())})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, tp_plan_for_block(sequence_parallel))
    if getattr(model, "head", None) is not None:
        in_layout = Shard(1) if sequence_parallel else Replicate()
        # logits stay sharded over the vocabulary (a DTensor): the loss runs under loss_parallel()
        plan = {"head": ColwiseParallel(input_layouts=in_layout, output_layouts=Shard(-1),
                                        use_local_output=False)}
        if sequence_parallel:
            plan["ln_f"] = SequenceParallel()
        parallelize_module(model, tp_mesh, plan)
    if sequence_parallel and getattr(model, "tok_emb", None) is not None:
        first = next(iter(model.layers.values()), None)
        if first is not None:
            first.register_forward_pre_hook(_scatter_hook(_ScatterSequence(tp_mesh)))
        else:  # a stage with embeddings and no blocks
            model.ln_f.register_forward_pre_hook(_scatter_hook(_ScatterSequence(tp_mesh)))
    return model


def _scatter_hook(scatter):
    def hook(module, args):
        return (scatter(args[0]),) + tuple(args[1:])

    return hook
