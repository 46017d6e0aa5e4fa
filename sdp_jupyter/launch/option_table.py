"""The option table: the single description of the command-line options of %%sdp_train and sdp-train,
and a JobSpec as such a line, both ways (`JobSpec.from_options`, `JobSpec.to_magic_line`). The magic, the
CLI, the reference page and the setup form's magic line are all generated from it. Its rows: the job
options here (`OPTIONS`), each target's (its folder's record names them) and the hybrid-parallel ones
(`OPTION_PROVIDERS`). To add an option, add a JobSpec field (launch/spec.py) and one `Option` row.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import shlex
from typing import Any, Callable

from sdp_jupyter.launch import targets
from sdp_jupyter.launch.options import Option, SpecError

OPTIONS: tuple[Option, ...] = (
    Option("--nodes", "nodes", f"number of nodes ({targets.nodes_default()}); MIN:MAX makes the job "
           f"elastic on the {targets.sentence(targets.having('elastic'))} targets: a lost node is "
           "left out and the job goes on with at least MIN, a node that returns rejoins, up to MAX "
           "(docs/failures.md)", metavar="N|MIN:MAX"),
    Option("--procs-per-node", "procs_per_node",
           "processes per node (default: GPUs per node, or 1 on a CPU-only machine)", metavar="P"),
    Option("--backend", "backend", "torch.distributed backend: smddp (default), gloo or nccl"),
    Option("--init-process-group", "init_process_group",
           "initialize the default process group with --backend before the script runs, so an unchanged "
           "Trainer or accelerate script uses it; the script's own init_process_group with that backend "
           "returns at once (docs/integrations.md)", kind="flag"),
    Option("--name", "name", "job name, also the job directory's name (default: job-<time>-<id>)"),
    Option("--target", "target", f"where to run: {targets.listed()} (default: local)"),
    Option("--wait", None, "block until the job ends (Ctrl-C stops it); raise if it failed", kind="flag"),
    Option("--env", "env", "environment variable for every rank (repeatable)", kind="append",
           metavar="KEY=VALUE"),
    Option("--args", "args", 'command-line arguments for the script, e.g. --args "--epochs 3"'),
    Option("--hp", "hyperparameters",
           "hyperparameter (repeatable): passed as --KEY VALUE and in SM_HPS", kind="append",
           metavar="KEY=VALUE"),
    Option("--push", "push", "notebook variables to send to every rank, e.g. --push X,y", kind="csv",
           metavar="A,B,C"),
    Option("--no-auto-push", None, "send only the variables --push names: by default the functions and classes "
           "defined in the notebook that the cell uses go too, by value (docs/notebook_code.md)", kind="flag"),
    Option("--result", "result", "notebook variable that receives what rank 0's cell returned",
           metavar="NAME"),
    Option("--max-restarts", "max_restarts", "restart the whole job up to K times when a rank fails",
           metavar="K"),
    Option("--heal", "heal", "replace a rank that dies while the others keep their processes: they re-form "
           "without it and redo the step, and it rejoins at a step boundary with its state from a live peer; "
           "the script trains through sdp_jupyter.heal.Healer, and --max-restarts K counts the replacements "
           f"({targets.sentence(targets.having('heal'))} target"
           f"{'s' if len(targets.having('heal')) > 1 else ''}; docs/failures.md)", kind="flag"),
    Option("--elastic-wait", "elastic_wait",
           "an elastic job (--nodes MIN:MAX) with fewer than MIN nodes waits this long for hosts to return, "
           "then fails naming them (default: 120)", metavar="SECONDS"),
    Option("--checkpoint-dir", "checkpoint_dir",
           "checkpoint directory, SDP_CHECKPOINT_DIR (default: <job dir>/checkpoints)", metavar="DIR"),
    Option("--timeout", "timeout", "stop the job after this many seconds", metavar="SECONDS"),
    Option("--ranks-output", "ranks_output",
           "ranks whose output is shown: 0 (default); all (a line several ranks print shows once, "
           "[ranks 0-7] ...); raw (every rank's lines, each [rank R], not merged); every rank's log is kept "
           "on disk", metavar="0|all|raw"),
    Option("--jobs-dir", "jobs_dir", "root of job directories (default: $SDP_JOBS_DIR or ./sdp_jobs)",
           metavar="DIR"),
    Option("--warm", "start", "fork the ranks from a warm pool that imported torch once ("
           f"{targets.sentence(targets.having('warm'))} targets), starting the pool first where none is up. Default: warm where the kernel already holds a "
           "pool: the local one starts after the kernel's first job or with %sdp_warm, an SSH host's after the "
           "kernel's first job there, a Ray node's only in a job run with --warm. SDP_WARM=1/0 sets the default",
           kind="flag", const="warm"),
    Option("--cold", "start", "start every rank as a fresh interpreter, even when a warm pool runs",
           kind="flag", const="cold"),
    Option("--preload", "preload", "modules the warm pool imports too, e.g. --preload numpy,sklearn",
           kind="csv", metavar="A,B,C"),
)

OPTIONS_BY_FIELD = {o.field: o for o in OPTIONS if o.field}

# Modules that add rows to the option table ("module:ATTRIBUTE", a tuple of Option). Their fields are
# "<dict field of JobSpec>.<key>", e.g. "sagemaker.instance_type" fills JobSpec.sagemaker["instance_type"].
OPTION_PROVIDERS = [t.options for t in targets.TARGETS.values() if t.options] \
    + ["sdp_jupyter.launch.parallel_options:PARALLEL_OPTIONS"]


def all_options() -> tuple[Option, ...]:
    """The core options plus those of every installed provider (what %%sdp_train and sdp-train accept)."""
    rows = list(OPTIONS)
    for provider in OPTION_PROVIDERS:
        module, attr = provider.split(":")
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ImportError:
            continue
        rows += list(getattr(importlib.import_module(module), attr, ()))
    return tuple(rows)


def flag_of(field_name: str) -> str:
    """The option that fills JobSpec field `field_name` (its name when no option does), for messages."""
    opt = OPTIONS_BY_FIELD.get(field_name)
    return opt.flag if opt else field_name


def fields_from_options(values: dict, extra: dict, put_target_options: Callable[[dict, str, dict], dict]) -> dict:
    """JobSpec's keywords from parsed option values keyed by argparse dest (None = not given), plus `extra`;
    a target's options are merged in by `put_target_options` (JobSpec's)."""
    fields: dict[str, Any] = dict(extra)
    given: dict[str, str] = {}  # field -> the option that filled it (--warm and --cold share one)
    parts: dict[str, dict] = {}  # a target's field -> its options given
    for opt in all_options():
        value = values.get(opt.flag.lstrip("-").replace("-", "_"))
        if opt.field is None or value is None or (opt.kind == "flag" and value is False):
            continue
        if opt.kind == "flag":
            value = opt.const
        elif opt.kind == "csv" and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if "." in opt.field:  # a key of a dict field (JobSpec.sagemaker)
            top, key = opt.field.split(".", 1)
            parts.setdefault(top, {})[key] = value
        else:
            if opt.field in given and fields[opt.field] != value:
                raise SpecError(opt.flag, f"cannot be given together with {given[opt.field]}. "
                                          f"Fix: keep one of {given[opt.field]} and {opt.flag}")
            given[opt.field] = opt.flag
            fields[opt.field] = value
    for top, options in parts.items():
        put_target_options(fields, top, options)
    return fields


def magic_line(spec, default, *, wait: bool = False) -> str:
    """The `%%sdp_train ...` line that builds `spec` (a JobSpec; `default` one with every field left
    as it comes), the cell's code going below it."""
    parts = ["%%sdp_train"]
    for opt in all_options():
        if opt.field is None:
            if opt.flag == "--wait" and wait:
                parts.append("--wait")
            continue
        if "." in opt.field:
            top, key = opt.field.split(".", 1)
            parts += _render_key(opt, (spec.options_of(top) or {}).get(key))
            continue
        value = getattr(spec, opt.field)
        if value == getattr(default, opt.field) or (opt.field == "nodes" and value == spec.default_nodes):
            continue
        if opt.field == "nodes" and spec.min_nodes is not None:
            value = f"{spec.min_nodes}:{value}"
        if opt.field == "env":
            parts += [tok for k, v in value.items() for tok in ("--env", shlex.quote(f"{k}={v}"))]
        elif opt.field == "hyperparameters":
            parts += [tok for k, v in value.items()
                      for tok in ("--hp", shlex.quote(f"{k}={v if isinstance(v, str) else json.dumps(v)}"))]
        elif opt.field == "args":
            # "--args=..." so that a value starting with "--" is not taken for an option
            parts.append("--args=" + shlex.quote(shlex.join(value)))
        elif opt.field == "push":
            parts += ["--push", ",".join(value)]
        elif opt.field in ("timeout", "elastic_wait"):  # numbers as written: 60, not 60.0
            parts += [opt.flag, f"{value:g}"]
        elif opt.kind in ("flag", "csv"):  # --warm / --cold (one field, two flags), --preload
            parts += _render_key(opt, value)
        else:
            parts += [opt.flag, shlex.quote(str(value))]
    return " ".join(parts)


def _render_key(opt: Option, value: Any) -> list[str]:
    """Tokens that set one key of a dict field (e.g. --instance-type ml.p4d.24xlarge)."""
    if opt.kind == "flag":
        on = bool(value) if opt.const is True else (value is not None and value == opt.const)
        return [opt.flag] if on else []
    if value is None or value is False or value == {} or value == []:
        return []
    if opt.kind == "optional" and value == opt.const:
        return [opt.flag]
    if opt.kind == "csv" and isinstance(value, (list, tuple)):
        return [opt.flag, shlex.quote(",".join(map(str, value)))]
    if opt.kind == "append":
        items = [f"{k}={v}" for k, v in value.items()] if isinstance(value, dict) else \
            list(value) if isinstance(value, (list, tuple)) else [value]
        return [tok for item in items for tok in (opt.flag, shlex.quote(str(item)))]
    if str(value).startswith("-"):  # "--slurm-args=--qos=high": argparse takes a bare "--qos=high" for an option
        return [f"{opt.flag}={shlex.quote(str(value))}"]
    return [opt.flag, shlex.quote(str(value))]
