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


def sleeping_model(layers: list, fwd_s: float, bwd_s: float, grad_value=lambda i: 1e-3) -> torch.nn.Module:
    """A model whose compute is simulated, as a GPU would do it while leaving the CPU to communication
    (benchmarks/scaling.py, benchmarks/headline.py): layer i holds parameters of the shapes in
    `layers[i]`; its forward sleeps `fwd_s` and passes its input on, its backward sleeps `bwd_s` and
    gives every parameter a real gradient filled with `grad_value(i)`, so real gradient bytes flow
    and every rank's averaged gradient is checkable."""
    import time

    class Sleep(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, grads, *params):
            ctx.grads = grads
            time.sleep(fwd_s)
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(bwd_s)
            return (g, None, *ctx.grads)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList()
            # the gradients the layers "compute", made once: fixed values, no allocation per step
            self.grads = []
            for i, shapes in enumerate(layers):
                m = torch.nn.Module()
                m.p = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s)) for s in shapes])
                self.layers.append(m)
                self.grads.append([torch.full(s, grad_value(i)) for s in shapes])

        def forward(self, x):
            for m, grads in zip(self.layers, self.grads):
                x = Sleep.apply(x, grads, *m.p)
            return x

    return Model()


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
