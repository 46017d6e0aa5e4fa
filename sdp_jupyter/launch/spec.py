"""JobSpec: the plain, validated, JSON-serialisable record every job starts from.

A cell (`%%sdp_train`), the setup widget's Launch button and `sdp-train` all build a JobSpec; a
launcher turns it into running workers. Every bad value is rejected here, before any process starts,
with a message that names the option and how to fix it.

The option table (launch/option_table.py) is the single description of the command-line options:
the magic, the CLI and `JobSpec.to_magic_line()` are all generated from it. To add an option, add a
JobSpec field and one `Option` row there.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import json
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from sdp_jupyter.launch import option_table, targets
from sdp_jupyter.backends import BACKENDS
from sdp_jupyter.launch.option_table import (OPTION_PROVIDERS, OPTIONS, OPTIONS_BY_FIELD,  # noqa: F401  (re-exported)
                                            all_options, flag_of as _flag)
from sdp_jupyter.launch.options import Option, SpecError, parse_whole  # noqa: F401  (their home; re-exported)

TARGETS = tuple(targets.TARGETS)  # one record per target: launch/targets/__init__.py
RANKS_OUTPUT = ("0", "all", "raw")  # raw: rank_groups.RAW
STARTS = ("auto", "warm", "cold")  # how ranks start: docs/warm.md

# Variables the launcher sets itself; --env may not override them (the job would not start right).
RESERVED_ENV = frozenset(
    "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT "
    "SM_HOSTS SM_CURRENT_HOST SM_HPS SDP_JOB_DIR SDP_JOB_NAME SDP_JOB_SECRET SDP_NUM_NODES "
    "SDP_BACKEND SDP_RESTART SDP_ELASTIC SDP_CHECKPOINT_PER_NODE".split()
)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")
_ENV_KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_IDENT_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def parse_key_values(field_name: str, items: Any, *, json_values: bool) -> dict:
    """KEY=VALUE strings (or a dict) -> dict. With json_values, '0.1' becomes 0.1 and 'true' True."""
    flag = _flag(field_name)
    if items is None:
        return {}
    if isinstance(items, dict):
        pairs = list(items.items())
    elif isinstance(items, (list, tuple)):
        pairs = []
        for item in items:
            if not isinstance(item, str) or "=" not in item:
                raise SpecError(flag, f"expected KEY=VALUE, got {item!r}. Fix: {flag} KEY=VALUE")
            key, _, raw = item.partition("=")
            value: Any = raw
            if json_values:
                try:
                    value = json.loads(raw)
                except ValueError:
                    value = raw
            pairs.append((key.strip(), value))
    else:
        raise SpecError(flag, f"expected KEY=VALUE pairs, got {items!r}")
    out = {}
    for key, value in pairs:
        if not isinstance(key, str) or not _ENV_KEY_RE.match(key):
            raise SpecError(flag, f"{key!r} is not a valid name (letters, digits, _). Fix: {flag} KEY=VALUE")
        out[key] = value
    return out



@functools.cache
def _target_fields_of_jobspec() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(JobSpec)) - {"target_options"}


def _own_field(top: str) -> bool:
    """Whether a target's options field `top` is a field of JobSpec's own (ssh, ray, ...), not target_options'."""
    return top in _target_fields_of_jobspec()

