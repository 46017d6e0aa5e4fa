"""JobSetup: where and how to train, what that does before launching, and the Launch itself.

    setup = sdp_jupyter.JobSetup("train.py", nodes=2, per_gpu_batch=64, reference_lr=0.05)
    setup             # in a notebook: the form (sdp_jupyter.ui.setup.JobSetupView); elsewhere a summary
    setup.set(nodes=4)  # what a field of the form does
    setup.spec        # the JobSpec the Launch button would start (hyperparameters included)
    setup.launch()    # what the Launch button does: sdp_jupyter.launch(setup.spec)

This is the model; it imports no widgets and works in a script or a terminal. The form is a view
grafted on (``setup.view()``, imported lazily as ``Job.view()`` is): it writes the fields here and
redraws from here, so a change made in code shows in the form and the reverse.

Every number comes from ``sdp_jupyter.scaling.evaluate``. The chosen hyperparameters reach the
script as SageMaker passes them: ``--key value`` arguments and ``SM_HPS`` (the launcher does both from
``JobSpec.hyperparameters``), so one script reads them the same way locally and on SageMaker.

What runs is a file (``script=``), code (``code=``), or a cell stored by name with ``%%sdp_cell NAME``
(``cell=``): ``%%sdp_cell`` keeps the cell's code without running it in the kernel.
"""
from __future__ import annotations

import argparse
import shlex
import threading
from dataclasses import fields as dc_fields
from pathlib import Path
from typing import Callable

from sdp_jupyter import instances, scaling
from sdp_jupyter._display import Shown
from sdp_jupyter._renamed import renamed
from sdp_jupyter.launch import targets
from sdp_jupyter.jobsetup.setup_options import setup_arguments

#: code of cells stored with %%sdp_cell NAME, by name
CELLS: dict[str, str] = {}

#: the instance type a form switched to a target of catalogue instances starts from
DEFAULT_CATALOGUE_INSTANCE = "ml.p4d.24xlarge"

#: Plan fields a person types as text: '' (or 'auto'/'unknown') is None, anything else must be a number
TEXT_NUMBERS = {"warmup_epochs": "warm-up epochs", "throughput_per_gpu": "throughput / GPU",
                "price_per_hour": "USD per node-hour"}

#: fields of the setup that are not Plan fields: those the targets add to the form (their records' `form`:
#: the SSH target's hosts, the Ray target's address, the Slurm target's options, ...)
TARGET_FIELDS = tuple(f.name for _target, f in targets.form_fields())


def optional_float(value, label: str) -> float | None:
    """'' / None -> None; a number (or its text) -> float; anything else -> ValueError naming the field."""
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    text = str(value).strip()
    if not text or text.lower() in ("auto", "unknown"):
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{label}: {text!r} is not a number (leave it empty for none)") from None


def measured_throughput(job_or_dir) -> tuple[float, int] | None:
    """(samples/s per rank, ranks) a job recorded with ``sdp_jupyter.report(samples=...)``, over its
    steady part (the monitor's reader leaves the first steps out); None if it reported no samples."""
    from sdp_jupyter.monitor.reader import read

    frame = read(job_or_dir)
    if frame.unit != "samples/s" or not frame.steady_samples_per_s or not frame.ranks:
        return None
    ranks = len(frame.ranks)
    return frame.steady_samples_per_s / ranks, ranks


