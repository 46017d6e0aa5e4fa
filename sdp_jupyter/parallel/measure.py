"""Measure mode: simulate one rank of a hybrid-parallel job at full scale on this machine, without
allocating its memory, and compare with the advisor's formula.

How: a fake process group (``torch.testing._internal.distributed.fake_pg``: collectives return at
once) with the job's real world size gives the real (pp, dp, tp) mesh; under ``FakeTensorMode`` the
model is built, split for the pipeline, tensor-parallelised, checkpointed and sharded by the same
``Hybrid.parallelize`` a job uses, so every tensor has its true per-rank shape and no storage.
``StorageTracker`` (below; it counts what torch's ``MemTracker`` counts, without the module hooks
that refuse a module run several times before its backward) follows every storage a training step
creates; parameters, gradients and optimizer states are summed from the tensors themselves.

The step simulated is the one the formula describes: the stage with the formula's peak holds
``in_flight`` microbatches (their forwards first, then their backwards, as a stage does at the
height of a GPipe or 1F1B schedule), after a first step that created the optimizer states.
ZeRO-1 (``sharding="optimizer"``) is simulated by giving the optimizer this rank's partition of the
parameters (ZeroRedundancyOptimizer's greedy partition by size); FSDP2 runs as it is.

Limits, stated: fp32 only (bf16 mixed precision needs fp32 master copies the plain optimizer does
not keep, so the comparison would not be like for like); CPU attention is the fused kernel (no s*s
scores: compare with ``flash_attention=True``, which is what this module passes to the formula);
activation offloading, FSDP2 (``sharding="gradients"/"full"``) and the interleaved schedule are not
simulated (offloaded copies would count as device memory here; FSDP2 does not run under fake tensors
on CPU; interleaving holds several chunks per rank).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from sdp_jupyter import advisor as A

#: measured category -> the formula's terms it corresponds to ("Activation": everything a step
#: allocates on top of parameters, gradients and optimizer states, at its peak)
CATEGORIES = {"Parameter": ("weights", "gathered layers"), "Gradient": ("gradients", "embedding gradient"),
              "Optstate": ("optimizer states",),
              "Activation": ("activations", "recomputed layer", "logits", "logits gradient",
                             "head input (gathered)")}


@dataclass(frozen=True)
class Measurement:
    estimate: A.Estimate  # the formula, for the same (fp32, fused attention) configuration
    stage: int
    rank: int
    peak: int  # bytes, measured
    by_category: dict  # MemTracker category -> bytes at the peak

    def formula_peak(self) -> float:
        st = self.estimate.stages[self.stage]
        return st.total - st.term("overhead")

    @property
    def ratio(self) -> float:
        """measured / formula (without the formula's fixed overhead, which is not simulated)."""
        return self.peak / self.formula_peak()

    def table(self) -> str:
        st = self.estimate.stages[self.stage]
        lines = [f"stage {self.stage} (rank {self.rank}) of {self.estimate.config.describe()}: "
                 f"measured {self.peak / A.GiB:.3f} GiB, formula {self.formula_peak() / A.GiB:.3f} GiB "
                 f"(ratio {self.ratio:.3f})"]
        for cat, terms in CATEGORIES.items():
            f = sum(st.term(t) for t in terms)
            if cat == "Activation":  # the formula's peak over its backward phases
                f = st.total - sum(st.term(t) for ts in list(CATEGORIES.values())[:3] for t in ts) \
                    - st.term("overhead")
            lines.append(f"  {cat:<11} measured {self.by_category.get(cat, 0) / A.GiB:8.3f} GiB   "
                         f"formula {f / A.GiB:8.3f} GiB  ({', '.join(terms) or '-'})")
        return "\n".join(lines)


@contextmanager
def fake_world(world_size: int, rank: int):
    """A single-process stand-in for ``world_size`` ranks (this process plays ``rank``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("measure() needs a process without a process group")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _zero1_partition(params, world: int, rank: int):
    """ZeroRedundancyOptimizer's assignment: largest first, each to the least-loaded rank."""
    loads = [0] * world
    mine = []
    for p in sorted(params, key=lambda p: p.numel(), reverse=True):
        r = loads.index(min(loads))
        loads[r] += p.numel()
        if r == rank:
            mine.append(p)
    return mine


def measure(workload: A.Workload, cluster: A.Cluster, config: A.ParallelConfig,
            stage: int | None = None, build=None, runtime: str = "megatron") -> Measurement:
    """Simulate the rank of ``stage`` (default: the formula's peak stage) and measure its peak.

    ``build``: a function returning the torch module to simulate (called under fake tensors, so it
    allocates nothing), in the layout ``sdp_jupyter.parallel`` expects; default: our GPT of the
    workload's shape. ``workload.model`` should describe it (``advisor.shape_of(module)``).
    ``runtime``: which accounting the formula uses for the comparison ("megatron" or "torch")."""
    from sdp_jupyter import parallel
    from sdp_jupyter.parallel import gpt

    m = replace(workload.model, tied_embeddings=False, dropout=False)  # what parallel.gpt.GPT is
    workload = replace(workload, model=m, precision="fp32")
    config = replace(config, flash_attention=True, offload_activations=False, runtime=runtime)
    est = A.estimate(workload, cluster, config, overhead=0)
    if est.errors:
        raise ValueError("invalid configuration: " + "; ".join(e.message for e in est.errors))
    stage = est.peak_stage.stage if stage is None else stage
    dp, tp = est.dp, config.tp
    rank = stage * dp * tp  # mesh (pp, dp, tp): first rank of this stage
    g = gpt.GPTConfig(layers=m.layers, hidden=m.hidden, heads=m.heads, vocab=m.vocab,
                      seq_len=workload.seq_len, ffn=m.ffn)
    b = workload.batch // config.microbatches
    n = max(1, int(round(A.in_flight(config, stage))))
    with fake_world(cluster.world_size, rank):
        hp = parallel.setup(config)  # the mesh holds real (tiny) tensors: outside fake mode
        return _simulate(hp, build or (lambda: gpt.GPT(g)), workload, config, est, stage, rank, b, n)


class StorageTracker:
    """Live bytes of every storage created while active, and their peak: a TorchDispatchMode that
    sees each op's outputs (DTensor outputs through their local tensors) and a weakref that
    subtracts a storage when it dies. Works on fake tensors; counts each storage once.
    (torch's MemTracker does this too, but its module hooks refuse a module run several times
    before its backward, which is what a pipeline stage with microbatches in flight does.)"""

    def __init__(self, existing=()):
        """``existing``: tensors allocated before (parameters, gradients, optimizer states); ops
        that return them or views of them (``w.t()``, ``grad.add_()``) allocate nothing."""
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode

        self.live = 0
        self.peak = 0
        self._seen: dict[int, object] = {}
        self._known = {id(st): st for st in (self._storage(t) for t in existing if t is not None)}
        tracker = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in torch.utils._pytree.tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        tracker._add(t, weakref)
                return out

        self._mode = _Mode()

    @staticmethod
    def _storage(t):
        local = t.to_local() if hasattr(t, "to_local") else t
        return local.untyped_storage()

    def _add(self, t, weakref):
        if hasattr(t, "__tensor_flatten__"):  # DTensor and other wrapper subclasses
            names, _ = t.__tensor_flatten__()
            for n in names:
                inner = getattr(t, n)
                if isinstance(inner, torch.Tensor):
                    self._add(inner, weakref)
            return
        st = t.untyped_storage()
        key = id(st)
        if self._known.get(key) is st or (key in self._seen and self._seen[key]() is st):
            return
        nbytes = st.nbytes()

        def gone(_ref, key=key, nbytes=nbytes):
            self.live -= nbytes
            self._seen.pop(key, None)

        self._seen[key] = weakref.ref(st, gone)
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


def _nbytes(tensors) -> int:
    """Bytes of the local storages of ``tensors`` (DTensors: their shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def _simulate(hp, build, workload, config, est, stage, rank, b, n):
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sdp_jupyter.parallel import gpt

    m, tp = workload.model, config.tp
    if hp.virtual_stages > 1:
        raise NotImplementedError("measure() simulates one stage per rank; not the interleaved schedule")
    if config.sharding in ("gradients", "full"):
        raise NotImplementedError("measure() simulates sharding='optimizer' (ZeRO-1); FSDP2 does "
                                  "not run under fake tensors here")
    with FakeTensorMode(allow_non_fake_inputs=True):  # the mesh's rank tensor is real
        model = hp.parallelize(build())
        params = list(model.parameters())
        owned = params
        if config.sharding == "optimizer" and hp.dp > 1:
            owned = _zero1_partition(params, hp.dp, hp.dp_rank)
        opt = torch.optim.AdamW(owned, lr=1e-4)
        seq = workload.seq_len // tp if (config.sequence_parallel and tp > 1) else workload.seq_len

        def one_step():
            outs = []
            for _ in range(n):  # the in-flight microbatches: forwards first
                if hp.is_first_stage:
                    x = torch.randint(0, m.vocab, (b, workload.seq_len))
                else:
                    x = torch.randn(b, seq, m.hidden, requires_grad=True)
                y = model(x)
                outs.append(gpt.lm_loss(y, torch.randint(0, m.vocab, (b, workload.seq_len)))
                            if hp.is_last_stage else y)
                del x, y
            while outs:  # then their backwards
                y = outs.pop(0)
                if hp.is_last_stage:
                    y.backward()
                else:
                    y.backward(torch.randn_like(y))
                del y

        with hp.loss_context():
            one_step()  # allocates the gradients (kept, as the formula counts them for the whole step)
        # AdamW's own state allocation (exp_avg, exp_avg_sq per parameter). The update is not run:
        # it reads the step count with .item(), which a fake tensor cannot answer on CPU.
        for group in opt.param_groups:
            opt._init_group(group, [], [], [], [], [], [])
        static = {"Parameter": _nbytes(params), "Gradient": _nbytes(p.grad for p in params),
                  "Optstate": _nbytes(v for st in opt.state.values() for k, v in st.items()
                                      if k != "step")}
        existing = params + [p.grad for p in params] + [v for st in opt.state.values() for v in st.values()]
        with StorageTracker(existing) as tracker, hp.loss_context():
            one_step()
    by_cat = dict(static, **{"Activation": tracker.peak})
    return Measurement(est, stage, rank, int(sum(static.values()) + tracker.peak), by_cat)
