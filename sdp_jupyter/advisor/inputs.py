"""The advisor's inputs: the model's shape, the cluster and the workload (sequence, batch,
precision, optimizer), and the units every figure is in.

Every figure is bytes; ``GiB`` is 2**30 bytes, the unit NVIDIA's "40 GB" A100 is sold in
(nvidia-smi: 40960 MiB) and the unit of ``sdp_jupyter.instances`` (``gpu_memory_gb``).
"""
from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
HEADROOM = 0.85
DEFAULT_OVERHEAD = 1.5 * GiB

PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adam", "adamw", "sgd_momentum", "sgd")


@dataclass(frozen=True)
class ModelShape:
    """A GPT-2-shaped decoder: pre-LN blocks, learned positions, MLP of width ``ffn``, biases.

    ``tied_embeddings``: the output projection reuses the token embedding (GPT-2); with pipeline
    parallelism the last stage then holds a second copy (as Megatron does).
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    ffn: int = 0  # 0: 4 * hidden
    max_positions: int = 0  # 0: the sequence length of the workload
    tied_embeddings: bool = True
    dropout: bool = True  # GPT-2 trains with dropout: its masks are part of the paper's 34 and 5
    name: str = ""

    def __post_init__(self):
        if self.ffn == 0:
            object.__setattr__(self, "ffn", 4 * self.hidden)
        for f in ("layers", "hidden", "heads", "vocab", "ffn"):
            if getattr(self, f) < 1:
                raise ValueError(f"ModelShape.{f} must be >= 1, got {getattr(self, f)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    # parameters of one transformer block, split into the part tensor parallelism shards and the
    # part every tp rank keeps (layer norms, the row-parallel biases)
    def layer_params_sharded(self) -> int:
        h, f = self.hidden, self.ffn
        return 4 * h * h + 3 * h + 2 * h * f + f  # qkv (w, b), attn out w, fc1 (w, b), fc2 w

    def layer_params_replicated(self) -> int:
        return 6 * self.hidden  # attn out bias, fc2 bias, 2 layer norms (weight, bias)

    def layer_params(self) -> int:
        return self.layer_params_sharded() + self.layer_params_replicated()

    def params(self, seq_len: int = 0) -> int:
        """Total parameter count (a tied output head counted once)."""
        pos = self.max_positions or seq_len
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return (self.layers * self.layer_params() + self.vocab * self.hidden + pos * self.hidden
                + 2 * self.hidden + head)

    @classmethod
    def from_params(cls, params: float, vocab: int = 50304, head_dim: int = 128,
                    name: str = "") -> "ModelShape":
        """A GPT shape for a bare parameter count: ``12*L*h^2 ~ params`` with ``h ~ 128*L``
        (Kaplan et al. 2020 find loss flat for d_model/n_layer between 50 and 200), ``h`` a multiple
        of 1024 (heads of ``head_dim`` divisible by 8) and ``L`` even. Documented guess: give the
        real shape when it is known."""
        if params <= 0:
            raise ValueError("params must be positive")
        layers_guess = (params / (12 * 128 * 128)) ** (1 / 3)
        hidden = max(1024, int(round(128 * layers_guess / 1024)) * 1024)
        layers = max(2, 2 * int(round(params / (12 * hidden * hidden) / 2)))
        return cls(layers=layers, hidden=hidden, heads=hidden // head_dim, vocab=vocab,
                   name=name or f"{params / 1e9:g}B")

    @classmethod
    def from_config(cls, cfg) -> "ModelShape":
        """From a Hugging Face GPT-2 style config object or dict (n_layer/n_embd/n_head/vocab_size)."""
        get = (cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d))
        layers = get("n_layer") or get("num_hidden_layers")
        hidden = get("n_embd") or get("hidden_size")
        heads = get("n_head") or get("num_attention_heads")
        vocab = get("vocab_size")
        ffn = get("n_inner") or get("intermediate_size") or 0
        if not all((layers, hidden, heads, vocab)):
            raise ValueError("config lacks n_layer/n_embd/n_head/vocab_size")
        return cls(layers=layers, hidden=hidden, heads=heads, vocab=vocab, ffn=ffn,
                   max_positions=get("n_positions") or get("max_position_embeddings") or 0)


def shape_of(module) -> ModelShape:
    """The shape of a torch module: ``sdp_jupyter.parallel.gpt.GPT`` (its ``cfg``), a Hugging Face
    model (its ``config``), else a GPT shape guessed from its parameter count (``from_params``)."""
    cfg = getattr(module, "cfg", None)
    if cfg is not None and hasattr(cfg, "shape"):
        return cfg.shape()
    config = getattr(module, "config", None)
    if config is not None:
        try:
            return ModelShape.from_config(config)
        except ValueError:
            pass
    n = sum(p.numel() for p in module.parameters())
    return ModelShape.from_params(n, name=f"{type(module).__name__} (shape guessed from {n:,} parameters)")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``gpus_per_node`` GPUs with ``gpu_memory_gib`` each."""

    gpus_per_node: int
    gpu_memory_gib: float
    nodes: int = 1
    instance_type: str | None = None
    price_per_hour: float | None = None  # per node, USD, None when unknown

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.nodes < 1 or self.gpu_memory_gib <= 0:
            raise ValueError(f"bad cluster {self}")

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    @classmethod
    def from_instance(cls, instance_type: str, count: int = 1) -> "Cluster":
        """From the instance catalogue (``sdp_jupyter.instances``)."""
        from sdp_jupyter import instances

        inst = instances.get(instance_type)
        if not inst.gpus or not inst.gpu_memory_gb:
            raise ValueError(f"{instance_type} has no GPUs with known memory in the catalogue")
        return cls(gpus_per_node=inst.gpus, gpu_memory_gib=float(inst.gpu_memory_gb), nodes=count,
                   instance_type=instance_type, price_per_hour=inst.price_per_hour_usd)

    def describe(self) -> str:
        kind = self.instance_type or f"{self.gpus_per_node} GPU nodes"
        return (f"{self.nodes} x {kind} ({self.world_size} GPUs of {self.gpu_memory_gib:g} GiB)")


@dataclass(frozen=True)
class Workload:
    model: ModelShape
    seq_len: int
    batch: int  # per model replica (tp x pp group) with prescaled_batch; global = replica batch * dp
    precision: str = "bf16"  # mixed precision with fp32 master weights, or plain fp32
    optimizer: str = "adam"
    #: SageMaker's prescaled_batch: True, ``batch`` is what the whole tp group processes (every tp
    #: rank reads the same samples); False, every tp rank reads its own ``batch`` samples and the
    #: group processes ``tp * batch``
    prescaled_batch: bool = True

    def replica_batch(self, tp: int) -> int:
        return self.batch if self.prescaled_batch else self.batch * tp

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision={self.precision!r}: allowed {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer={self.optimizer!r}: allowed {', '.join(OPTIMIZERS)}")
        if self.seq_len < 1 or self.batch < 1:
            raise ValueError("seq_len and batch must be >= 1")
