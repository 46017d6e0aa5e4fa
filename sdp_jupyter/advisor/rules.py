"""The rules a configuration must obey, each broken one a Finding with its fix, and the estimate
that puts the memory model and the rules together.

``validate_layout`` needs no model (what a launcher checks from ``--nodes`` and the parallel options
before any process starts); ``validate`` adds the rules of the model and the batch, and the one
that needs the memory figures (``min_nodes``: a configuration that fits only because of sharding).
"""
from __future__ import annotations

import math
from dataclasses import replace

from sdp_jupyter.advisor.inputs import DEFAULT_OVERHEAD, HEADROOM, GiB, Cluster, Workload
from sdp_jupyter.advisor.memory_model import bubble_fraction, memory_by_stage
from sdp_jupyter.advisor.results import Estimate, Finding
from sdp_jupyter.parallel_config import ParallelConfig


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


def estimate(workload: Workload, cluster: Cluster, config: ParallelConfig = ParallelConfig(),
             overhead: float = DEFAULT_OVERHEAD, headroom: float = HEADROOM) -> Estimate:
    """Per-GPU memory of every pipeline stage, with each term and the validation findings."""
    stages = memory_by_stage(workload, cluster, config, overhead)
    est = Estimate(workload, cluster, config, stages, (), headroom, bubble_fraction(config), overhead)
    return replace(est, findings=tuple(validate(workload, cluster, config, est)))
