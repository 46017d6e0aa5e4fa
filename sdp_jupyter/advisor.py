"""Model-parallel advisor: per-GPU memory of a hybrid-parallel training job, the rules a configuration
must obey, and the cheapest change that makes a model fit.

Pure logic: no torch, no widgets (measure mode, which imports torch, is ``sdp_jupyter.parallel.measure``). Every figure is
bytes; ``GiB`` is 2**30 bytes, the unit NVIDIA's "40 GB" A100 is sold in (nvidia-smi: 40960 MiB) and
the unit of ``sdp_jupyter.instances`` (``gpu_memory_gb``).

The memory model, per GPU (one rank of pipeline stage ``i``):

* weights, gradients, optimizer states: bytes per parameter from the precision and optimizer
  (mixed-precision Adam: 2 + 2 + 12 = 16, as in ZeRO), for the parameters this rank holds after
  tensor parallelism (``tp``) and pipeline partitioning (``pp``); sharding over the data-parallel
  group (``dp = world / (tp * pp)``) divides the optimizer states (``"optimizer"``: ZeRO-1,
  SageMaker's ``shard_optimizer_state``, torch's ZeroRedundancyOptimizer), also the gradients
  (``"gradients"``: ZeRO-2) or also the weights (``"full"``: ZeRO-3, FSDP2 ``fully_shard``, which then
  holds one gathered layer and one prefetched layer in full).
* activations (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models"): per layer and microbatch ``s*b*h*(34 + 5*a*s/h)`` bytes at 16-bit, divided by ``tp``
  with sequence parallelism (``s*b*h*(10 + 24/tp + 5*a*s/(h*tp))`` without it); the ``5as/h``
  (attention scores) term vanishes with flash attention or selective recomputation (34 is for
  ffn = 4h: the MLP's two ffn-wide tensors count 4*ffn/h in general); with per-layer
  checkpointing only each layer's input (``2*s*b*h/tp``) is kept, plus one layer recomputed at a time.
* in-flight microbatches per stage: 1 without pipelining, ``m`` for GPipe, ``min(p - i, m)`` for
  1F1B, ``min(m, ((p - i - 1) * 2 + (v - 1) * p + 1) / v)`` for interleaved with ``v`` chunks per
  rank (Megatron's warm-up count), each capped by ``active_microbatches``; offloading keeps two on
  the GPU (the running one and the prefetched one).
* logits on the last stage: ``4*s*b*V/tp`` bytes per in-flight microbatch (the fp32 logits the
  cross-entropy keeps, as in the paper), and in backward twice that for their gradients (the
  gradient of the log-softmax and of the logits). With per-layer checkpointing these are freed
  before the first layer is recomputed: the peak counts the larger of the two phases.
* a stated fixed overhead (CUDA context, NCCL and cuBLAS workspaces; 1.5 GiB by default).

A configuration fits when its largest stage stays within ``headroom`` (85 %) of GPU memory; the
other 15 % is left to the caching allocator's fragmentation and to temporary buffers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from sdp_jupyter.parallel_config import CHECKPOINTING, RUNTIMES, SCHEDULES, SHARDING, ParallelConfig  # noqa: F401

GiB = 1 << 30
HEADROOM = 0.85
DEFAULT_OVERHEAD = 1.5 * GiB

PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adam", "adamw", "sgd_momentum", "sgd")

#: optimizer state bytes per parameter (fp32), not counting a mixed-precision master copy
_OPT_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0}


# --------------------------------------------------------------------------------------------
# inputs


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


# --------------------------------------------------------------------------------------------
# outputs


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    how: str  # the formula with its numbers
    #: "" for memory held through the whole backward; terms of a named phase are only live in that
    #: phase ("loss": the logits and their gradient, freed before "recompute": the one layer
    #: per-layer checkpointing rebuilds), so a stage's peak counts the largest phase only
    phase: str = ""

    @property
    def gib(self) -> float:
        return self.bytes / GiB


@dataclass(frozen=True)
class Finding:
    level: str  # "error" (will not run), "warning" (runs badly), "info"
    knob: str
    message: str
    fix: str = ""

    def __str__(self):
        return f"[{self.level}] {self.knob}: {self.message}" + (f" Fix: {self.fix}" if self.fix else "")


@dataclass(frozen=True)
class StageMemory:
    stage: int
    layers: int
    in_flight: float
    terms: tuple[Term, ...]

    @property
    def total(self) -> float:
        phases: dict[str, float] = {}
        for t in self.terms:
            phases[t.phase] = phases.get(t.phase, 0.0) + t.bytes
        held = phases.pop("", 0.0)
        return held + max(phases.values(), default=0.0)

    def term(self, name: str) -> float:
        return sum(t.bytes for t in self.terms if t.name == name)


@dataclass(frozen=True)
class Estimate:
    workload: Workload
    cluster: Cluster
    config: ParallelConfig
    stages: tuple[StageMemory, ...]
    findings: tuple[Finding, ...]
    headroom: float
    bubble: float
    overhead: float = DEFAULT_OVERHEAD

    @property
    def dp(self) -> int:
        return max(1, self.cluster.world_size // (self.config.tp * self.config.pp))

    @property
    def peak_stage(self) -> StageMemory:
        return max(self.stages, key=lambda s: s.total)

    @property
    def peak(self) -> float:
        return self.peak_stage.total

    @property
    def peak_gib(self) -> float:
        return self.peak / GiB

    @property
    def budget(self) -> float:
        return self.headroom * self.cluster.gpu_memory_gib * GiB

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def valid(self) -> bool:
        return not self.errors

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget

    @property
    def ok(self) -> bool:
        return self.valid and self.fits

    @property
    def global_batch(self) -> int:
        return self.workload.replica_batch(self.config.tp) * self.dp

    def terms(self) -> tuple[Term, ...]:
        return self.peak_stage.terms

    def summary(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        return (f"{self.config.describe()} on {self.cluster.describe()}: peak {self.peak_gib:.1f} GiB "
                f"(stage {self.peak_stage.stage}) {verdict} in {self.budget / GiB:.1f} GiB "
                f"({self.headroom:.0%} of {self.cluster.gpu_memory_gib:g} GiB)")

    def table(self) -> str:
        """The terms of the peak stage, one per line, for people."""
        lines = [self.summary()]
        for t in self.terms():
            phase = f" [{t.phase} phase]" if t.phase else ""
            lines.append(f"  {t.name:<22}{t.gib:8.2f} GiB   {t.how}{phase}")
        if self.config.pp > 1:
            lines.append(f"  pipeline bubble       {self.bubble:8.1%}      (p-1)/(m+p-1)")
        for f in self.findings:
            lines.append(f"  {f}")
        return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# the formula


def _fmt(x: float) -> str:
    return f"{x / GiB:.2f} GiB"


def in_flight(config: ParallelConfig, stage: int) -> float:
    """Microbatches whose activations stage ``stage`` holds at its peak."""
    p, m = config.pp, config.microbatches
    if p == 1:
        n = 1.0  # gradient accumulation: one microbatch forward+backward at a time
    elif config.schedule == "gpipe":
        n = float(m)
    elif config.schedule == "1f1b" or config.virtual_stages == 1:
        n = float(min(p - stage, m))
    else:  # interleaved: Megatron's warm-up (p - i - 1) * 2 + (v - 1) * p chunks + 1, in stage units
        v = config.virtual_stages
        n = min(float(m), ((p - stage - 1) * 2 + (v - 1) * p + 1) / v)
    if config.active_microbatches is not None:
        n = min(n, float(config.active_microbatches))
    return n


def bubble_fraction(config: ParallelConfig) -> float:
    p, m = config.pp, config.microbatches
    if p == 1:
        return 0.0
    v = config.virtual_stages if config.schedule == "interleaved" else 1
    return (p - 1) / (v * m + p - 1)


def _bytes_per_param(w: Workload) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states incl. fp32 master copy) per parameter."""
    if w.precision == "fp32":
        return 4, 4, _OPT_STATE_BYTES[w.optimizer]
    return 2, 2, 4 + _OPT_STATE_BYTES[w.optimizer]


