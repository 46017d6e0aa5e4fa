"""Hybrid parallelism for a training script, from torch's own pieces.

A job started with ``SDP_TP``/``SDP_PP``/... in its environment (see docs/model_parallel.md) calls::

    from sdp_jupyter import parallel
    hp = parallel.setup()                      # process group + DeviceMesh (pp, dp, tp) from the env
    model = parallel.gpt.GPT(cfg)              # or any model with the same layout (see below)
    stage = hp.parallelize(model)              # tp, checkpointing, offload, sharding, pipeline split
    opt = hp.optimizer(stage.parameters(), torch.optim.AdamW, lr=1e-3)
    loss = hp.step(stage, inputs, targets, lm_loss)   # forward + backward (pipelined when pp > 1)
    hp.finish_gradients(stage); opt.step(); opt.zero_grad()

The pieces, each usable alone:

* tensor parallelism: ``torch.distributed.tensor.parallel`` (ColwiseParallel for wq/wk/wv and fc,
  RowwiseParallel for wo and proj, SequenceParallel for the layer norms when sequence parallelism is
  on) over the ``tp`` mesh dimension, which holds consecutive ranks (one node);
* pipeline parallelism: ``torch.distributed.pipelining`` (PipelineStage, ScheduleGPipe,
  Schedule1F1B, ScheduleInterleaved1F1B with ``virtual_stages`` chunks per rank) over ``pp``, the
  outermost dimension (across nodes);
* sharding over ``dp``: ``"optimizer"`` with ``ZeroRedundancyOptimizer`` (ZeRO-1, SageMaker's
  shard_optimizer_state), ``"gradients"``/``"full"`` with FSDP2 ``fully_shard``
  (reshard_after_forward False / True);
* activation checkpointing: ``checkpoint_wrapper`` per block (``"layer"``), or per block with
  torch's selective checkpoint policy that keeps matmul outputs (``"selective"``);
* activation offloading: ``offload_saved_tensors`` (a saved-tensor hook that also handles DTensors,
  which ``torch.autograd.graph.save_on_cpu`` cannot: it keeps a DTensor's local shard on the CPU and
  rebuilds the DTensor on unpack);
* plain data parallelism over ``dp`` (no sharding): ``finish_gradients`` averages gradients over the
  dp group of the default backend (our ``smddp`` engine when the job initialised with it).

The model layout these helpers expect (``sdp_jupyter.parallel.gpt.GPT`` has it): blocks in
``model.layers`` (a ModuleDict keyed by global index), optional ``tok_emb``/``pos_emb`` before them
and ``ln_f``/``head`` after them, a ``forward`` that skips the parts that are ``None``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from sdp_jupyter.advisor import ParallelConfig

__all__ = ["ParallelConfig", "Hybrid", "setup", "apply_tensor_parallel", "apply_checkpointing",
           "offload_saved_tensors", "OffloadStats", "split_for_pipeline", "stage_layers",
           "average_gradients", "build_mesh"]


def build_mesh(config: ParallelConfig, world_size: int, device_type: str = "cpu", dp_backend: str | None = None):
    """A DeviceMesh ``(pp, dp, tp)``: tp innermost (consecutive ranks share a node), pp outermost.
    ``dp_backend`` puts the dp dimension's groups on another backend than the default group's
    (``"smddp"``: FSDP2's and ZeRO's all-gathers and reduce-scatters on our engine)."""
    from torch.distributed.device_mesh import init_device_mesh

    tp, pp = config.tp, config.pp
    if world_size % (tp * pp):
        raise ValueError(f"world size {world_size} is not divisible by tp*pp = {tp * pp}")
    override = {"dp": dp_backend} if dp_backend else None
    return init_device_mesh(device_type, (pp, world_size // (tp * pp), tp),
                            mesh_dim_names=("pp", "dp", "tp"), backend_override=override)


# ------------------------------------------------------------------------------ tensor parallelism


def tp_plan_for_block(sequence_parallel: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)

    if not sequence_parallel:
        return {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(),
                "attn.wv": ColwiseParallel(), "attn.wo": RowwiseParallel(),
                "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()}
    gather = partial(PrepareModuleInput, input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"ln_1": SequenceParallel(), "attn": gather(),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ln_2": SequenceParallel(), "mlp": gather(),
            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(output_layouts=Shard(1))}


class _ScatterSequence(nn.Module):
    """Replicated (B, T, h) -> this tp rank's (B, T/tp, h); backward all-gathers (DTensor's
    Replicate -> Shard(1) redistribution), so embedding gradients stay correct."""

    def __init__(self, tp_mesh):
        super().__init__()
        self.tp_mesh = tp_mesh

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        d = DTensor.from_local(x, self.tp_mesh, [Replicate()], run_check=False)
        return d.redistribute(self.tp_mesh, [Shard(1)]).to_local()


def apply_tensor_parallel(model: nn.Module, tp_mesh, sequence_parallel: bool = False) -> nn.Module:
    """Megatron-style tensor parallelism with torch.distributed.tensor.parallel: a vocabulary-parallel
    token embedding (rows sharded, output all-reduced), column/row-parallel attention and MLP, a
    column-parallel head whose logits stay sharded over the vocabulary (compute the loss inside
    ``Hybrid.loss_context()``, torch's ``loss_parallel``). Position embeddings are replicated.
    With sequence parallelism the activations between blocks are (B, T/tp, h) sequence shards."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    if tp_mesh.size() == 1:
        return model
    if getattr(model, "tok_emb", None) is not None:
        parallelize_module(model, tp_mesh, {"tok_emb": RowwiseParallel(input_layouts=Replicate(),
                                                                       output_layouts=Replicate())})
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, tp_plan_for_block(sequence_parallel))
    if getattr(model, "head", None) is not None:
        in_layout = Shard(1) if sequence_parallel else Replicate()
        # logits stay sharded over the vocabulary (a DTensor): the loss runs under loss_parallel()
        plan = {"head": ColwiseParallel(input_layouts=in_layout, output_layouts=Shard(-1),
                                        use_local_output=False)}
        if sequence_parallel:
            plan["ln_f"] = SequenceParallel()
        parallelize_module(model, tp_mesh, plan)
    if sequence_parallel and getattr(model, "tok_emb", None) is not None:
        first = next(iter(model.layers.values()), None)
        if first is not None:
            first.register_forward_pre_hook(_scatter_hook(_ScatterSequence(tp_mesh)))
        else:  # a stage with embeddings and no blocks
            model.ln_f.register_forward_pre_hook(_scatter_hook(_ScatterSequence(tp_mesh)))
    return model


