"""Batch-size and learning-rate scaling for data-parallel training: rules, warnings, estimates.

Pure functions and plain records; no widgets, no torch. ``sdp_jupyter.JobSetup`` (and its form, ``sdp_jupyter.ui.setup``) shows what
``evaluate(Plan(...))`` returns, and a training script may call ``warmup_lr`` to follow the schedule.

Terms
-----
world size     nodes x GPUs (worker processes) per node
global batch   world size x per-GPU batch: the samples one optimizer step averages over
reference      (LR, batch) a learning rate was tuned at, e.g. 0.1 at 256 for ResNet-50 with SGD

The two modes users confuse
---------------------------
``keep_per_gpu``  each GPU keeps its batch; the global batch grows with the world size, so the LR must
                  grow too (rule ``linear`` or ``sqrt``) and a warm-up is advised. Throughput scales.
``keep_global``   the global batch stays at the reference batch; each GPU gets reference / world size
                  samples, so the LR stays as tuned. Steps get cheaper per GPU, but small per-GPU
                  batches hurt BatchNorm and use the GPU poorly (64 on one GPU is 2 per GPU on 32).

Sources
-------
- Goyal et al. 2017, "Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour" (arXiv:1706.02677):
  linear scaling rule (batch x k -> LR x k), gradual warm-up over 5 epochs from the reference LR, works
  up to a global batch of 8k for ResNet-50/ImageNet and breaks beyond; ~90% scaling efficiency from 8
  to 256 GPUs.
- Krizhevsky 2014, "One weird trick for parallelizing convolutional neural networks" (arXiv:1404.5997)
  and Hoffer et al. 2017, "Train longer, generalize better" (arXiv:1705.08741): square-root scaling
  (batch x k -> LR x sqrt(k)), which keeps the variance of the gradient step constant.
- You et al. 2017, "Large Batch Training of Convolutional Networks" (LARS, arXiv:1708.03888) and You et
  al. 2019, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes" (LAMB,
  arXiv:1904.00962): layer-wise adaptive rates that keep training stable at 32k and beyond.
- Wu & He 2018, "Group Normalization" (arXiv:1803.08494), Fig. 1: BatchNorm's error rises as the
  per-GPU batch drops below 16 (ResNet-50, ImageNet).
"""
from __future__ import annotations

import math
from dataclasses import InitVar, asdict, dataclass, field

from sdp_jupyter import instances
from sdp_jupyter.launch import targets
from sdp_jupyter.backends import BACKENDS

RULES = ("none", "linear", "sqrt")
MODES = ("keep_per_gpu", "keep_global")
OPTIMIZERS = ("sgd", "adam", "adamw", "lars", "lamb")
#: optimizers with layer-wise adaptive rates (You et al.), which tolerate very large global batches
LAYERWISE_OPTIMIZERS = ("lars", "lamb")
#: every target the launcher knows (launch/targets/__init__.py); only SageMaker's nodes are catalogue types
TARGETS = tuple(targets.TARGETS)

#: per-GPU batch below which BatchNorm statistics degrade (Wu & He 2018, Fig. 1)
BN_MIN_PER_GPU_BATCH = 16
#: global batch up to which linear scaling + warm-up matched small-batch accuracy (Goyal et al. 2017)
LINEAR_SCALING_MAX_GLOBAL_BATCH = 8192
#: fewer optimizer steps per epoch than this: per-epoch schedules, warm-up and evaluation get coarse
MIN_ITERATIONS_PER_EPOCH = 5
#: warm-up length Goyal et al. 2017 used (epochs), and the most of a run a suggested warm-up may take
GOYAL_WARMUP_EPOCHS = 5.0
MAX_WARMUP_FRACTION = 0.25
#: scaling efficiency assumed when none is entered: Goyal et al. 2017 report ~90% from 8 to 256 GPUs
DEFAULT_SCALING_EFFICIENCY = 0.9
DEFAULT_SCALING_EFFICIENCY_SOURCE = "Goyal et al. 2017: ~90% scaling efficiency from 8 to 256 GPUs (ResNet-50)"

ERROR = "error"  # blocks a launch
WARNING = "warning"


# --- the rules -----------------------------------------------------------------------------------


