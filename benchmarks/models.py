"""Models the benchmarks train: a communication-heavy MLP and a small transformer on synthetic tokens."""
from __future__ import annotations

import torch


def mlp25m() -> torch.nn.Module:
    # 1024 -> 4096 -> 4096 -> 1024: 25.2M parameters (100 MB of fp32 gradients) for little compute.
    return torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096),
                               torch.nn.ReLU(), torch.nn.Linear(4096, 1024))


class TinyTransformer(torch.nn.Module):
    def __init__(self, vocab=2000, d=256, layers=4, heads=4, seq=64):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, d)
        self.pos = torch.nn.Parameter(torch.zeros(seq, d))
        layer = torch.nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, layers)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        return self.head(self.body(self.emb(tokens) + self.pos[: tokens.shape[1]]))


def make(name: str):
    """(model, batch(step) -> (inputs, loss_fn))"""
    if name == "mlp25m":
        model = mlp25m()
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(8, 1024, generator=g), torch.randn(8, 1024, generator=g)
        return model, (lambda m: torch.nn.functional.mse_loss(m(x), y)), 8
    if name == "transformer":
        model = TinyTransformer()
        g = torch.Generator().manual_seed(0)
        tok = torch.randint(0, 2000, (8, 64), generator=g)
        return model, (lambda m: torch.nn.functional.cross_entropy(m(tok[:, :-1]).reshape(-1, 2000),
                                                                   tok[:, 1:].reshape(-1))), 8
    raise ValueError(f"unknown model {name!r}: use mlp25m or transformer")


def param_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
