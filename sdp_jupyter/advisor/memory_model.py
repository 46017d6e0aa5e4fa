"""The advisor's memory model: per-GPU memory of every pipeline stage of a hybrid-parallel training
job, term by term (the rules a configuration must obey are rules.py's).

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

from sdp_jupyter.advisor.inputs import DEFAULT_OVERHEAD, Cluster, Workload
from sdp_jupyter.advisor.results import StageMemory, Term
from sdp_jupyter.parallel_config import ParallelConfig

#: optimizer state bytes per parameter (fp32), not counting a mixed-precision master copy
_OPT_STATE_BYTES = {"adam": 8, "adamw": 8, "sgd_momentum": 4, "sgd": 0}


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