class JobSetup(Shown):
    """The job setup. Keyword arguments preset its fields (see ``scaling.Plan`` for their meaning).

    A target's own options are given as JobSpec gives them, a dict under the target's field
    (``sagemaker={"role": ...}``, ``ssh={"hosts": [...], "python": ...}``, ``slurm={"partition": ...}``;
    see docs/launcher.md): the keys that are fields of the form fill them (the SSH hosts, the Ray
    address, the Slurm partition, account, time and sbatch options), the rest go to the spec as given.
    The form's fields are keywords too (``hosts="gpu1,gpu2"``, ``ray_address=...``, ``slurm_time=...``):
    an empty one is left out of the spec, so the target's default holds. ``launch_job`` replaces
    ``sdp_jupyter.launch`` (tests and other front-ends may pass their own).
    """

    def __init__(
        self,
        script: str | None = None,
        *,
        code: str | None = None,
        cell: str | None = None,
        name: str | None = None,
        hyperparameters: dict | None = None,
        jobs_dir: str | None = None,
        launch_job=None,
        **fields,
    ):
        fields = renamed(fields, "JobSetup()")
        self.target_options, form_values = _target_fields(fields)  # takes the targets' keywords out of `fields`
        plan_fields = fields
        known = {f.name for f in dc_fields(scaling.Plan)}
        unknown = sorted(set(plan_fields) - known)
        if unknown:
            theirs = [t.field for t in targets.TARGETS.values() if t.field] + list(TARGET_FIELDS)
            raise TypeError(f"JobSetup() got unknown field(s) {', '.join(unknown)}; known: script, code, cell, "
                            f"name, hyperparameters, jobs_dir, {', '.join(theirs)}, {', '.join(sorted(known))}")
        self._set_what_runs(script, code, cell)
        self.name = name
        self.extra_hyperparameters = dict(hyperparameters or {})
        self.jobs_dir = jobs_dir
        self.launch_job = launch_job
        self._listeners: list[Callable[["JobSetup"], None]] = []
        self._lock = threading.RLock()
        self._view = None
        self.job = None  # the last job launched from this setup
        self.launch_error: str | None = None  # why the last launch failed, if it did
        self.measured: tuple[float, int] | None = None  # (samples/s per rank, ranks) of the last job
        self.measure_error: str | None = None  # why the last job's throughput could not be read
        self.measured_from = None  # the job (or job directory) measured last
        self.measurements: dict[int, float] = {}  # ranks -> samples/s per rank, every measured job of this setup
        preset = scaling.Plan(**plan_fields)  # validates the choices (ValueError names the field)
        self._values = {f.name: getattr(preset, f.name) for f in dc_fields(scaling.Plan)}
        self._values.update(form_values)
        self._follow_target(None)

    # ------------------------------------------------------------------ the fields
    @property
    def values(self) -> dict:
        """Every field as it stands (text fields as typed); change them with ``set()``."""
        return dict(self._values)

    def set(self, **changes) -> "JobSetup":
        """Change fields (``set(nodes=4, rule="sqrt")``), as the form does. A choice that is not one
        of the allowed values is refused here (ValueError naming it); a number field given as text that
        is not a number is kept and blocks the launch, as in the form. Returns the setup."""
        changes = renamed(changes, "JobSetup.set()")
        unknown = sorted(set(changes) - set(self._values))
        if unknown:
            raise TypeError(f"JobSetup.set() got unknown field(s) {', '.join(unknown)}; known: "
                            f"{', '.join(sorted(self._values))}")
        with self._lock:
            new = {**self._values, **changes}
            if targets.TARGETS[new["target"]].catalogue:
                instances.get(new["instance_type"])  # KeyError naming the catalogue
            scaling.Plan(**{k: (None if k in TEXT_NUMBERS else v) for k, v in new.items() if k not in TARGET_FIELDS})
            old_target = self._values["target"]
            self._values = new
            self._follow_target(old_target if "target" in changes else None, given=changes)
        self._changed()
        return self

    def _follow_target(self, old_target: str | None, given: dict = {}) -> None:
        """The fields a target decides: on a target of catalogue instances (SageMaker) the instance type's
        GPU count, elsewhere the local machine; switching target resets the instance type (and, off the
        catalogue, the processes per node)."""
        v = self._values
        catalogue = targets.TARGETS[v["target"]].catalogue
        if old_target is not None and old_target != v["target"]:
            if catalogue:
                if "instance_type" not in given:
                    v["instance_type"] = DEFAULT_CATALOGUE_INSTANCE
            elif "procs_per_node" not in given:
                v["procs_per_node"] = max(1, instances.get(instances.LOCAL).gpus)
        if catalogue:
            if v["instance_type"] == instances.LOCAL:
                v["instance_type"] = DEFAULT_CATALOGUE_INSTANCE
            v["procs_per_node"] = max(1, instances.get(v["instance_type"]).gpus)
        else:
            v["instance_type"] = instances.LOCAL

    def _set_what_runs(self, script, code, cell) -> None:
        if sum(x is not None for x in (script, code, cell)) > 1:
            raise ValueError("give at most one of script=, code= or cell=")
        if cell is not None and cell not in CELLS:
            raise KeyError(f"no cell stored as {cell!r}: run a cell that starts with '%%sdp_cell {cell}' first"
                           + (f" (stored: {', '.join(CELLS)})" if CELLS else ""))
        self._code, self._cell = code, cell
        self.script_path = None if script is None else str(script)

    def attach(self, script: str | None = None, *, code: str | None = None, cell: str | None = None) -> "JobSetup":
        """Change what Launch runs: a .py file, code, or a cell stored with ``%%sdp_cell NAME``."""
        self._set_what_runs(script, code, cell)
        self._changed()
        return self

    # ------------------------------------------------------------------ what it does
    @property
    def plan(self) -> scaling.Plan:
        """The fields as a Plan; ValueError for a number field that is not a number."""
        v = dict(self._values)
        record = targets.TARGETS[v["target"]]
        for key in record.plan_keys:  # a field left as auto: the target's option of that name, if given, decides
            if v[key] == "auto":
                v[key] = self.target_options.get(record.field, {}).get(key) or "auto"
        return scaling.Plan(**{k: (optional_float(x, TEXT_NUMBERS[k]) if k in TEXT_NUMBERS else x)
                               for k, x in v.items() if k not in TARGET_FIELDS})

    @property
    def outcome(self) -> scaling.Outcome:
        """What the setup does, as the form shows it: ``scaling.evaluate(self.plan)``, with the world
        size, global batch, scaled LR, warm-up, estimate and the warnings (errors block a launch)."""
        return scaling.evaluate(self.plan)

    def target_part(self, plan: scaling.Plan | None = None) -> dict:
        """The chosen target's JobSpec dict field as Launch fills it (``{"ssh": {"hosts": [...]}}``; {} for
        a target without one): its options given to JobSetup, the setup fields it copies (``plan_keys``)
        and its form fields that are filled. ValueError for a required field left empty."""
        plan = plan or self.plan
        record = targets.TARGETS[plan.target]
        if record.field is None:
            return {}
        part = dict(self.target_options.get(record.field, {}))
        for key in record.plan_keys:
            value = getattr(plan, key)
            if value != "auto" or key in part:  # set as a field, or given as an option
                part[key] = value
        for field in record.form:
            value = field.value(self._values[field.name])
            if value:
                part[field.key] = value
            elif field.required:
                raise ValueError(field.required)
        from sdp_jupyter.launch.spec import JobSpec

        return JobSpec.put_target_options({}, record.field, part)

    @property
    def hyperparameters(self) -> dict:
        """What the script receives: the setup's hyperparameters, then those passed to JobSetup()."""
        return {**self.outcome.hyperparameters(), **self.extra_hyperparameters}

    def _what_runs(self) -> dict:
        if self._cell is not None:
            return {"code": CELLS[self._cell]}
        if self._code is not None:
            return {"code": self._code}
        if self.script_path is not None:
            if not Path(self.script_path).is_file():
                raise ValueError(f"script {self.script_path!r} not found (from {Path.cwd()})")
            return {"script": self.script_path}
        raise ValueError("nothing to run: give JobSetup(script='train.py'), code=..., or cell='NAME' "
                         "(a cell stored with %%sdp_cell NAME)")

    @property
    def spec(self):
        """The JobSpec that Launch starts. ValueError (naming every reason) while the setup has errors."""
        from sdp_jupyter.launch import JobSpec

        out = self.outcome
        if not out.ok:
            raise ValueError("the setup cannot launch: " + "; ".join(str(e) for e in out.errors))
        plan = out.plan
        extra = self.target_part(plan)
        return JobSpec(
            **self._what_runs(),
            name=self.name,
            nodes=plan.nodes,
            procs_per_node=out.world_size // plan.nodes,
            backend=plan.backend,
            target=plan.target,
            hyperparameters=self.hyperparameters,
            jobs_dir=self.jobs_dir,
            **extra,
        )

    def magic_line(self, spec=None) -> str:
        """The `%%sdp_train ...` line (plus, for a script, the line that runs it) reproducing this job."""
        spec = spec or self.spec
        line = spec.to_magic_line()
        if spec.script is not None:
            # %%sdp_train runs a cell's code: the cell body runs the script as __main__, args included
            return line + f"\nimport runpy; runpy.run_path({str(spec.script)!r}, run_name='__main__')"
        return line

    @property
    def running(self) -> bool:
        """True while the job last launched from this setup has not ended."""
        return self.job is not None and not self.job.done

    # ------------------------------------------------------------------ launching
    def launch(self):
        """Start the job through the launcher. Returns the Job; when it ends, its measured throughput
        (if the script reported samples) is read into ``measured``."""
        spec = self.spec
        launch_job = self.launch_job
        if launch_job is None:
            from sdp_jupyter.launch import launch as launch_job
        self.measured, self.measure_error, self.measured_from, self.launch_error = None, None, None, None
        try:
            job = launch_job(spec)
        except Exception as e:
            self.launch_error = str(e)
            self._changed()
            raise
        self.job = job
        self._changed()
        job.on_done(self._job_done)
        return job

    def _job_done(self, job) -> None:  # called from the launcher's supervisor thread
        if job is self.job and job.state == "succeeded":
            self.measure(job)
        else:
            self._changed()

    def measure(self, job_or_dir) -> tuple[float, int] | None:
        """Read the throughput a finished job reported and offer it for the estimate."""
        self.measured_from = job_or_dir
        try:
            self.measured, self.measure_error = measured_throughput(job_or_dir), None
        except Exception as e:  # no metrics reader, unreadable files: the estimate stays as entered
            self.measured, self.measure_error = None, repr(e)
        if self.measured is not None:
            per_rank, ranks = self.measured
            self.measurements[ranks] = per_rank
        self._changed()
        return self.measured

    def measured_efficiency(self) -> tuple[float, int] | None:
        """(efficiency, N) from this setup's measured 1-rank job and its largest measured N-rank job."""
        many = [n for n in self.measurements if n > 1]
        if 1 not in self.measurements or not many:
            return None
        n = max(many)
        return scaling.measured_efficiency(self.measurements[1], self.measurements[n]), n

    def use_measured(self) -> None:
        """Put the measurements into the estimate.

        With a 1-rank job measured, its rate is the one-GPU throughput, and with an N-rank job too, their
        ratio becomes the scaling efficiency (capped at 1). With N-rank jobs only, the rate (which already
        carries the communication) is divided by the efficiency the estimate multiplies by, so that at
        the measured world size the estimate gives back the measured rate instead of counting the
        communication twice."""
        if self.measured is None:
            return
        eff = self.measured_efficiency()
        if 1 in self.measurements:
            changes = {"throughput_per_gpu": f"{self.measurements[1]:.6g}"}
            if eff is not None:
                changes["scaling_efficiency"] = round(min(1.0, eff[0]), 4)
            self.set(**changes)
            return
        per_rank, _ranks = self.measured
        efficiency = self._values["scaling_efficiency"]
        efficiency = efficiency if efficiency > 0 else 1.0
        self.set(throughput_per_gpu=f"{per_rank / efficiency:.6g}")

    # ------------------------------------------------------------------ views
    def observe(self, listener: Callable[["JobSetup"], None]) -> None:
        """Call ``listener(setup)`` after every change: a field, what runs, a launch, a job's end, a
        measurement (from the launcher's thread for the last two)."""
        self._listeners.append(listener)

    def _changed(self) -> None:
        for listener in list(self._listeners):
            listener(self)

    def view(self):
        """The form over this setup (one per setup, so every display of it stays in step)."""
        if self._view is None:
            from sdp_jupyter.ui.setup import JobSetupView

            self._view = JobSetupView(self)
        return self._view

    def summary(self) -> str:
        """What the form shows, as text: the magic line, or why it cannot launch, and the warnings."""
        try:
            out = self.outcome
        except ValueError as e:
            return f"JobSetup: cannot launch: {e}"
        lines = [f"- {w.level}: {w.message} {w.advice}".rstrip() for w in out.warnings]
        try:
            head = self.magic_line()
        except ValueError as e:
            head = f"cannot launch: {e}"
        if out.global_batch is not None:
            head = (f"global batch {out.global_batch}, learning rate {out.lr:.6g}, "
                    f"{out.iterations_per_epoch} iterations / epoch\n{head}")
        return "\n".join(["JobSetup: " + head, *lines])

    def __repr__(self) -> str:
        return f"<JobSetup {self._values['target']} nodes={self._values['nodes']}>"