def _layers_of_stage(layers: int, pp: int, stage: int) -> int:
    base, extra = divmod(layers, pp)
    return base + (1 if stage < extra else 0)


def memory_by_stage(workload: Workload, cluster: Cluster, config: ParallelConfig,
                    overhead: float = DEFAULT_OVERHEAD) -> tuple[StageMemory, ...]:
    """Per-GPU memory of every pipeline stage, term by term (no rules checked)."""
    m_, s, c = workload.model, workload.seq_len, config
    t, p = c.tp, c.pp
    dp = max(1, cluster.world_size // (t * p))
    wb, gb, ob = _bytes_per_param(workload)
    act_scale = (2 if workload.precision == "fp32" else 1)  # the paper's constants are for 16-bit
    b = workload.replica_batch(t) / c.microbatches  # microbatch size
    h, a, V = m_.hidden, m_.heads, m_.vocab
    sbh = s * b * h
    # without dropout: no masks (2 sbh) and no dropout copy/mask of the scores (3 as^2 b)
    k_sbh, k_as = (34, 5) if m_.dropout else (32, 2)
    k_sbh += 4 * m_.ffn / h - 16  # the paper's MLP keeps 2 x 8sbh at ffn = 4h: 4*ffn/h in general
    attn = 0.0 if (c.flash_attention or c.checkpointing == "selective") else k_as * a * s / h
    sp = c.sequence_parallel or t == 1
    if sp:
        per_layer_full = sbh * (k_sbh + attn) / t * act_scale
        full_how = f"s*b*h*({k_sbh}+{attn:g})/tp"
        layer_input = 2 * sbh / t * act_scale
        if c.runtime == "torch" and t > 1:  # attention and MLP inputs kept all-gathered
            per_layer_full += 2 * 2 * sbh * (1 - 1 / t) * act_scale
            full_how += " + 4*s*b*h*(1-1/tp) gathered inputs"
    else:
        per_layer_full = sbh * (10 + (k_sbh - 10 + attn) / t) * act_scale
        full_how = f"s*b*h*(10+({k_sbh - 10}+{attn:g})/tp)"
        layer_input = 2 * sbh * act_scale
    shard_opt = dp if c.sharding in ("optimizer", "gradients", "full") else 1
    shard_grad = dp if c.sharding in ("gradients", "full") else 1
    shard_w = dp if c.sharding == "full" else 1
    stages = []
    for i in range(p):
        L_i = _layers_of_stage(m_.layers, p, i)
        params = L_i * (m_.layer_params_sharded() / t + m_.layer_params_replicated())
        if i == 0:
            params += V * h / t + (m_.max_positions or s) * h
        if i == p - 1:
            params += 2 * h  # final layer norm
            if not m_.tied_embeddings or p > 1:
                params += V * h / t  # output head (a tied copy on the last stage when pp > 1)
        terms = [
            Term("weights", params * wb / shard_w,
                 f"{params / 1e9:.3f}B params x {wb} B" + (f" / dp {dp}" if shard_w > 1 else "")),
            Term("gradients", params * gb / shard_grad,
                 f"{params / 1e9:.3f}B x {gb} B" + (f" / dp {dp}" if shard_grad > 1 else "")),
            Term("optimizer states", params * ob / shard_opt,
                 f"{params / 1e9:.3f}B x {ob} B ({workload.optimizer}"
                 + (", fp32 master" if wb == 2 else "") + ")"
                 + (f" / dp {dp}" if shard_opt > 1 else "")),
        ]
        if i == 0 and c.runtime == "torch" and t > 1:
            terms.append(Term("embedding gradient", V * h * (1 - 1 / t) * gb / shard_grad,
                              "torch: the vocabulary-parallel embedding's gradient is replicated, "
                              "V*h*(1-1/tp)"))
        if c.sharding == "full":
            gathered = 2 * (m_.layer_params_sharded() / t + m_.layer_params_replicated()) * wb
            terms.append(Term("gathered layers", gathered, "2 layers unsharded (current + prefetch)"))
        n = in_flight(c, i)
        if c.offload_activations and c.checkpointing == "layer":
            n_gpu = min(n, 2.0)
            n_how = f"{n:g} in flight, {n_gpu:g} on GPU (offload)"
        else:
            n_gpu, n_how = n, f"{n:g} microbatch(es) in flight"
        if c.checkpointing == "layer":
            kept = n_gpu * L_i * layer_input
            terms.append(Term("activations", kept,
                              f"{L_i} layer inputs x 2*s*b*h{'/tp' if sp else ''} x {n_how} (b={b:g})"))
            terms.append(Term("recomputed layer", per_layer_full, f"one layer: {full_how}",
                              "recompute"))
        else:
            terms.append(Term("activations", n_gpu * L_i * per_layer_full,
                              f"{L_i} layers x {full_how} x {n_how} (b={b:g})"))
        if i == p - 1:
            logits = 4 * s * b * V / t
            terms.append(Term("logits", n_gpu * logits, f"4*s*b*V/tp fp32 logits x {n_gpu:g}", "loss"))
            terms.append(Term("logits gradient", 2 * logits,
                              "2 x 4*s*b*V/tp: grads of log-softmax and logits (backward)", "loss"))
            if c.runtime == "torch" and t > 1 and sp:
                terms.append(Term("head input (gathered)", n_gpu * 2 * sbh * (1 - 1 / t) * act_scale,
                                  "torch: the column-parallel head keeps its all-gathered input",
                                  "loss"))
        terms.append(Term("overhead", overhead, "CUDA context, NCCL/cuBLAS workspaces (stated)"))
        stages.append(StageMemory(i, L_i, n, tuple(terms)))
    return tuple(stages)


def estimate(workload: Workload, cluster: Cluster, config: ParallelConfig = ParallelConfig(),
             overhead: float = DEFAULT_OVERHEAD, headroom: float = HEADROOM) -> Estimate:
    """Per-GPU memory of every pipeline stage, with each term and the validation findings."""
    stages = memory_by_stage(workload, cluster, config, overhead)
    est = Estimate(workload, cluster, config, stages, (), headroom, bubble_fraction(config), overhead)
    return replace(est, findings=tuple(validate(workload, cluster, config, est)))


# --------------------------------------------------------------------------------------------
# rules


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def validate_layout(config: ParallelConfig, gpus_per_node: int, nodes: int) -> list[Finding]:
    """The rules that need no model: what a launcher can check from ``--nodes``, GPUs per node and
    the parallel options alone, before any process starts."""
    c, f = config, []
    t, p, mb = c.tp, c.pp, c.microbatches
    world = gpus_per_node * nodes
    if not _pow2(t):
        f.append(Finding("error", "tp", f"tp={t} is not a power of two.",
                         "use 1, 2, 4 or 8: shards must split heads and widths evenly"))
    if t > gpus_per_node:
        f.append(Finding("error", "tp", f"tp={t} is larger than the {gpus_per_node} GPUs "
                         "of a node: tensor parallelism must not cross nodes (its all-reduces run "
                         "every layer, twice per pass).",
                         f"tp <= {gpus_per_node}; use pp across nodes instead"))
    if world % (t * p):
        f.append(Finding("error", "tp/pp", f"world size {world} is not divisible by tp*pp = {t * p}.",
                         "pick tp and pp whose product divides the number of GPUs"))
    if p > 1 and mb < p:
        f.append(Finding("warning", "microbatches", f"microbatches={mb} < pp={p}: the pipeline "
                         f"bubble is {bubble_fraction(c):.0%} of each step.",
                         f"use at least {p} microbatches (4*(pp-1) = {4 * (p - 1)} keeps it <= 20%)"))
    if c.active_microbatches is not None and c.active_microbatches > mb:
        f.append(Finding("warning", "active_microbatches", f"active_microbatches="
                         f"{c.active_microbatches} exceeds microbatches={mb}: it caps nothing.",
                         f"use a value between {min(p, mb)} and {mb}"))
    if c.active_microbatches is not None and p > 1 and c.active_microbatches < min(p, mb):
        f.append(Finding("warning", "active_microbatches", f"active_microbatches="
                         f"{c.active_microbatches} < pp={p}: the first stage waits for the last, "
                         "stalling the pipeline.", f"use at least {min(p, mb)}"))
    if c.offload_activations and (c.checkpointing != "layer" or p == 1 or mb == 1):
        need = [w for w, bad in (("checkpointing='layer'", c.checkpointing != "layer"),
                                 ("pp > 1", p == 1), ("microbatches > 1", mb == 1)) if bad]
        f.append(Finding("error", "offload_activations", "activation offloading moves the "
                         "checkpointed inputs of idle microbatches to CPU; it needs "
                         + ", ".join(need) + ".", "turn on " + ", ".join(need) + " or turn offloading off"))
    dp = world // (t * p) if world % (t * p) == 0 else 0
    if c.sharding != "none" and dp == 1:
        f.append(Finding("warning", "sharding", "sharding over a data-parallel group of 1 saves "
                         "nothing.", "turn sharding off, or add nodes"))
    return f


def validate(workload: Workload, cluster: Cluster, config: ParallelConfig,
             est: Estimate | None = None) -> list[Finding]:
    """Every rule the configuration breaks, each with the fix (``validate_layout``'s and those that
    need the model and batch). ``est`` adds the memory-dependent one (the downsizing check)."""
    m, c = workload.model, config
    t, p, mb = c.tp, c.pp, c.microbatches
    world = cluster.world_size
    f = validate_layout(config, cluster.gpus_per_node, cluster.nodes)
    for name, value in (("heads", m.heads), ("ffn", m.ffn), ("vocab", m.vocab)):
        if value % t:
            q = max(128, t)  # a multiple of 128 also keeps the GPU's matrix tiles full
            fix = (f"pad the vocabulary to a multiple of {q} ({math.ceil(value / q) * q})"
                   if name == "vocab" else f"use a tp that divides {value}")
            f.append(Finding("error", "tp", f"{name}={value} is not divisible by tp={t}.", fix))
    if t > 1 and c.sequence_parallel and workload.seq_len % t:
        f.append(Finding("error", "tp", f"sequence length {workload.seq_len} is not divisible by "
                         f"tp={t} (sequence parallelism splits it).",
                         "pad the sequence or turn sequence parallelism off"))
    if m.layers % p:
        f.append(Finding("error", "pp", f"layers={m.layers} is not divisible by pp={p}: stages "
                         "would be unbalanced.", f"use a pp that divides {m.layers}"))
    if workload.replica_batch(t) % mb:
        f.append(Finding("error", "microbatches", f"batch {workload.replica_batch(t)} is not divisible by "
                         f"microbatches={mb}.", "make the batch a multiple of the microbatch count"))
    if c.schedule == "interleaved" and p > 1 and m.layers % (p * c.virtual_stages):
        f.append(Finding("error", "virtual_stages", f"layers={m.layers} is not divisible by "
                         f"pp*virtual_stages={p * c.virtual_stages}.", "change virtual_stages"))
    dp = world // (t * p) if world % (t * p) == 0 else 0
    if est is not None and c.sharding != "none" and dp > 1 and est.fits:
        smallest = min_nodes(workload, cluster, config, est.overhead, est.headroom)
        if smallest is not None and smallest > 1:
            f.append(Finding("info", "sharding", f"this fits because states are sharded over "
                             f"dp={dp}; it needs at least {smallest} node(s) of this type: on fewer "
                             "(e.g. moving the job to a smaller cluster) each GPU holds a larger "
                             "shard and it will not fit.",
                             f"keep >= {smallest} nodes, or add tp/pp/checkpointing before downsizing"))
    return f


def min_nodes(workload: Workload, cluster: Cluster, config: ParallelConfig,
              overhead: float = DEFAULT_OVERHEAD, headroom: float = HEADROOM) -> int | None:
    """The fewest nodes of this type on which ``config`` still fits (None: not even on this many)."""
    for n in range(1, cluster.nodes + 1):
        smaller = replace(cluster, nodes=n)
        if smaller.world_size % (config.tp * config.pp):
            continue
        stages = memory_by_stage(workload, smaller, config, overhead)
        if max(st.total for st in stages) <= headroom * cluster.gpu_memory_gib * GiB:
            return n
    return None


# --------------------------------------------------------------------------------------------
# recommendation


@dataclass(frozen=True)
class Step:
    knob: str  # which rung of the ladder
    estimate: Estimate | None
    note: str


@dataclass(frozen=True)
class Recommendation:
    estimate: Estimate | None  # None: nothing on the ladder fits
    steps: tuple[Step, ...]

    @property
    def config(self) -> ParallelConfig | None:
        return None if self.estimate is None else self.estimate.config

    def reasoning(self) -> str:
        lines = [f"{i + 1}. {s.knob}: {s.note}" for i, s in enumerate(self.steps)]
        if self.estimate is None:
            lines.append("=> nothing fits on this cluster: add nodes or use GPUs with more memory.")
        else:
            lines.append(f"=> recommend {self.estimate.config.describe()} on "
                         f"{self.estimate.cluster.describe()} ({self.estimate.peak_gib:.1f} GiB peak).")
        return "\n".join(lines)


def _verdict(est: Estimate) -> str:
    if not est.valid:
        return "invalid: " + "; ".join(e.message for e in est.errors)
    return (f"{est.peak_gib:.1f} GiB peak, {'fits' if est.fits else 'does not fit'} in "
            f"{est.budget / GiB:.1f} GiB")


def _pipeline_microbatches(batch: int, pp: int) -> int:
    """Smallest divisor of ``batch`` that keeps the bubble <= 20 % (m >= 4*(pp-1), m >= pp);
    the largest divisor when none does."""
    want = max(pp, 4 * (pp - 1))
    divisors = [d for d in range(1, batch + 1) if batch % d == 0]
    return next((d for d in divisors if d >= want), divisors[-1])


def larger_instances(cluster: Cluster) -> list[Cluster]:
    """Catalogue types with the same GPUs per node and more memory per GPU, cheapest first
    (unknown price last). Empty when the catalogue is not available."""
    try:
        from sdp_jupyter import instances
    except ImportError:  # pragma: no cover - the catalogue ships with the package
        return []
    out = []
    for name, inst in instances.catalogue().items():
        if (inst.gpus == cluster.gpus_per_node and inst.gpu_memory_gb
                and inst.gpu_memory_gb > cluster.gpu_memory_gib):
            out.append(Cluster(inst.gpus, float(inst.gpu_memory_gb), cluster.nodes, name,
                               inst.price_per_hour_usd))
    return sorted(out, key=lambda c: (c.price_per_hour is None, c.price_per_hour or 0,
                                      c.gpu_memory_gib))


def recommend(workload: Workload, cluster: Cluster, proposed: ParallelConfig = ParallelConfig(),
              allow_instance_change: bool = False, overhead: float = DEFAULT_OVERHEAD,
              headroom: float = HEADROOM) -> Recommendation:
    """The cheapest configuration that fits, searched in the SageMaker guide's order: a larger
    instance, optimizer sharding, activation checkpointing, tensor parallelism within a node,
    pipeline parallelism across nodes, a smaller batch. Each rung keeps what the previous ones
    turned on; within a rung the smallest degree that fits wins (least communication).
    A larger instance is only chosen with ``allow_instance_change`` (it is reported either way)."""
    steps: list[Step] = []

    def est(cfg, cl=cluster, wl=workload):
        return estimate(wl, cl, cfg, overhead, headroom)

    def done(e):
        return Recommendation(e, tuple(steps))

    e = est(proposed)
    steps.append(Step("as proposed", e, f"{proposed.describe()}: {_verdict(e)}"))
    if e.ok:
        return done(e)
    # 1. larger instance
    bigger = [(cl, est(proposed, cl)) for cl in larger_instances(cluster)]
    fitting = [(cl, be) for cl, be in bigger if be.ok]
    if fitting:
        cl, be = fitting[0]
        price = f" at ${cl.price_per_hour:g}/h per node" if cl.price_per_hour else ""
        if allow_instance_change:
            steps.append(Step("larger instance", be, f"{cl.instance_type} ({cl.gpu_memory_gib:g} GiB)"
                              f"{price}: {_verdict(be)}"))
            return done(be)
        steps.append(Step("larger instance", be, f"{cl.instance_type} ({cl.gpu_memory_gib:g} GiB) "
                          f"would fit as proposed{price} ({be.peak_gib:.1f} GiB); not chosen "
                          "(allow_instance_change=False): staying on "
                          f"{cluster.instance_type or 'this cluster'}"))
    else:
        steps.append(Step("larger instance", None, "no larger instance type in the catalogue fits "
                          "as proposed" if bigger else "no instance type with more GPU memory"))
    cfg = proposed
    # 2. sharding
    if cfg.sharding == "none":
        cfg = replace(cfg, sharding="optimizer")
        e = est(cfg)
        steps.append(Step("optimizer sharding", e, f"shard optimizer states over dp={e.dp}: {_verdict(e)}"))
        if e.ok:
            return done(e)
    # 3. checkpointing
    if cfg.checkpointing != "layer":
        cfg = replace(cfg, checkpointing="layer")
        e = est(cfg)
        steps.append(Step("activation checkpointing", e, f"checkpoint every layer: {_verdict(e)}"))
        if e.ok:
            return done(e)
    # 4. tensor parallelism within a node
    t = cfg.tp * 2
    while t <= cluster.gpus_per_node:
        trial = replace(cfg, tp=t)
        e = est(trial)
        steps.append(Step("tensor parallelism", e, f"tp={t}: {_verdict(e)}"))
        if e.valid:
            cfg = trial
            if e.fits:
                return done(e)
        t *= 2
    # 5. pipeline parallelism across nodes
    deepest = None
    for p in range(cfg.pp + 1, workload.model.layers + 1):
        if workload.model.layers % p or cluster.world_size % (cfg.tp * p):
            continue
        m = _pipeline_microbatches(workload.replica_batch(cfg.tp), p)
        trial = replace(cfg, pp=p, microbatches=m, active_microbatches=p if m > p else None)
        e = est(trial)
        steps.append(Step("pipeline parallelism", e, f"pp={p}, microbatches={m} (bubble "
                          f"{bubble_fraction(trial):.0%}), active_microbatches={trial.active_microbatches}: "
                          f"{_verdict(e)}"))
        if e.ok:
            return done(e)
        if e.valid:
            deepest = trial
    if deepest is not None:
        cfg = deepest  # nothing fitted: the batch rung starts from the deepest valid pipeline
    # 6. smaller batch
    b = workload.batch
    while b > 1:
        b //= 2
        m = min(cfg.microbatches, b)
        while b % m:
            m -= 1
        trial = replace(cfg, microbatches=m,
                        active_microbatches=(min(cfg.active_microbatches, m)
                                             if cfg.active_microbatches else None))
        e = est(trial, wl=replace(workload, batch=b))
        steps.append(Step("smaller batch", e, f"batch {b}: {_verdict(e)}"))
        if e.ok:
            return done(e)
    return done(None)


# --------------------------------------------------------------------------------------------
# why each knob of a configuration is there


@dataclass(frozen=True)
class KnobReason:
    knob: str
    needed: bool  # without it the configuration does not fit (or is not valid)
    without: Estimate
    message: str


def explain(workload: Workload, cluster: Cluster, config: ParallelConfig,
            overhead: float = DEFAULT_OVERHEAD, headroom: float = HEADROOM) -> list[KnobReason]:
    """For every knob ``config`` turns on, the same job without it: needed to fit, or what it buys."""
    base = estimate(workload, cluster, config, overhead, headroom)
    out: list[KnobReason] = []

    def add(knob, cfg, what_it_buys):
        e = estimate(workload, cluster, cfg, overhead, headroom)
        if not e.ok:
            why = _verdict(e)
            out.append(KnobReason(knob, True, e, f"needed: without it ({cfg.describe()}) {why}"))
        else:
            out.append(KnobReason(knob, False, e, f"not needed to fit (without it {e.peak_gib:.1f} "
                                  f"GiB vs {base.peak_gib:.1f} GiB); {what_it_buys}"))

    if config.sharding != "none":
        add("sharding", replace(config, sharding="none"), "it frees memory for batch")
    if config.checkpointing != "none":
        add("checkpointing", replace(config, checkpointing="none"), "it frees memory for batch")
    if config.tp > 1:
        add("tp", replace(config, tp=config.tp // 2),
            f"tp={config.tp} leaves more headroom; tp={config.tp // 2} would do less communication")
    if config.pp > 1:
        add("pp", replace(config, pp=1, microbatches=1, active_microbatches=None,
                          offload_activations=False), "it halves per-stage weights")
    if config.pp > 1 and config.microbatches > 1:
        one = replace(config, microbatches=1, active_microbatches=None, offload_activations=False)
        e = estimate(workload, cluster, one, overhead, headroom)
        msg = (f"microbatches={config.microbatches} cut the pipeline bubble from "
               f"{bubble_fraction(one):.0%} to {bubble_fraction(config):.0%}")
        if e.ok:
            out.append(KnobReason("microbatches", False, e, "not needed to fit; " + msg))
        else:
            out.append(KnobReason("microbatches", True, e, f"needed: with one microbatch {_verdict(e)}; "
                                  + msg))
    if config.active_microbatches is not None:
        gp = estimate(workload, cluster, replace(config, active_microbatches=None, schedule="gpipe"),
                      overhead, headroom)
        msg = (f"active_microbatches={config.active_microbatches} caps the microbatches a stage "
               f"holds; a GPipe schedule without the cap holds {gp.peak_stage.in_flight:g} "
               f"({gp.peak_gib:.1f} GiB, {(gp.peak - base.peak) / GiB:+.1f} GiB)")
        out.append(KnobReason("active_microbatches", not gp.ok, gp,
                              ("needed: " if not gp.ok else "not needed to fit with 1F1B; ") + msg))
    if config.offload_activations:
        add("offload_activations", replace(config, offload_activations=False),
            "it moves idle microbatches' checkpoints to CPU")
    return out


# --------------------------------------------------------------------------------------------
# SageMaker's reference configurations (GPT-2 shape, sequence 512, vocabulary 50k, ml.p4d.24xlarge:
# 8 x A100 40 GB). The seed gives sizes, not shapes: these shapes are ours (head dim 128, ffn 4h,
# vocabulary 50257 padded to 50304 so that tp divides it), chosen to land on the named sizes.


@dataclass(frozen=True)
class Reference:
    name: str
    workload: Workload
    nodes: int
    config: ParallelConfig
    instance_type: str = "ml.p4d.24xlarge"

    def cluster(self) -> Cluster:
        try:
            return Cluster.from_instance(self.instance_type, self.nodes)
        except Exception:  # catalogue not importable: the seed's figures
            return Cluster(8, 40.0, self.nodes, self.instance_type)


def _gpt(name, layers, hidden):
    return ModelShape(layers=layers, hidden=hidden, heads=hidden // 128, vocab=50304, name=name)


REFERENCES = (
    Reference("GPT-2 10B", Workload(_gpt("10B", 32, 5120), seq_len=512, batch=40, precision="fp16"),
              16, ParallelConfig(tp=4, sharding="optimizer", checkpointing="layer")),
    Reference("GPT-2 30B", Workload(_gpt("30B", 48, 7168), seq_len=512, batch=32, precision="fp16"),
              16, ParallelConfig(tp=8, sharding="optimizer", checkpointing="layer")),
    Reference("GPT-2 60B", Workload(_gpt("60B", 74, 8192), seq_len=512, batch=56, precision="fp16"),
              32, ParallelConfig(tp=8, pp=2, microbatches=4, active_microbatches=2,
                                 sharding="optimizer", checkpointing="layer", schedule="gpipe")),
)