def global_batch(nodes: int, procs_per_node: int, per_gpu_batch: int) -> int:
    """Samples per optimizer step across all workers: nodes x GPUs per node x per-GPU batch."""
    return nodes * procs_per_node * per_gpu_batch


def iterations_per_epoch(dataset_size: int, global_batch_size: int, drop_last: bool = True) -> int:
    """Optimizer steps per epoch; with ``drop_last`` (DistributedSampler's usual setting) the partial
    last batch is dropped, so a global batch larger than the dataset gives 0."""
    if global_batch_size < 1:
        raise ValueError(f"global batch must be >= 1, got {global_batch_size}")
    if drop_last:
        return dataset_size // global_batch_size
    return -(-dataset_size // global_batch_size)


def scale_lr(reference_lr: float, reference_batch: int, global_batch_size: int, rule: str) -> float:
    """Learning rate for ``global_batch_size`` given one tuned at ``reference_batch``.

    ``none``: unchanged. ``linear`` (Goyal et al. 2017): x k where k = global / reference.
    ``sqrt`` (Krizhevsky 2014; Hoffer et al. 2017): x sqrt(k).
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}; got {rule!r}")
    k = global_batch_size / reference_batch
    if rule == "linear":
        return reference_lr * k
    if rule == "sqrt":
        return reference_lr * math.sqrt(k)
    return reference_lr


@dataclass(frozen=True)
class Warmup:
    """Linear warm-up from ``start_lr`` to ``target_lr`` over ``steps`` optimizer steps."""

    epochs: float
    steps: int
    start_lr: float
    target_lr: float
    reason: str


def suggest_warmup(
    reference_lr: float,
    target_lr: float,
    epochs: int,
    iterations: int,
) -> Warmup:
    """Goyal et al. 2017's gradual warm-up: when the scaled LR is above the reference LR, ramp linearly
    from the reference LR to the scaled LR over 5 epochs, but over no more than a quarter of the run.
    No warm-up when the LR was not raised."""
    if target_lr <= reference_lr:
        return Warmup(0.0, 0, target_lr, target_lr, "LR not raised above the reference: no warm-up needed")
    warm = min(GOYAL_WARMUP_EPOCHS, epochs * MAX_WARMUP_FRACTION)
    return Warmup(
        warm,
        math.ceil(warm * iterations),
        reference_lr,
        target_lr,
        f"LR raised x{target_lr / reference_lr:.3g}: ramp over min({GOYAL_WARMUP_EPOCHS:g} epochs "
        f"(Goyal et al. 2017), {MAX_WARMUP_FRACTION:g} of {epochs} epochs)",
    )


def warmup_lr(step: int, warmup_steps: int, start_lr: float, target_lr: float) -> float:
    """LR at optimizer step ``step`` (0-based) of a linear warm-up; ``target_lr`` once it is over.

    A training script reads ``warmup_steps``, ``warmup_start_lr`` and ``lr`` from its hyperparameters
    and sets ``group["lr"] = warmup_lr(step, ...)`` before each ``optimizer.step()``."""
    if warmup_steps <= 0 or step >= warmup_steps:
        return target_lr
    return start_lr + (target_lr - start_lr) * (step + 1) / warmup_steps


def per_gpu_batch_for_global(global_batch_size: int, world_size: int) -> int:
    """Per-GPU batch that keeps the global batch at ``global_batch_size`` (rounded down; may be 0)."""
    return global_batch_size // world_size


# --- estimates -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """Time and cost from a per-GPU throughput, with the assumptions that produced them."""

    samples_per_second: float  #: whole job
    epoch_seconds: float
    run_seconds: float
    efficiency: float  #: applied (1.0 on one GPU)
    price_per_hour: float | None  #: per node
    cost_per_epoch: float | None
    cost_per_run: float | None
    assumptions: str


def estimate(
    samples_per_epoch: int,
    epochs: int,
    nodes: int,
    world_size: int,
    throughput_per_gpu: float,
    efficiency: float = DEFAULT_SCALING_EFFICIENCY,
    price_per_hour: float | None = None,
) -> Estimate:
    """Time per epoch = samples / (throughput per GPU x world size x efficiency); cost = hours x nodes x
    price per node-hour. The efficiency is an assumption about communication overhead and applies to
    any run on more than one GPU; ``price_per_hour=None`` leaves the cost unknown."""
    if throughput_per_gpu <= 0:
        raise ValueError(f"throughput per GPU must be > 0 samples/s, got {throughput_per_gpu}")
    if not 0 < efficiency <= 1:
        raise ValueError(f"scaling efficiency must be in (0, 1], got {efficiency}")
    applied = efficiency if world_size > 1 else 1.0
    rate = throughput_per_gpu * world_size * applied
    epoch_s = samples_per_epoch / rate
    run_s = epoch_s * epochs
    cost_epoch = cost_run = None
    if price_per_hour is not None:
        cost_epoch = epoch_s / 3600 * nodes * price_per_hour
        cost_run = cost_epoch * epochs
    assumptions = (
        f"{throughput_per_gpu:g} samples/s per GPU x {world_size} GPUs x {applied:g} scaling efficiency"
        + (f"; ${price_per_hour:g} per node-hour x {nodes} nodes" if price_per_hour is not None else "")
    )
    return Estimate(rate, epoch_s, run_s, applied, price_per_hour, cost_epoch, cost_run, assumptions)


def measured_efficiency(rate_one_rank: float, rate_per_rank_at_n: float) -> float:
    """Scaling efficiency from two measurements of the same training code: samples/s of one rank alone,
    and samples/s per rank when N ranks train together (T_N = N x T_1 x efficiency)."""
    if rate_one_rank <= 0:
        raise ValueError(f"one-rank throughput must be > 0 samples/s, got {rate_one_rank}")
    return rate_per_rank_at_n / rate_one_rank


# --- a whole plan --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ScalingWarning:
    """A finding about a plan: the number that triggered it, the threshold, and what to do."""

    code: str
    level: str  #: ERROR (blocks launch) or WARNING
    message: str
    advice: str
    value: float | int | str | None = None
    threshold: float | int | str | None = None

    def __str__(self) -> str:
        return f"{self.message} {self.advice}"


@dataclass(frozen=True)
class Plan:
    """What a user chooses. ``procs_per_node`` counts worker processes per node (``--procs-per-node``
    everywhere; ``gpus_per_node`` is its old name, still accepted with a warning); on SageMaker it is the
    instance type's GPU count and a different value is ignored."""

    target: str = targets.DEFAULT_TARGET
    instance_type: str = "local"
    nodes: int = 1
    procs_per_node: int = 1
    backend: str = "smddp"
    mode: str = "keep_per_gpu"
    per_gpu_batch: int = 32  #: used by keep_per_gpu
    reference_lr: float = 0.1
    reference_batch: int = 256  #: also the global batch kept by keep_global
    rule: str = "linear"
    warmup_epochs: float | None = None  #: None: suggest_warmup's
    epochs: int = 10
    dataset_size: int = 50_000
    optimizer: str = "sgd"
    batchnorm: bool = False
    drop_last: bool = True
    throughput_per_gpu: float | None = None  #: samples/s on one GPU; None: no time estimate
    scaling_efficiency: float = DEFAULT_SCALING_EFFICIENCY
    price_per_hour: float | None = None  #: per node-hour; None: the catalogue's (often unknown)
    cpus: int | None = None  #: cores for local workers; None: instances.usable_cpus()
    engine: str = "auto"  #: SageMaker's --engine: who provides smddp (instances.ENGINES)
    gpus_per_node: InitVar[int | None] = None  #: procs_per_node's old name (warns)

    def __post_init__(self, gpus_per_node: int | None = None):
        if gpus_per_node is not None:
            from sdp_jupyter._renamed import renamed

            object.__setattr__(self, "procs_per_node", renamed({"gpus_per_node": gpus_per_node}, "Plan")["procs_per_node"])
        for name, value, allowed in (
            ("target", self.target, TARGETS),
            ("backend", self.backend, BACKENDS),
            ("mode", self.mode, MODES),
            ("rule", self.rule, RULES),
            ("optimizer", self.optimizer, OPTIMIZERS),
            ("engine", self.engine, instances.ENGINES),
        ):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")


@dataclass(frozen=True)
class Outcome:
    """What a plan does. Numbers are None when an input error prevents computing them."""

    plan: Plan
    instance: instances.Instance
    world_size: int | None = None
    per_gpu_batch: int | None = None
    global_batch: int | None = None
    iterations_per_epoch: int | None = None
    lr: float | None = None
    warmup: Warmup | None = None
    estimate: Estimate | None = None
    warnings: tuple[ScalingWarning, ...] = field(default_factory=tuple)

    @property
    def errors(self) -> list[ScalingWarning]:
        return [w for w in self.warnings if w.level == ERROR]

    @property
    def ok(self) -> bool:
        """False when a finding blocks a launch."""
        return not self.errors

    def hyperparameters(self) -> dict:
        """What the training script receives (as ``--key value`` and in SM_HPS), as SageMaker passes
        hyperparameters. Empty when the plan has errors that leave numbers undefined."""
        if self.global_batch is None:
            return {}
        p = self.plan
        hps = {
            "epochs": p.epochs,
            "batch_size": self.per_gpu_batch,
            "global_batch_size": self.global_batch,
            "lr": _round(self.lr),
            "reference_lr": p.reference_lr,
            "reference_batch_size": p.reference_batch,
            "lr_scaling": p.rule,
            "warmup_epochs": _round(self.warmup.epochs),
            "warmup_steps": self.warmup.steps,
            "warmup_start_lr": _round(self.warmup.start_lr),
            "optimizer": p.optimizer,
            "dataset_size": p.dataset_size,
        }
        return hps


def _round(x: float) -> float:
    """Drop float noise (0.1 * 3 -> 0.3) so hyperparameters print as people typed them."""
    return float(f"{x:.10g}")


def _input_errors(plan: Plan) -> list[ScalingWarning]:
    checks = [
        ("nodes", plan.nodes, 1),
        ("procs_per_node", plan.procs_per_node, 1),
        ("per_gpu_batch", plan.per_gpu_batch, 1),
        ("reference_batch", plan.reference_batch, 1),
        ("epochs", plan.epochs, 1),
        ("dataset_size", plan.dataset_size, 1),
    ]
    out = [
        ScalingWarning(f"invalid_{name}", ERROR, f"{name} is {value}.", f"Enter at least {least}.", value, least)
        for name, value, least in checks
        if value < least
    ]
    if not plan.reference_lr > 0:
        out.append(ScalingWarning("invalid_reference_lr", ERROR, f"reference LR is {plan.reference_lr}.",
                                  "Enter a learning rate above 0.", plan.reference_lr, 0))
    if plan.warmup_epochs is not None and plan.warmup_epochs < 0:
        out.append(ScalingWarning("invalid_warmup_epochs", ERROR, f"warm-up is {plan.warmup_epochs} epochs.",
                                  "Enter 0 or more, or leave it to the suggestion.", plan.warmup_epochs, 0))
    if not 0 < plan.scaling_efficiency <= 1:
        out.append(ScalingWarning("invalid_scaling_efficiency", ERROR,
                                  f"scaling efficiency is {plan.scaling_efficiency}.",
                                  "Enter a fraction in (0, 1], e.g. 0.9.", plan.scaling_efficiency, "(0, 1]"))
    if plan.throughput_per_gpu is not None and plan.throughput_per_gpu <= 0:
        out.append(ScalingWarning("invalid_throughput", ERROR, f"throughput is {plan.throughput_per_gpu} samples/s.",
                                  "Enter a measured per-GPU throughput above 0, or leave it empty.",
                                  plan.throughput_per_gpu, 0))
    if plan.price_per_hour is not None and plan.price_per_hour < 0:
        out.append(ScalingWarning("invalid_price", ERROR, f"price is {plan.price_per_hour} USD per node-hour.",
                                  "Enter 0 or more, or leave it empty.", plan.price_per_hour, 0))
    return out


def _catalogue(target: str) -> bool:
    """Whether `target`'s nodes are catalogue instance types (SageMaker's); False for an unknown one,
    which the plan's checks name."""
    record = targets.TARGETS.get(target)
    return bool(record and record.catalogue)


def evaluate(plan: Plan) -> Outcome:
    """Everything the setup form shows for ``plan``: batch sizes, LR, warm-up, estimate, warnings."""
    if not _catalogue(plan.target):  # this machine, your own hosts: no catalogue entry to price
        inst = instances.get(instances.LOCAL)
    else:
        inst = instances.get(plan.instance_type)  # KeyError names the known types
        if inst.is_local:
            raise ValueError(f"target {plan.target!r} needs an instance type of the catalogue, not {inst.name!r}")
    errors = _input_errors(plan)
    if errors:
        return Outcome(plan, inst, warnings=tuple(errors))

    gpn = inst.gpus if _catalogue(plan.target) else plan.procs_per_node
    world = plan.nodes * gpn
    found: list[ScalingWarning] = []

    if plan.mode == "keep_global":
        per_gpu = per_gpu_batch_for_global(plan.reference_batch, world)
        if per_gpu < 1:
            found.append(ScalingWarning(
                "global_below_world", ERROR,
                f"keeping the global batch at {plan.reference_batch} leaves 0 samples per GPU on {world} GPUs.",
                f"Use at most {plan.reference_batch} GPUs, or switch to 'keep per-GPU batch'.",
                world, plan.reference_batch))
            return Outcome(plan, inst, world_size=world, per_gpu_batch=0, warnings=tuple(found))
        if per_gpu * world != plan.reference_batch:
            found.append(ScalingWarning(
                "global_rounded", WARNING,
                f"the global batch is {per_gpu * world}, not {plan.reference_batch}: {plan.reference_batch} "
                f"is not a multiple of {world} GPUs.",
                f"Pick a GPU count that divides {plan.reference_batch}, or accept the LR rescaled to "
                f"{per_gpu * world}.", per_gpu * world, plan.reference_batch))
    else:
        per_gpu = plan.per_gpu_batch
    gb = global_batch(plan.nodes, gpn, per_gpu)
    iters = iterations_per_epoch(plan.dataset_size, gb, plan.drop_last)
    lr = scale_lr(plan.reference_lr, plan.reference_batch, gb, plan.rule)
    if plan.warmup_epochs is None:
        warm = suggest_warmup(plan.reference_lr, lr, plan.epochs, iters)
    else:
        warm = Warmup(plan.warmup_epochs, math.ceil(plan.warmup_epochs * iters),
                      min(plan.reference_lr, lr), lr, "entered")

    found += _findings(plan, inst, world, per_gpu, gb, iters)

    est = None
    if plan.throughput_per_gpu is not None and iters > 0:
        price = plan.price_per_hour if plan.price_per_hour is not None else inst.price_per_hour_usd
        est = estimate(iters * gb, plan.epochs, plan.nodes, world, plan.throughput_per_gpu,
                       plan.scaling_efficiency, price)
    return Outcome(plan, inst, world, per_gpu, gb, iters, lr, warm, est, tuple(found))


def _findings(plan: Plan, inst: instances.Instance, world: int, per_gpu: int, gb: int, iters: int):
    """The warnings that depend on computed numbers; each says what triggered it and what to do."""
    out = []
    if plan.batchnorm and per_gpu < BN_MIN_PER_GPU_BATCH:
        out.append(ScalingWarning(
            "batchnorm_small_batch", WARNING,
            f"per-GPU batch {per_gpu} is below {BN_MIN_PER_GPU_BATCH} with BatchNorm: each GPU normalizes "
            f"over {per_gpu} samples, and accuracy drops (Wu & He 2018).",
            "Convert to SyncBatchNorm (torch.nn.SyncBatchNorm.convert_sync_batchnorm) or GroupNorm, or "
            f"keep the per-GPU batch at {BN_MIN_PER_GPU_BATCH}+ ('keep per-GPU batch') and scale the LR.",
            per_gpu, BN_MIN_PER_GPU_BATCH))
    if plan.rule == "linear" and gb > LINEAR_SCALING_MAX_GLOBAL_BATCH and plan.optimizer not in LAYERWISE_OPTIMIZERS:
        out.append(ScalingWarning(
            "linear_scaling_limit", WARNING,
            f"global batch {gb} is beyond {LINEAR_SCALING_MAX_GLOBAL_BATCH}, where linear LR scaling with "
            f"{plan.optimizer} stops matching small-batch accuracy (Goyal et al. 2017).",
            "Use LARS or LAMB (You et al. 2017/2019), the sqrt rule, or a smaller global batch.",
            gb, LINEAR_SCALING_MAX_GLOBAL_BATCH))
    if gb > plan.dataset_size:
        out.append(ScalingWarning(
            "batch_exceeds_dataset", ERROR,
            f"global batch {gb} is larger than the dataset ({plan.dataset_size} samples): "
            f"{iters} full steps per epoch.",
            f"Use fewer GPUs or a per-GPU batch of at most {plan.dataset_size // world}.",
            gb, plan.dataset_size))
    elif iters < MIN_ITERATIONS_PER_EPOCH:
        out.append(ScalingWarning(
            "few_iterations", WARNING,
            f"only {iters} steps per epoch (fewer than {MIN_ITERATIONS_PER_EPOCH}): warm-up and per-epoch "
            "schedules become coarse and most of the data is seen in very few updates.",
            f"Lower the global batch to at most {plan.dataset_size // MIN_ITERATIONS_PER_EPOCH}, or use "
            "a larger dataset.", iters, MIN_ITERATIONS_PER_EPOCH))
    if plan.backend == "smddp" and plan.nodes == 1:
        out.append(ScalingWarning(
            "smddp_single_node", WARNING,
            "smddp on 1 node: the library speeds up AllReduce across hosts; within one node it brings "
            "nothing over NCCL (GPUs) or gloo (CPU).",
            "Use 2+ nodes to benefit, or backend 'nccl'/'gloo' for a single node.", plan.nodes, 2))
    sagemaker_smddp = _catalogue(plan.target) and plan.backend == "smddp"  # the catalogue's types: SageMaker's
    engine = plan.engine if plan.engine != instances.ENGINE_AUTO else inst.smddp_engine
    if sagemaker_smddp and engine == instances.ENGINE_AWS and not inst.smddp_allows():
        allowed = [n for n, i in instances.catalogue().items() if i.smddp_allows()]
        out.append(ScalingWarning(
            "smddp_unsupported_instance", ERROR,
            f"SageMaker's smddp does not support {inst.name} (support: {inst.smddp}).",
            f"Pick one of {', '.join(allowed)}, engine 'sdp' (ours, on any type) or backend 'nccl'.",
            inst.name, ", ".join(allowed)))
    if sagemaker_smddp and engine == instances.ENGINE_SDP:
        out.append(ScalingWarning(
            "smddp_engine_ours", WARNING,
            f"smddp on {inst.name} is served by sdp_jupyter's engine"
            + (" (SageMaker's smddp library does not run on this type)" if not inst.smddp_allows() else "")
            + ": the job ships sdp_jupyter's sources and builds the engine in each container at start "
            "(about a minute; the image needs a C++ compiler).",
            "The AWS PyTorch training images have one; for SageMaker's own library pick "
            "ml.p4d.24xlarge / ml.p4de.24xlarge with engine 'auto' or 'aws'.", inst.name, engine))
    if sagemaker_smddp and engine == instances.ENGINE_AWS and inst.smddp == instances.SMDDP_ALLREDUCE_ONLY:
        out.append(ScalingWarning(
            "smddp_allreduce_only", WARNING,
            f"SageMaker's smddp supports only AllReduce on {inst.name} and is no longer developed for it.",
            "Fine for data parallelism; for AllGather-based sharding or new releases use ml.p4d.24xlarge "
            "or ml.p4de.24xlarge.", inst.name, instances.SMDDP_SUPPORTED))
    if targets.TARGETS[plan.target].this_machine:
        cpus = plan.cpus if plan.cpus is not None else inst.cpus
        if cpus is not None and world > cpus:
            out.append(ScalingWarning(
                "oversubscribed", WARNING,
                f"{world} local worker processes on {cpus} CPU cores: they time-share the cores, so "
                "steps slow down and timings mean little.",
                f"Use at most {cpus} processes in total (nodes x processes per node).", world, cpus))
    return out


def as_dict(outcome: Outcome) -> dict:
    """A JSON-ready view of an outcome (for logs and tests)."""
    d = asdict(outcome)
    d["instance"] = outcome.instance.name
    d["ok"] = outcome.ok
    return d
