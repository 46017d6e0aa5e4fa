"""A small GPT-2-shaped decoder written so that torch's parallel pieces apply to it unchanged.

* separate ``wq``/``wk``/``wv`` projections (a fused qkv weight would be split across tensor-parallel
  ranks in the middle of a head) and head counts taken from the local width (``view(B, T, -1, hd)``),
  so a column-sharded attention runs ``heads / tp`` heads on each rank;
* blocks live in a ``ModuleDict`` keyed by their global index, so a pipeline stage keeps the names
  of the full model (parameters compare one to one with a single-process reference);
* parts a stage does not own are ``None`` (embeddings on the first stage, norm and head on the last),
  the layout torchtitan uses with ``torch.distributed.pipelining``;
* an untied output head (a tied one would span the first and the last stage).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 4
    hidden: int = 64
    heads: int = 4
    vocab: int = 128
    seq_len: int = 16
    ffn: int = 0  # 0: 4 * hidden

    @property
    def ffn_width(self) -> int:
        return self.ffn or 4 * self.hidden

    def shape(self):
        """The advisor's ModelShape of this model."""
        from sdp_jupyter.advisor import ModelShape

        return ModelShape(layers=self.layers, hidden=self.hidden, heads=self.heads, vocab=self.vocab,
                          ffn=self.ffn_width, max_positions=self.seq_len, tied_embeddings=False,
                          dropout=False)


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        h = cfg.hidden
        self.head_dim = h // cfg.heads
        self.wq, self.wk, self.wv = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.wo = nn.Linear(h, h)

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (w(x).view(B, T, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden, cfg.ffn_width)
        self.proj = nn.Linear(cfg.ffn_width, cfg.hidden)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.layers)})
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, x):
        """Token ids (B, T) on the first stage, activations (B, T, h) elsewhere; logits on the last."""
        if self.tok_emb is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.tok_emb(x) + self.pos_emb(pos)
        for block in self.layers.values():
            x = block(x)
        if self.head is not None:
            x = self.head(self.ln_f(x))
        return x


def lm_loss(logits, targets):
    """Mean token cross-entropy (what each pipeline microbatch returns; torch scales by 1/m)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
