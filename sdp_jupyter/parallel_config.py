"""The hybrid-parallel configuration and its environment contract: the knobs (tensor, pipeline and
data parallelism, sharding, checkpointing, ...), the choices each allows, and the worker variables
that carry them (SDP_TP, SDP_PP, ...; ``env()`` writes them, ``from_env()`` reads them back).

One owner for both sides: the advisor (``sdp_jupyter.advisor``) estimates a ParallelConfig, the
launcher's options (``launch/parallel_options.py``) build one from ``--tp/--pp/...`` and put its
``env()`` into the workers' environment, and ``sdp_jupyter.parallel.setup()`` reads it back with
``from_env()``. Pure logic: no torch, no widgets.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from sdp_jupyter._env import FALSE, TRUE, env_bool

SHARDING = ("none", "optimizer", "gradients", "full")
CHECKPOINTING = ("none", "selective", "layer")
SCHEDULES = ("1f1b", "gpipe", "interleaved")
RUNTIMES = ("megatron", "torch")

#: every worker variable of the contract (env() writes a subset: the optional ones when not default)
ENV_NAMES = ("SDP_TP", "SDP_PP", "SDP_MICROBATCHES", "SDP_ACTIVE_MICROBATCHES", "SDP_PIPELINE_SCHEDULE",
             "SDP_VIRTUAL_STAGES", "SDP_SHARD_OPTIMIZER", "SDP_CHECKPOINT_ACTIVATIONS",
             "SDP_OFFLOAD_ACTIVATIONS", "SDP_SEQUENCE_PARALLEL")


@dataclass(frozen=True)
class ParallelConfig:
    """The knobs. ``batch`` (on Workload) is the batch of one model replica (SageMaker's
    ``prescaled_batch=True``): every tp rank of a replica sees the same ``batch`` samples."""

    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    active_microbatches: int | None = None  # cap on in-flight microbatches per stage; None: no cap
    sharding: str = "none"  # SHARDING
    checkpointing: str = "none"  # CHECKPOINTING; "layer": every transformer block
    offload_activations: bool = False
    schedule: str = "1f1b"  # SCHEDULES
    virtual_stages: int = 1  # chunks per rank for the interleaved schedule
    sequence_parallel: bool = True  # shard layer-norm/dropout activations over tp (Megatron SP)
    flash_attention: bool = False  # no s*s attention scores stored
    #: whose memory behaviour to count: "megatron" (the paper's, SageMaker's library, Megatron) or
    #: "torch" (sdp_jupyter.parallel on torch 2.13, as measure mode finds it: a replicated gradient
    #: for the vocabulary-parallel embedding; with sequence parallelism the column-parallel
    #: projections keep their all-gathered input for backward)
    runtime: str = "megatron"

    def __post_init__(self):
        for f, allowed in (("sharding", SHARDING), ("checkpointing", CHECKPOINTING),
                           ("schedule", SCHEDULES), ("runtime", RUNTIMES)):
            if getattr(self, f) not in allowed:
                raise ValueError(f"{f}={getattr(self, f)!r}: allowed {', '.join(allowed)}")
        for f in ("tp", "pp", "microbatches", "virtual_stages"):
            if getattr(self, f) < 1:
                raise ValueError(f"{f} must be >= 1, got {getattr(self, f)}")
        if self.active_microbatches is not None and self.active_microbatches < 1:
            raise ValueError("active_microbatches must be >= 1 (or None for no cap)")

    @property
    def shard_optimizer(self) -> bool:
        return self.sharding != "none"

    def describe(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        if self.pp > 1 or self.microbatches > 1:
            parts.append(f"microbatches={self.microbatches}")
        if self.active_microbatches is not None:
            parts.append(f"active_microbatches={self.active_microbatches}")
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}")
        if self.sharding != "none":
            parts.append(f"sharding={self.sharding}")
        if self.checkpointing != "none":
            parts.append(f"checkpointing={self.checkpointing}")
        if self.offload_activations:
            parts.append("offload_activations")
        if self.tp > 1 and not self.sequence_parallel:
            parts.append("no sequence parallelism")
        if self.flash_attention:
            parts.append("flash attention")
        if self.runtime != "megatron":
            parts.append(f"{self.runtime} runtime")
        return ", ".join(parts)

    def env_options(self) -> str:
        """The same as ``%%sdp_train`` options: ``--env SDP_TP=2 --env SDP_PP=2 ...``."""
        return " ".join(f"--env {k}={v}" for k, v in self.env().items())

    def env(self) -> dict[str, str]:
        """The worker environment that carries this configuration (read by sdp_jupyter.parallel)."""
        e = {"SDP_TP": str(self.tp), "SDP_PP": str(self.pp),
             "SDP_MICROBATCHES": str(self.microbatches),
             "SDP_PIPELINE_SCHEDULE": self.schedule,
             "SDP_SHARD_OPTIMIZER": self.sharding,
             "SDP_CHECKPOINT_ACTIVATIONS": self.checkpointing,
             "SDP_OFFLOAD_ACTIVATIONS": "1" if self.offload_activations else "0",
             "SDP_SEQUENCE_PARALLEL": "1" if self.sequence_parallel else "0"}
        if self.active_microbatches is not None:
            e["SDP_ACTIVE_MICROBATCHES"] = str(self.active_microbatches)
        if self.virtual_stages != 1:
            e["SDP_VIRTUAL_STAGES"] = str(self.virtual_stages)
        return e

    @classmethod
    def from_env(cls, environ=None) -> "ParallelConfig":
        """The inverse of ``env()``; unset variables keep their defaults. ``SDP_SHARD_OPTIMIZER`` also
        takes 1/true (= "optimizer") and 0/false; ``SDP_CHECKPOINT_ACTIVATIONS`` 1/true (= "layer")."""
        env = os.environ if environ is None else environ

        def num(name, default):
            v = env.get(name, "").strip()
            try:
                return int(v) if v else default
            except ValueError:
                raise ValueError(f"{name}={v!r} is not an integer") from None

        def choice(name, default, truthy):
            v = env.get(name, "").strip().lower()
            if v in ("", None):
                return default
            return truthy if v in TRUE else "none" if v in FALSE else v

        return cls(tp=num("SDP_TP", 1), pp=num("SDP_PP", 1),
                   microbatches=num("SDP_MICROBATCHES", 1),
                   active_microbatches=num("SDP_ACTIVE_MICROBATCHES", None),
                   sharding=choice("SDP_SHARD_OPTIMIZER", "none", "optimizer"),
                   checkpointing=choice("SDP_CHECKPOINT_ACTIVATIONS", "none", "layer"),
                   offload_activations=env_bool("SDP_OFFLOAD_ACTIVATIONS", False, environ=env),
                   schedule=env.get("SDP_PIPELINE_SCHEDULE", "1f1b").strip().lower() or "1f1b",
                   virtual_stages=num("SDP_VIRTUAL_STAGES", 1),
                   sequence_parallel=env_bool("SDP_SEQUENCE_PARALLEL", True, environ=env))