def _scatter_hook(scatter):
    def hook(module, args):
        return (scatter(args[0]),) + tuple(args[1:])

    return hook


# ------------------------------------------------------------------------------ checkpointing


def _keep_matmuls(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    keep = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
            torch.ops.aten._scaled_dot_product_flash_attention.default,
            torch.ops.aten._scaled_dot_product_efficient_attention.default}
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


def apply_checkpointing(model: nn.Module, mode: str = "layer") -> nn.Module:
    """Wrap every block with ``checkpoint_wrapper``: ``"layer"`` keeps only block inputs,
    ``"selective"`` also keeps matmul/attention outputs and recomputes the cheap ops."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             checkpoint_wrapper)

    if mode == "none":
        return model
    if mode not in ("layer", "selective"):
        raise ValueError(f"checkpointing={mode!r}: allowed none, selective, layer")
    for name, block in list(model.layers.items()):
        if mode == "layer":
            wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
        else:
            from torch.utils.checkpoint import create_selective_checkpoint_contexts

            wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                         context_fn=partial(create_selective_checkpoint_contexts,
                                                            _keep_matmuls))
        model.layers[name] = wrapped
    return model


# ------------------------------------------------------------------------------ offloading


@dataclass
class OffloadStats:
    tensors: int = 0
    dtensors: int = 0
    bytes: int = 0  # bytes copied to the CPU (local shards for DTensors)
    restored: int = 0


@dataclass
class _Packed:
    local: torch.Tensor  # on the CPU
    device: torch.device
    spec: tuple | None  # (mesh, placements, shape, stride) for a DTensor


def offload_saved_tensors(stats: OffloadStats | None = None, pin_memory: bool | None = None,
                          min_bytes: int = 0):
    """A ``saved_tensors_hooks`` context that keeps activations saved for backward on the CPU.

    Unlike ``torch.autograd.graph.save_on_cpu`` it accepts DTensors (tensor/sequence parallel
    activations): only the local shard travels, and the DTensor is rebuilt from it with its mesh and
    placements on unpack. Parameters (leaves that require grad) are never copied: they stay on the
    device anyway. ``stats`` counts what was offloaded."""
    from torch.distributed.tensor import DTensor

    stats = stats if stats is not None else OffloadStats()
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory

    def pack(t):
        if isinstance(t, nn.Parameter) or (t.is_leaf and t.requires_grad):
            return t
        is_d = isinstance(t, DTensor)
        local = t.to_local() if is_d else t
        if local.numel() * local.element_size() < min_bytes:
            return t
        cpu = torch.empty(local.size(), dtype=local.dtype, layout=local.layout,
                          pin_memory=pin and local.device.type == "cuda")
        cpu.copy_(local, non_blocking=local.device.type == "cuda")
        stats.tensors += 1
        stats.dtensors += int(is_d)
        stats.bytes += local.numel() * local.element_size()
        spec = (t.device_mesh, t.placements, t.shape, t.stride()) if is_d else None
        return _Packed(cpu, local.device, spec)

    def unpack(p):
        if not isinstance(p, _Packed):
            return p
        stats.restored += 1
        local = p.local.to(p.device, non_blocking=True)
        if p.spec is None:
            return local
        mesh, placements, shape, stride = p.spec
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


class _Offloaded(nn.Module):
    """Runs ``inner`` with saved activations offloaded (the stage module a pipeline sees)."""

    def __init__(self, inner: nn.Module, stats: OffloadStats):
        super().__init__()
        self.inner = inner
        self.stats = stats

    def forward(self, *args, **kwargs):
        with offload_saved_tensors(self.stats):
            return self.inner(*args, **kwargs)


# ------------------------------------------------------------------------------ pipeline


def stage_layers(n_layers: int, n_stages: int, stage: int) -> list[int]:
    """Global indices of the blocks of ``stage`` (balanced; the first stages take the remainder)."""
    base, extra = divmod(n_layers, n_stages)
    start = stage * base + min(stage, extra)
    return list(range(start, start + base + (1 if stage < extra else 0)))


def split_for_pipeline(model: nn.Module, n_stages: int, stage: int) -> nn.Module:
    """Keep the blocks of ``stage``; drop the embeddings except on the first stage and the final
    norm and head except on the last (set to None). Modifies and returns ``model``."""
    keep = {str(i) for i in stage_layers(len(model.layers), n_stages, stage)}
    for name in list(model.layers.keys()):
        if name not in keep:
            del model.layers[name]
    if stage != 0:
        model.tok_emb = None
        if hasattr(model, "pos_emb"):
            model.pos_emb = None
    if stage != n_stages - 1:
        model.ln_f = None
        model.head = None
    return model


# ------------------------------------------------------------------------------ data parallel


def average_gradients(params: Iterable[torch.Tensor], group, world: int) -> None:
    """All-reduce (sum) and divide every gradient over ``group``; DTensor gradients reduce their
    local shards (the dp group only ever holds replicas of the same shard)."""
    from torch.distributed.tensor import DTensor

    if world == 1:
        return
    locals_ = []
    for p in params:
        if p.grad is None:
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        locals_.append(g)
    if not locals_:
        return
    flat = torch.cat([g.reshape(-1) for g in locals_])  # one collective, like a fusion buffer
    dist.all_reduce(flat, group=group)
    flat /= world
    off = 0
    for g in locals_:
        n = g.numel()
        g.copy_(flat[off:off + n].view_as(g))
        off += n


# ------------------------------------------------------------------------------ the job's view


@dataclass
class Hybrid:
    """What a rank of a hybrid-parallel job needs: the config, the mesh and the helpers bound to it."""

    config: ParallelConfig
    mesh: object  # DeviceMesh (pp, dp, tp)
    device: torch.device
    offload_stats: OffloadStats = field(default_factory=OffloadStats)
    #: the group plain data parallelism averages gradients over: the mesh's dp group, or one of the
    #: same ranks on our smddp engine when the job asked for it
    dp_group: object = None
    _stages: list = field(default_factory=list)

    @property
    def tp(self) -> int:
        return self.mesh["tp"].size()

    @property
    def pp(self) -> int:
        return self.mesh["pp"].size()

    @property
    def dp(self) -> int:
        return self.mesh["dp"].size()

    @property
    def tp_rank(self) -> int:
        return self.mesh["tp"].get_local_rank()

    @property
    def pp_rank(self) -> int:
        return self.mesh["pp"].get_local_rank()

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp"].get_local_rank()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def describe(self) -> str:
        return (f"rank {dist.get_rank()}: pp {self.pp_rank}/{self.pp}, dp {self.dp_rank}/{self.dp}, "
                f"tp {self.tp_rank}/{self.tp} ({self.config.describe()})")

    # -- building the stage
    @property
    def virtual_stages(self) -> int:
        c = self.config
        return c.virtual_stages if (c.schedule == "interleaved" and self.pp > 1) else 1

    def parallelize(self, model: nn.Module) -> nn.Module:
        """Split for the pipeline, then tensor parallelism, checkpointing, sharding, offloading
        (torchtitan's order). Returns this rank's stage module; with the interleaved schedule an
        ``nn.ModuleList`` of its ``virtual_stages`` chunks (stages r, r + pp, r + 2 pp, ...)."""
        v = self.virtual_stages
        if v == 1:
            part = split_for_pipeline(model, self.pp, self.pp_rank) if self.pp > 1 else model
            return self._prepare(part)
        import copy

        copies = [copy.deepcopy(model) for _ in range(v - 1)] + [model]
        return nn.ModuleList(self._prepare(split_for_pipeline(m, self.pp * v, self.pp_rank + k * self.pp))
                             for k, m in enumerate(copies))

    def _prepare(self, model: nn.Module) -> nn.Module:
        c = self.config
        if any(p.device != self.device for p in model.parameters()):
            model.to(self.device)
        apply_tensor_parallel(model, self.mesh["tp"], c.sequence_parallel and self.tp > 1)
        apply_checkpointing(model, c.checkpointing)
        if c.sharding in ("gradients", "full"):
            from torch.distributed.fsdp import fully_shard

            dp_mesh = self.mesh["dp"]
            reshard = c.sharding == "full"
            for block in model.layers.values():
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
            fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard)
        if c.offload_activations:
            model = _Offloaded(model, self.offload_stats)
        return model

    def optimizer(self, params, cls=torch.optim.AdamW, **kwargs):
        """``cls(params, **kwargs)``, or ZeroRedundancyOptimizer over dp for sharding="optimizer"."""
        params = list(params)
        if self.config.sharding == "optimizer" and self.dp > 1:
            from torch.distributed.optim import ZeroRedundancyOptimizer

            return ZeroRedundancyOptimizer(params, optimizer_class=cls,
                                           process_group=self.mesh["dp"].get_group(), **kwargs)
        return cls(params, **kwargs)

    # -- running a step
    def loss_context(self):
        """Where the loss and its backward must run: ``loss_parallel()`` when the logits are
        vocabulary-sharded DTensors (tp > 1), else nothing."""
        from contextlib import nullcontext

        if self.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()

    def _schedule(self, stage_module: nn.Module, loss_fn):
        from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                  ScheduleInterleaved1F1B)

        c, group, v = self.config, self.mesh["pp"].get_group(), self.virtual_stages
        if v > 1:
            stages = [PipelineStage(chunk, self.pp_rank + k * self.pp, self.pp * v, self.device, group=group)
                      for k, chunk in enumerate(stage_module)]
            return ScheduleInterleaved1F1B(stages, n_microbatches=c.microbatches, loss_fn=loss_fn)
        stage = PipelineStage(stage_module, self.pp_rank, self.pp, self.device, group=group)
        # torch's schedules have no active-microbatch cap; 1F1B holds at most pp per stage, so a
        # cap below the microbatch count selects it
        use_1f1b = c.schedule != "gpipe" or (c.active_microbatches is not None
                                            and c.active_microbatches < c.microbatches)
        cls = Schedule1F1B if use_1f1b else ScheduleGPipe
        return cls(stage, n_microbatches=c.microbatches, loss_fn=loss_fn)

    def step(self, stage_module: nn.Module, inputs, targets, loss_fn: Callable) -> torch.Tensor | None:
        """Forward and backward of one batch (``inputs``/``targets`` of the whole replica batch).
        Returns the mean loss on the last stage (None elsewhere when pp > 1)."""
        with self.loss_context():
            loss = self._step(stage_module, inputs, targets, loss_fn)
        # under loss_parallel the loss is a replicated DTensor: hand back a plain tensor
        return loss.full_tensor() if hasattr(loss, "full_tensor") else loss

    def _step(self, stage_module, inputs, targets, loss_fn):
        c = self.config
        if self.pp == 1:
            m = c.microbatches
            total = None
            for x, y in zip(inputs.chunk(m), targets.chunk(m)):
                loss = loss_fn(stage_module(x.to(self.device)), y.to(self.device)) / m
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
            return total
        key = id(stage_module)
        sched = next((s for k, s in self._stages if k == key), None)
        if sched is None:
            sched = self._schedule(stage_module, loss_fn)
            self._stages.append((key, sched))
        if self.is_first_stage:
            sched.step(inputs.to(self.device))
            return None
        if self.is_last_stage:
            losses: list = []
            sched.step(target=targets.to(self.device), losses=losses)
            return torch.stack([l.detach() for l in losses]).mean()
        sched.step()
        return None

    def finish_gradients(self, stage_module: nn.Module) -> None:
        """Average gradients over dp (FSDP2 already reduce-scattered them)."""
        if self.config.sharding in ("gradients", "full"):
            return
        group = self.dp_group if self.dp_group is not None else self.mesh["dp"].get_group()
        average_gradients(stage_module.parameters(), group, self.dp)


def _smddp_dp_group(mesh):
    """The dp groups of ``mesh`` again, on the smddp engine (every rank creates every group, in
    the same order, as ``new_group`` requires); this rank's, or None when the engine refuses."""
    import sdp_jupyter.torch  # noqa: F401  registers the "smddp" backend

    dp_ranks = mesh.mesh.permute(0, 2, 1).reshape(-1, mesh["dp"].size()).tolist()  # (pp, tp, dp)
    mine = None
    me = dist.get_rank()
    for ranks in dp_ranks:
        g = dist.new_group(ranks, backend="smddp")
        if me in ranks:
            mine = g
    return mine


def _check_layout(config: ParallelConfig) -> None:
    """Fail before building anything when the job's layout breaks a rule (tp across nodes, a world
    size tp*pp does not divide, offloading without its prerequisites): the advisor's message."""
    from sdp_jupyter.advisor import validate_layout

    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if dist.get_backend() == "fake" or local <= 0 or world % local:
        local, nodes = world, 1  # no node layout known: check only what needs none
    else:
        nodes = world // local
    errors = [f for f in validate_layout(config, local, nodes) if f.level == "error"]
    if errors:
        raise ValueError("hybrid-parallel layout rejected:\n" + "\n".join(str(e) for e in errors))


def setup(config: ParallelConfig | None = None, backend: str | None = None) -> Hybrid:
    """Initialise the default process group when the script has not and build the (pp, dp, tp)
    mesh from ``config`` or the environment.

    Backend: ``backend``, else ``SDP_BACKEND`` (the job's ``--backend``), else nccl with GPUs and
    gloo without. With ``smddp`` on CPU every dimension runs on the engine: tensor parallelism's
    all-reduces and all-gathers, the pipeline's sends and receives (the engine's mailbox), FSDP2's
    and ZeRO's all-gathers and reduce-scatters and the gradient average; no gloo group is made.
    With GPUs (or a default group the script already made on another backend) the mesh stays on
    that backend and only the data-parallel dimension goes to the engine."""
    config = config or ParallelConfig.from_env()
    cuda = torch.cuda.is_available()
    wanted = backend or os.environ.get("SDP_BACKEND") or ("nccl" if cuda else "gloo")
    if wanted == "smddp":
        import sdp_jupyter.torch  # noqa: F401  registers the "smddp" backend
    if not dist.is_initialized():
        dist.init_process_group("nccl" if wanted == "smddp" and cuda else wanted)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    _check_layout(config)
    world = dist.get_world_size()
    dp = world // (config.tp * config.pp) if world % (config.tp * config.pp) == 0 else 1
    whole_on_engine = dist.get_backend() == "smddp"
    sharded_on_smddp = (wanted == "smddp" and not whole_on_engine and dp > 1 and config.sharding != "none"
                        and not cuda)
    mesh = build_mesh(config, world, device.type, dp_backend="smddp" if sharded_on_smddp else None)
    hp = Hybrid(config, mesh, device)
    if whole_on_engine or sharded_on_smddp:
        hp.dp_group = mesh["dp"].get_group()  # the mesh's own dp group is on the engine
    elif wanted == "smddp" and hp.dp > 1 and config.sharding == "none":
        hp.dp_group = _smddp_dp_group(mesh)
    return hp

from sdp_jupyter.parallel import gpt  # noqa: E402,F401  (parallel.gpt without a second import)
