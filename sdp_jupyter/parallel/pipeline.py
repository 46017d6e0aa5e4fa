"""Pipeline parallelism: which blocks a stage owns, and the stage's module."""
from __future__ import annotations

import torch.nn as nn


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[int]:
    """Global indices of the blocks of ``stage`` (balanced; the first stages take the remainder)."""
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def split_for_pipeline(model: nn.Module, n_stages: int, stage: int) -> nn.Module:
    """Keep the blocks of ``stage``; drop the embeddings except on the first stage and the final
    norm and head except on the last (set to None). Modifies and returns ``model``."""
    keep = {str(i) for i in stage_layers(len(model.layers), n_stages, stage)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_emb = None
        if hasattr(model, "pos_emb"):
            model.pos_emb = None
    if stage != n_stages - 1:
        model.ln_f = None
        model.head = None
    return model