@dataclass
class JobSpec:
    """What to run and how. Build it with keywords; bad values raise SpecError at construction.

    Exactly one of `code` (the cell's source) or `script` (path to a .py file) says what runs.
    `sagemaker`, `ssh`, `ray` and `slurm` each hold the options only that target reads (its record's
    `field`; the option rows are in the target's folder, sdp_jupyter/launch/targets/NAME/); a target
    registered later (one of your own) keeps its options in `target_options[its field]`.
    `parallel` holds the hybrid-parallel options (tp, pp, microbatches, ...; owned by
    sdp_jupyter.launch.parallel_options): only those that differ from their defaults are kept, and
    the workers get them as SDP_TP, SDP_PP, ... (`parallel_env()`).
    """

    code: str | None = None
    script: str | None = None
    name: str | None = None
    nodes: int | None = None  # None: the target decides (the SSH target's hosts, else 1); MAX of MIN:MAX
    min_nodes: int | None = None  # an elastic job's MIN (--nodes MIN:MAX); None: not elastic
    elastic_wait: float = 120.0
    procs_per_node: int | None = None
    backend: str = "smddp"
    init_process_group: bool = False
    target: str = targets.DEFAULT_TARGET
    env: dict = field(default_factory=dict)
    args: list = field(default_factory=list)
    hyperparameters: dict = field(default_factory=dict)
    push: list = field(default_factory=list)
    result: str | None = None
    max_restarts: int = 0
    heal: bool = False
    checkpoint_dir: str | None = None
    timeout: float | None = None
    ranks_output: str = "0"
    jobs_dir: str | None = None
    start: str = "auto"
    preload: list = field(default_factory=list)
    sagemaker: dict = field(default_factory=dict)
    parallel: dict = field(default_factory=dict)
    ssh: dict = field(default_factory=dict)
    ray: dict = field(default_factory=dict)
    slurm: dict = field(default_factory=dict)
    target_options: dict = field(default_factory=dict)  # {a registered target's field: its options}, if not above

    @staticmethod
    def put_target_options(keywords: dict, top: str, options: dict) -> dict:
        """Merge `options` of the target whose field is `top` into JobSpec keywords (copying what it
        changes): under `top` for a field of JobSpec's own, else under target_options[top]. Returns them."""
        if _own_field(top):
            keywords[top] = {**(keywords.get(top) or {}), **options}
        else:
            mine = dict(keywords.get("target_options") or {})
            mine[top] = {**mine.get(top, {}), **options}
            keywords["target_options"] = mine
        return keywords

    def options_of(self, top: str) -> dict:
        """The options of the target whose field is `top` (``spec.options_of("ssh") is spec.ssh``)."""
        return getattr(self, top) if _own_field(top) else self.target_options.get(top, {})

    def __post_init__(self):
        if isinstance(self.nodes, str) and ":" in self.nodes:
            low, _, high = self.nodes.partition(":")
            self.min_nodes, self.nodes = parse_whole("--nodes", low, 1, "2:4"), parse_whole("--nodes", high, 1, "2:4")
        if self.nodes is not None:
            self.nodes = parse_whole(_flag("nodes"), self.nodes, 1, "4")
        self._check_elastic()
        if self.procs_per_node is not None:
            self.procs_per_node = parse_whole(_flag("procs_per_node"), self.procs_per_node, 1, "1")
        self.max_restarts = parse_whole(_flag("max_restarts"), self.max_restarts, 0, "2")
        self._check_heal()
        self.backend = self._choice("backend", self.backend, BACKENDS)
        self.target = self._choice("target", self.target, TARGETS)
        self._check_init_process_group()
        self.ranks_output = self._choice("ranks_output", str(self.ranks_output), RANKS_OUTPUT)
        if self.name is not None and not _NAME_RE.match(str(self.name)):
            raise SpecError("--name", f"{self.name!r} is not a valid job name: use 1-63 letters, digits, "
                                      "'-', '_' or '.', starting with a letter or digit (e.g. --name mnist-4n)")
        if self.timeout is not None:
            try:
                self.timeout = float(self.timeout)
            except (TypeError, ValueError):
                raise SpecError("--timeout", f"must be a number of seconds, got {self.timeout!r}. "
                                             "Fix: --timeout 600") from None
            if not self.timeout > 0:
                raise SpecError("--timeout", f"must be more than 0 seconds, got {self.timeout}. Fix: --timeout 600")
        self.env = {k: str(v) for k, v in parse_key_values("env", self.env, json_values=False).items()}
        reserved = sorted(set(self.env) & RESERVED_ENV)
        if reserved:
            raise SpecError("--env", f"{', '.join(reserved)} is set by the launcher and cannot be overridden; "
                                     "remove it from --env")
        self.hyperparameters = parse_key_values("hyperparameters", self.hyperparameters, json_values=True)
        for key, value in self.hyperparameters.items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                raise SpecError("--hp", f"value of {key!r} is not JSON-serialisable; use numbers, strings "
                                        "or lists") from None
        if isinstance(self.args, str):
            try:
                self.args = shlex.split(self.args)
            except ValueError as e:
                raise SpecError("--args", f"cannot split {self.args!r} ({e}); check the quotes") from None
        self.args = [str(a) for a in self.args]
        if isinstance(self.push, str):
            self.push = [p.strip() for p in self.push.split(",") if p.strip()]
        self.push = list(self.push)
        for name in self.push:
            if not isinstance(name, str) or not _IDENT_RE.match(name):
                raise SpecError("--push", f"{name!r} is not a variable name. Fix: --push X,y (comma-separated names)")
        if self.result is not None and not _IDENT_RE.match(str(self.result)):
            raise SpecError("--result", f"{self.result!r} is not a variable name. Fix: --result weights")
        if (self.code is None) == (self.script is None):
            raise SpecError("code", "give exactly one of code= (the training code) or script= (a .py file)")
        if self.code is not None and not str(self.code).strip():
            raise SpecError("code", "the training code is empty: put the code below the %%sdp_train line")
        if self.start not in STARTS:
            raise SpecError("--warm/--cold", f"{self.start!r} is not one of {', '.join(STARTS)}. Fix: --warm or "
                                             "--cold (start='warm' or 'cold' in Python), or neither for auto")
        if isinstance(self.preload, str):
            self.preload = [m.strip() for m in self.preload.split(",") if m.strip()]
        self.preload = list(self.preload)
        for name in self.preload:
            if not isinstance(name, str) or not _MODULE_RE.match(name):
                raise SpecError("--preload", f"{name!r} is not a module name. Fix: --preload numpy,sklearn "
                                             "(comma-separated module names)")
        warm = [name for name, t in targets.TARGETS.items() if t.warm]
        if self.target not in warm and (self.start == "warm" or self.preload):
            flag = "--warm" if self.start == "warm" else "--preload"
            names = targets.sentence(tuple(warm))
            raise SpecError(flag, f"warm starts are for the {names} targets so far, and the target is "
                                  f"{self.target}. Fix: remove {flag}")
        for target, record in targets.TARGETS.items():  # a target's own options
            if record.field is None:
                continue
            options = self.options_of(record.field)
            if not isinstance(options, dict):
                raise SpecError(record.field, f"must be a dict of {target} options, got {type(options).__name__}")
            if record.exclusive and options and self.target != target:  # refused with another target
                key = f"{record.field}.{next(iter(options))}"
                flag = next((o.flag for o in all_options() if o.field == key), "--" + key.split(".", 1)[1])
                raise SpecError(flag, f"is an option of --target {target}, and the target is {self.target}. "
                                      f"Fix: add --target {target}, or remove {flag}")
        if self.parallel is None:
            self.parallel = {}
        if not isinstance(self.parallel, dict):
            raise SpecError("parallel", f"must be a dict of hybrid-parallel options, got {self.parallel!r}")
        if self.parallel:  # checked by the advisor's layout rules; imported only by jobs that use them
            self.parallel = importlib.import_module("sdp_jupyter.launch.parallel_options").check(self)

    def _check_elastic(self) -> None:
        try:
            self.elastic_wait = float(self.elastic_wait)
        except (TypeError, ValueError):
            raise SpecError("--elastic-wait", f"must be a number of seconds, got {self.elastic_wait!r}. "
                                              "Fix: --elastic-wait 120") from None
        if not self.elastic_wait >= 0:
            raise SpecError("--elastic-wait", f"must be 0 or more seconds, got {self.elastic_wait}. "
                                              "Fix: --elastic-wait 120")
        if self.min_nodes is None:
            return
        self.min_nodes = parse_whole("--nodes", self.min_nodes, 1, "2:4")
        if self.nodes is None:
            raise SpecError("--nodes", f"an elastic job's MIN ({self.min_nodes}) needs its MAX. Fix: --nodes "
                                       f"{self.min_nodes}:{self.min_nodes + 1}")
        if self.min_nodes > self.nodes:
            raise SpecError("--nodes", f"MIN:MAX is {self.min_nodes}:{self.nodes}, and MIN is more than MAX. "
                                       f"Fix: --nodes {self.nodes}:{self.min_nodes}")
        elastic = targets.having("elastic")
        if self.target not in elastic:
            why = targets.TARGETS[self.target].elastic_refusal or "it does not re-form a job"
            raise SpecError("--nodes", f"MIN:MAX (an elastic job) is for the "
                                       f"{targets.sentence(elastic)} targets, and on --target "
                                       f"{self.target} {why}. Fix: --nodes {self.nodes} --max-restarts 2")

    def _check_heal(self) -> None:
        if not isinstance(self.heal, bool):
            raise SpecError("--heal", f"is a flag (True or False), got {self.heal!r}")
        if not self.heal:
            return
        healing = targets.having("heal")
        if self.target not in healing:
            raise SpecError("--heal", f"healing in place is built for the {targets.sentence(healing)} "
                                      f"target{'s' if len(healing) > 1 else ''} so far, and the target is {self.target}. Fix: remove --heal and "
                                      "use --max-restarts K (the job restarts from its last checkpoint)")
        if self.min_nodes is not None:
            raise SpecError("--heal", "replaces ranks in place, and --nodes MIN:MAX re-forms the whole job: "
                                      f"choose one. Fix: --nodes {self.nodes}")
        if self.init_process_group:
            raise SpecError("--heal", "makes the process group in the script's Healer (and again at each "
                                      "membership change), so --init-process-group cannot make it first. "
                                      "Fix: remove --init-process-group")
        if self.max_restarts < 1:
            raise SpecError("--heal", "replaces up to --max-restarts dead ranks, and --max-restarts is 0. "
                                      "Fix: --heal --max-restarts 3")

    @property
    def elastic(self) -> bool:
        """--nodes MIN:MAX: the job re-forms without a lost node (launch/kernel/elastic.py)."""
        return self.min_nodes is not None

    def _check_init_process_group(self) -> None:
        if not isinstance(self.init_process_group, bool):
            raise SpecError("--init-process-group", f"is a flag (True or False), got {self.init_process_group!r}")

    @property
    def default_nodes(self) -> int | None:
        """What --nodes left out means for this target: 1, or None where the target decides later
        (the SSH target: its number of hosts), so `--nodes 1` there is said, not dropped."""
        return None if targets.TARGETS[self.target].nodes_from_hosts else 1

    @property
    def world_size(self) -> int:
        """Ranks in the job: nodes x processes per node, the one place it is computed (a spec the
        launcher has not resolved yet counts what it knows: 1 node, 1 process per node)."""
        return (self.nodes or 1) * (self.procs_per_node or 1)

    def parallel_env(self) -> dict[str, str]:
        """The hybrid-parallel options as the workers' SDP_TP, SDP_PP, ... (ParallelConfig.env());
        empty when none is set, so a job without them runs as before."""
        if not self.parallel:
            return {}
        return importlib.import_module("sdp_jupyter.launch.parallel_options").worker_env(self.parallel)

    @staticmethod
    def _choice(field_name: str, value: Any, allowed: tuple) -> str:
        if value not in allowed:
            flag = _flag(field_name)
            raise SpecError(flag, f"{value!r} is not one of {', '.join(allowed)}. Fix: {flag} {allowed[0]}")
        return value

    # ---------------------------------------------------------------- serialisation
    def to_dict(self) -> dict:
        """Every field as a plain dict (nested dicts copied): what from_dict takes back."""
        return dataclasses.asdict(self)

    def to_json(self, **kw) -> str:
        """to_dict() as JSON, indented by 2 unless `kw` (json.dumps's keywords) says otherwise."""
        return json.dumps(self.to_dict(), **({"indent": 2} | kw))

    @classmethod
    def from_dict(cls, data: dict) -> "JobSpec":
        """A spec from a dict of its fields, checked as the constructor checks; an unknown field is a
        SpecError that lists the known ones."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(unknown[0], f"unknown JobSpec field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "JobSpec":
        """from_dict() of a JSON object, e.g. to_json()'s."""
        return cls.from_dict(json.loads(text))

    def replace(self, **changes) -> "JobSpec":
        """A copy with `changes` (field=value) applied and checked again; this spec is unchanged."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_options(cls, values: dict, **extra) -> "JobSpec":
        """Build from parsed option values keyed by argparse dest (None = not given)."""
        return cls(**option_table.fields_from_options(values, extra, JobSpec.put_target_options))

    def to_magic_line(self, *, wait: bool = False) -> str:
        """The `%%sdp_train ...` line that builds this spec (the cell's code goes below it)."""
        return option_table.magic_line(self, JobSpec(code="pass"), wait=wait)