# --------------------------------------------------------------------------- the magics' side
# (%sdp_setup's options, one per field, are sdp_jupyter/jobsetup/setup_options.py's; here a line of them becomes a setup)
def setup_from_options(values: dict) -> JobSetup:
    """A JobSetup from parsed `%sdp_setup` options (argparse dests; None = not given)."""
    kwargs = {k: v for k, v in values.items() if v is not None}
    kwargs = renamed(kwargs, "%sdp_setup --gpus-per-node")
    for flag in ("batchnorm", "drop_last"):
        if flag in kwargs:
            kwargs[flag] = kwargs[flag] == "yes"
    return JobSetup(**kwargs)  # the targets' form fields (--hosts, --partition, ...) are JobSetup keywords


def _target_fields(given: dict) -> tuple[dict, dict]:
    """Take the targets' keywords out of JobSetup's `given`: ({JobSpec dict field: options not on the form},
    {form field: its text}). A dict's key that is a form field's fills that field; a key the target does
    not take is refused (TypeError naming the ones it takes)."""
    options: dict[str, dict] = {}
    form = {f.name: "" for _target, f in targets.form_fields()}
    for record in targets.TARGETS.values():
        if record.field is None or record.field not in given:
            continue
        opts = dict(given.pop(record.field) or {})
        known = [f.key for f in record.form] + sorted((record.keys or set()) - {f.key for f in record.form})
        unknown = sorted(set(opts) - set(known)) if record.keys is not None else []
        if unknown:
            raise TypeError(f"JobSetup({record.field}=...) got unknown {record.name} option(s) {', '.join(unknown)}; "
                            f"known: {', '.join(known)}")
        for field in record.form:
            if field.key in opts:
                value = opts.pop(field.key)
                form[field.name] = ",".join(value) if isinstance(value, (list, tuple)) else str(value or "")
        options[record.field] = opts
    for name in [k for k in given if k in form]:
        form[name] = str(given.pop(name) or "")
    return options, form


def setup_from_line(line: str) -> JobSetup:
    """Parse a `%sdp_setup` line into a JobSetup. ValueError with the usage on a bad option."""
    parser = argparse.ArgumentParser(prog="%sdp_setup", add_help=False,
                                     description="Show the job setup form, preset from these options.")
    for flags, kw in setup_arguments():
        parser.add_argument(*flags, **kw)
    try:
        ns = parser.parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(f"bad %sdp_setup options {line!r}; usage: {parser.format_usage().strip()}") from None
    return setup_from_options(vars(ns))


def store_cell(name: str, cell: str) -> str:
    """What `%%sdp_cell NAME` does: check the code compiles, keep it under NAME (for JobSetup(cell=NAME)
    and `%sdp_setup --cell NAME`); returns the line to show. ValueError for a bad name, SyntaxError."""
    if not name.isidentifier():
        raise ValueError(f"%%sdp_cell needs a name (letters, digits, _), got {name!r}. Fix: %%sdp_cell train")
    compile(cell, f"<cell {name}>", "exec")  # a syntax error is reported now, with its line
    CELLS[name] = cell
    return f"stored cell {name!r} ({len(cell.splitlines())} lines): sdp_jupyter.JobSetup(cell={name!r})"
