"""What to change: ``recommend`` climbs the SageMaker guide's ladder (a larger instance, sharding,
checkpointing, tp, pp, a smaller batch) to the cheapest configuration that fits; ``explain`` says
why each knob of a configuration is there (the same job without it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from sdp_jupyter.advisor.inputs import DEFAULT_OVERHEAD, HEADROOM, GiB, Cluster, Workload
from sdp_jupyter.advisor.memory_model import bubble_fraction
from sdp_jupyter.advisor.results import Estimate
from sdp_jupyter.advisor.rules import estimate
from sdp_jupyter.parallel_config import ParallelConfig


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
