"""Hybrid-parallel job options: `%%sdp_train --tp 2 --pp 2 --microbatches 4 ...` -> `JobSpec.parallel`
-> the workers' `SDP_TP`, `SDP_PP`, ... -> `sdp_jupyter.parallel.setup()` (docs/model_parallel.md).

`PARALLEL_OPTIONS` is listed in `spec.OPTION_PROVIDERS`, so %%sdp_train, sdp-train and
`JobSpec.to_magic_line()` know the rows; a row's field "parallel.<key>" fills `JobSpec.parallel[<key>]`.
`JobSpec.__post_init__` calls `check`: values are coerced, defaults dropped (a job without these
options keeps the environment it always had), and the layout is checked with the advisor's
`validate_layout` once processes per node are known (after the launcher resolved them), so a layout
that cannot run (tp across nodes, a world size tp*pp does not divide, offloading without its
prerequisites) is refused before anything starts.

This module lives in launch/ rather than in sdp_jupyter.parallel because that package imports torch,
and the notebook side never imports torch to launch a job; `ParallelConfig` and the workers' variables
come from the torch-free `sdp_jupyter.parallel_config`.
"""
from __future__ import annotations

from typing import Any

from sdp_jupyter._env import FALSE, TRUE
from sdp_jupyter.launch import targets
from sdp_jupyter.launch.options import Option, SpecError, parse_whole
from sdp_jupyter.parallel_config import CHECKPOINTING, ENV_NAMES, SCHEDULES, SHARDING, ParallelConfig

PARALLEL_OPTIONS: tuple[Option, ...] = (
    Option("--tp", "parallel.tp", "tensor-parallel degree: a power of two, at most --procs-per-node "
           "(tensor parallelism stays within a node; default 1)", metavar="T"),
    Option("--pp", "parallel.pp", "pipeline-parallel degree: stages across nodes (default 1)", metavar="P"),
    Option("--microbatches", "parallel.microbatches",
           "microbatches per batch: pipelined, or gradient accumulation when --pp is 1 (default 1)",
           metavar="M"),
    Option("--active-microbatches", "parallel.active_microbatches",
           "cap on the microbatches in flight per pipeline stage (default: no cap)", metavar="A"),
    Option("--pipeline-schedule", "parallel.pipeline_schedule",
           "pipeline schedule: 1f1b (default), gpipe or interleaved", metavar="1f1b|gpipe|interleaved"),
    Option("--virtual-stages", "parallel.virtual_stages",
           "model chunks per rank with --pipeline-schedule interleaved (default 1)", metavar="V"),
    Option("--shard-optimizer", "parallel.shard_optimizer",
           "shard over the data-parallel ranks: optimizer (what the bare flag means; ZeRO-1), gradients "
           "(ZeRO-2), full (FSDP2) or none (default)", kind="optional", const="optimizer", metavar="LEVEL"),
    Option("--checkpoint-activations", "parallel.checkpoint_activations",
           "recompute activations in backward: layer (what the bare flag means; every transformer block) "
           "or selective (default: none)", kind="optional", const="layer", metavar="layer|selective"),
    Option("--offload-activations", "parallel.offload_activations",
           "move saved activations of idle microbatches to CPU (needs --checkpoint-activations, --pp > 1 "
           "and --microbatches > 1)", kind="flag"),
    Option("--no-sequence-parallel", "parallel.sequence_parallel",
           "turn sequence parallelism off (on by default when --tp > 1)", kind="flag", const=False),
)

#: JobSpec.parallel's keys and their defaults (a key at its default is dropped)
DEFAULTS: dict[str, Any] = {
    "tp": 1, "pp": 1, "microbatches": 1, "active_microbatches": None, "pipeline_schedule": "1f1b",
    "virtual_stages": 1, "shard_optimizer": "none", "checkpoint_activations": "none",
    "offload_activations": False, "sequence_parallel": True,
}

#: key -> its option, for messages
FLAGS = {opt.field.split(".", 1)[1]: opt.flag for opt in PARALLEL_OPTIONS}


#: the advisor's knob names (Finding.knob) -> the option that sets them
_KNOB_FLAGS = {"tp": "--tp", "tp/pp": "--tp", "pp": "--pp", "microbatches": "--microbatches",
               "active_microbatches": "--active-microbatches", "offload_activations": "--offload-activations",
               "sharding": "--shard-optimizer", "checkpointing": "--checkpoint-activations",
               "virtual_stages": "--virtual-stages"}

_TRUE, _FALSE = TRUE, FALSE  # the one truth table: sdp_jupyter._env


def _level(key: str, value: Any, allowed: tuple, on: str) -> str:
    """A level option: one of `allowed`; True (the bare flag) is `on`, False is "none"."""
    if value is True or value is False:
        return on if value else "none"
    text = str(value).strip().lower()
    text = on if text in _TRUE else "none" if text in _FALSE else text
    if text not in allowed:
        flag = FLAGS[key]
        hint = " (write the level when the option comes right before the script: "\
               f"{flag} {on} train.py)" if text.endswith(".py") else ""
        raise SpecError(flag, f"{value!r} is not one of {', '.join(allowed)}{hint}. Fix: {flag} {on}")
    return text


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise SpecError(FLAGS[key], f"is a flag (true or false), got {value!r}")


