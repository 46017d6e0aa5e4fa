"""The job's view: the (pp, dp, tp) mesh, ``Hybrid`` (the helpers bound to it) and ``setup()``."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from sdp_jupyter.parallel_config import ParallelConfig
from sdp_jupyter.parallel.data import average_gradients
from sdp_jupyter.parallel.memory import Offloaded, OffloadStats, apply_checkpointing
from sdp_jupyter.parallel.pipeline import split_for_pipeline
from sdp_jupyter.parallel.tensor import apply_tensor_parallel
from sdp_jupyter.backends import job_backend


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
            model = Offloaded(model, self.offload_stats)
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
    wanted = backend or job_backend(None) or ("nccl" if cuda else "gloo")
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