def normalise(values: dict) -> dict:
    """Every key of JobSpec.parallel, checked and coerced ("2" -> 2, True -> "optimizer")."""
    unknown = sorted(set(values) - set(DEFAULTS))
    if unknown:
        raise SpecError("parallel", f"unknown hybrid-parallel option(s) {', '.join(unknown)}; "
                                    f"known: {', '.join(DEFAULTS)}")
    out = {**DEFAULTS, **{k: v for k, v in values.items() if v is not None}}
    for key, example in (("tp", "2"), ("pp", "2"), ("microbatches", "4"), ("virtual_stages", "2")):
        out[key] = parse_whole(FLAGS[key], out[key], 1, example)
    if out["active_microbatches"] is not None:
        out["active_microbatches"] = parse_whole(FLAGS["active_microbatches"], out["active_microbatches"], 1, "2")
    schedule = str(out["pipeline_schedule"]).strip().lower()
    if schedule not in SCHEDULES:
        raise SpecError("--pipeline-schedule", f"{out['pipeline_schedule']!r} is not one of "
                                               f"{', '.join(SCHEDULES)}. Fix: --pipeline-schedule 1f1b")
    out["pipeline_schedule"] = schedule
    out["shard_optimizer"] = _level("shard_optimizer", out["shard_optimizer"], SHARDING, "optimizer")
    out["checkpoint_activations"] = _level("checkpoint_activations", out["checkpoint_activations"],
                                           CHECKPOINTING, "layer")
    out["offload_activations"] = _bool("offload_activations", out["offload_activations"])
    out["sequence_parallel"] = _bool("sequence_parallel", out["sequence_parallel"])
    if out["virtual_stages"] > 1 and schedule != "interleaved":
        raise SpecError("--virtual-stages", f"{out['virtual_stages']} chunks per rank need the interleaved "
                                            f"schedule, not {schedule}. Fix: --pipeline-schedule interleaved "
                                            "(or drop --virtual-stages)")
    return out


def config(values: dict):
    """The ParallelConfig for JobSpec.parallel (missing keys at their defaults)."""
    v = {**DEFAULTS, **values}
    return ParallelConfig(tp=v["tp"], pp=v["pp"], microbatches=v["microbatches"],
                          active_microbatches=v["active_microbatches"], sharding=v["shard_optimizer"],
                          checkpointing=v["checkpoint_activations"], offload_activations=v["offload_activations"],
                          schedule=v["pipeline_schedule"], virtual_stages=v["virtual_stages"],
                          sequence_parallel=v["sequence_parallel"])


def check(spec) -> dict:
    """JobSpec.parallel checked against the rest of the spec; returns the keys not at their default.

    The layout rules need processes per node: a spec whose `procs_per_node` is still None (the
    launcher fills it in from the machine) is checked again when the launcher resolves it."""
    from sdp_jupyter.advisor import validate_layout

    values = normalise(spec.parallel)
    kept = {k: v for k, v in values.items() if v != DEFAULTS[k]}
    if not kept:
        return kept
    clash = [name for name in ENV_NAMES if name in spec.env]
    if clash:
        raise SpecError("--env", f"{', '.join(clash)} is set by the hybrid-parallel options (--tp, --pp, ...); "
                                 "remove it from --env and use the option instead (e.g. --tp 2 for SDP_TP=2)")
    reach = targets.having("hybrid")  # local adds the workers' variables; SageMaker to the job's Environment
    if spec.target not in reach:
        env = " ".join(f"--env {k}={v}" for k, v in worker_env(kept).items())
        raise SpecError(FLAGS[next(iter(kept))], f"the hybrid-parallel options reach --target {' or '.join(reach)}, "
                                                 f"not --target {spec.target}. Fix: --target {reach[0]}, or give "
                                                 f"the workers' variables instead: {env}")
    nodes = spec.nodes or 1  # local and SageMaker jobs: 1 node unless --nodes says
    if spec.procs_per_node is not None:
        errors = [f for f in validate_layout(config(values), spec.procs_per_node, nodes) if f.level == "error"]
        if errors:
            layout = f"--nodes {nodes} x --procs-per-node {spec.procs_per_node}"
            lines = [f"{e.message} Fix: {e.fix}." for e in errors]
            if values["offload_activations"]:
                need = [opt for opt, missing in (
                    ("--checkpoint-activations layer", values["checkpoint_activations"] != "layer"),
                    ("--pp 2 (or more)", values["pp"] == 1), ("--microbatches 2 (or more)", values["microbatches"] == 1))
                    if missing]
                if need:
                    lines.append(f"With these options: add {', '.join(need)}, or drop --offload-activations.")
            if values["tp"] > spec.procs_per_node:
                lines.append(f"A local node's GPUs are its --procs-per-node: e.g. --nodes {nodes} "
                             f"--procs-per-node {values['tp']} --tp {values['tp']}.")
            raise SpecError(_KNOB_FLAGS.get(errors[0].knob, "--tp"),
                            f"this job's layout ({layout}, {config(values).describe()}) cannot run: "
                            + " ".join(lines))
    return kept


def worker_env(values: dict) -> dict[str, str]:
    """SDP_TP, SDP_PP, ... for JobSpec.parallel (ParallelConfig.env(): every variable, defaults
    included); empty for an empty dict, so a job without these options keeps its environment."""
    return config(values).env() if values else {}
