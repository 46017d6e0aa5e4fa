"""JobSetup: the form where a user picks where and how to train, and sees what it does before launching.

    setup = sdp_jupyter.JobSetup("train.py", nodes=2, per_gpu_batch=64, reference_lr=0.05)
    setup             # the form: live global batch, scaled LR, iterations, time and cost, warnings
    setup.spec        # the JobSpec the Launch button would start (hyperparameters included)
    setup.launch()    # what the Launch button does: sdp_jupyter.launch(setup.spec), job view below

Every number comes from ``sdp_jupyter.scaling.evaluate``; this module only draws it. The chosen
hyperparameters reach the script as SageMaker passes them: ``--key value`` arguments and ``SM_HPS``
(the launcher does both from ``JobSpec.hyperparameters``), so one script reads them the same way
locally and on SageMaker.

What runs is a file (``script=``), code (``code=``), or a cell stored by name with ``%%sdp_cell NAME``
(``cell=``): ``%%sdp_cell`` keeps the cell's code without running it in the kernel.
"""
from __future__ import annotations

import argparse
import html
import shlex
from dataclasses import fields as dc_fields
from pathlib import Path

import ipywidgets as W

from sdp_jupyter import instances, scaling

#: code of cells stored with %%sdp_cell NAME, by name
CELLS: dict[str, str] = {}

_MODE_LABELS = {"keep per-GPU batch": "keep_per_gpu", "keep global batch": "keep_global"}
_LAYOUT = W.Layout(width="360px")
_STYLE = {"description_width": "170px"}


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _optional_float(text: str, label: str) -> float | None:
    """'' -> None; a number -> float; anything else -> ValueError naming the field."""
    text = text.strip()
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


class JobSetup(W.VBox):
    """The job setup form. Keyword arguments preset its fields (see ``scaling.Plan`` for their meaning).

    ``sagemaker`` holds the SageMaker target's other options (role, bucket, ...; see docs/launcher.md);
    the instance type comes from the form. ``ssh`` holds the SSH target's other options (python,
    config; see docs/ssh.md); its hosts come from the form's "SSH hosts" field. ``ray_address`` presets
    the form's "Ray address" field (empty: $RAY_ADDRESS, else auto; see docs/ray.md). ``launch_job`` replaces ``sdp_jupyter.launch`` (tests and
    other front-ends may pass their own).
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
        sagemaker: dict | None = None,
        ssh: dict | None = None,
        ray_address: str | None = None,
        launch_job=None,
        **plan_fields,
    ):
        known = {f.name for f in dc_fields(scaling.Plan)}
        unknown = sorted(set(plan_fields) - known)
        if unknown:
            raise TypeError(f"JobSetup() got unknown field(s) {', '.join(unknown)}; known: script, code, cell, "
                            f"name, hyperparameters, jobs_dir, sagemaker, ssh, ray_address, {', '.join(sorted(known))}")
        self._updating = False
        self._set_what_runs(script, code, cell)
        self.name = name
        self.extra_hyperparameters = dict(hyperparameters or {})
        self.jobs_dir = jobs_dir
        self.sagemaker_options = dict(sagemaker or {})  # JobSpec.sagemaker (role, bucket, ...) for that target
        self.ssh_options = {k: v for k, v in (ssh or {}).items() if k != "hosts"}  # JobSpec.ssh: python, config
        ssh_hosts = (ssh or {}).get("hosts") or []
        self._launch_job = launch_job
        self.job = None
        preset = scaling.Plan(**plan_fields)  # validates the choices (ValueError names the field)
        if preset.target == "sagemaker" and preset.instance_type == instances.LOCAL:
            preset = scaling.Plan(**{**plan_fields, "instance_type": "ml.p4d.24xlarge"})

        def num(cls, label, value, **kw):
            return cls(value=value, description=label, style=_STYLE, layout=_LAYOUT, **kw)

        self.w_target = W.ToggleButtons(options=list(scaling.TARGETS), value=preset.target, description="target",
                                        style={"description_width": "170px", "button_width": "90px"})
        self.w_instance = W.Dropdown(options=self._instance_options(preset.target), description="instance type",
                                     style=_STYLE, layout=W.Layout(width=_LAYOUT.width))  # its own: it is hidden for ssh
        self.w_instance.value = preset.instance_type if preset.target == "sagemaker" else instances.LOCAL
        self.w_instance_info = W.HTML()
        self.w_hosts = W.Text(value=",".join(ssh_hosts) if isinstance(ssh_hosts, list) else str(ssh_hosts),
                              placeholder="gpu1,gpu2 (as `ssh HOST` reaches them)", description="SSH hosts",
                              style=_STYLE, layout=W.Layout(width=_LAYOUT.width))
        self.w_hosts.add_class("sdp-ssh-hosts")
        self.w_address = W.Text(value=ray_address or "", placeholder="$RAY_ADDRESS, else auto (HOST:6379, ray://...)",
                                description="Ray address", style=_STYLE, layout=W.Layout(width=_LAYOUT.width))
        self.w_address.add_class("sdp-ray-address")
        self.w_nodes = num(W.BoundedIntText, "nodes", preset.nodes, min=1, max=4096)
        self.w_gpus = num(W.BoundedIntText, "GPUs (processes) / node", preset.gpus_per_node, min=1, max=64)
        self.w_backend = W.Dropdown(options=list(scaling.BACKENDS), value=preset.backend, description="backend",
                                    style=_STYLE, layout=_LAYOUT)
        mode_label = {v: k for k, v in _MODE_LABELS.items()}[preset.mode]
        self.w_mode = W.ToggleButtons(options=list(_MODE_LABELS), value=mode_label, description="when scaling",
                                      style={"description_width": "170px", "button_width": "150px"})
        self.w_per_gpu = num(W.BoundedIntText, "per-GPU batch", preset.per_gpu_batch, min=0, max=1 << 20)
        self.w_ref_lr = num(W.FloatText, "reference LR", preset.reference_lr)
        self.w_ref_batch = num(W.BoundedIntText, "reference batch", preset.reference_batch, min=0, max=1 << 24)
        self.w_rule = W.Dropdown(options=list(scaling.RULES), value=preset.rule, description="LR scaling rule",
                                 style=_STYLE, layout=_LAYOUT)
        self.w_warmup = W.Text(value="" if preset.warmup_epochs is None else f"{preset.warmup_epochs:g}",
                               placeholder="auto (suggested)", description="warm-up epochs",
                               style=_STYLE, layout=_LAYOUT)
        self.w_epochs = num(W.BoundedIntText, "epochs", preset.epochs, min=0, max=100_000)
        self.w_dataset = num(W.BoundedIntText, "dataset size (samples)", preset.dataset_size, min=0, max=10**12)
        self.w_optimizer = W.Dropdown(options=list(scaling.OPTIMIZERS), value=preset.optimizer,
                                      description="optimizer", style=_STYLE, layout=_LAYOUT)
        self.w_batchnorm = W.Checkbox(value=preset.batchnorm, description="model uses BatchNorm", indent=False)
        self.w_throughput = W.Text(value="" if preset.throughput_per_gpu is None else f"{preset.throughput_per_gpu:g}",
                                   placeholder="samples/s, measured", description="throughput / GPU",
                                   style=_STYLE, layout=_LAYOUT)
        self.w_efficiency = num(W.BoundedFloatText, "scaling efficiency", preset.scaling_efficiency,
                                min=0.0, max=1.0, step=0.05)
        self.w_efficiency.tooltip = scaling.DEFAULT_SCALING_EFFICIENCY_SOURCE
        self.w_price = W.Text(value="" if preset.price_per_hour is None else f"{preset.price_per_hour:g}",
                              placeholder="unknown", description="USD per node-hour", style=_STYLE, layout=_LAYOUT)
        self._cpus = preset.cpus

        self.w_global = W.HTML().add_class("sdp-global-batch")
        self.w_lr = W.HTML().add_class("sdp-lr")
        self.w_hints = W.HTML().add_class("sdp-hints")
        self.w_warnings = W.HTML().add_class("sdp-warnings")
        self.w_magic = W.HTML().add_class("sdp-magic-line")
        self.w_launch = W.Button(description="Launch", button_style="success", icon="play").add_class("sdp-launch")
        self.w_reason = W.HTML().add_class("sdp-launch-reason")
        self.w_status = W.HTML().add_class("sdp-job-status")
        self.w_job = W.VBox().add_class("sdp-job-view")
        self.w_measured = W.HTML().add_class("sdp-measured")
        self.w_use_measured = W.Button(description="use as throughput / GPU", icon="tachometer",
                                       layout=W.Layout(display="none", width="auto")).add_class("sdp-use-measured")
        self.w_use_measured.on_click(lambda _b: self.use_measured())
        self.measured = None  # (samples/s per rank, ranks) from the last job, if it reported samples
        self.measurements: dict[int, float] = {}  # ranks -> samples/s per rank, every measured job of this form
        self.w_nodes.add_class("sdp-nodes")

        inputs = [self.w_target, self.w_instance, self.w_hosts, self.w_address, self.w_nodes, self.w_gpus, self.w_backend, self.w_mode,
                  self.w_per_gpu, self.w_ref_lr, self.w_ref_batch, self.w_rule, self.w_warmup, self.w_epochs,
                  self.w_dataset, self.w_optimizer, self.w_batchnorm, self.w_throughput, self.w_efficiency,
                  self.w_price]
        for w in inputs:
            w.observe(self._changed, names="value")
        self.w_launch.on_click(lambda _b: self.launch())

        left = W.VBox([W.HTML("<b>Where</b>"), self.w_target, self.w_instance, self.w_instance_info, self.w_hosts,
                       self.w_address, self.w_nodes,
                       self.w_gpus, self.w_backend, W.HTML("<b>Batch and learning rate</b>"), self.w_mode,
                       self.w_per_gpu, self.w_ref_lr, self.w_ref_batch, self.w_rule, self.w_warmup,
                       self.w_optimizer, self.w_batchnorm])
        efficiency_note = W.HTML(f"<small>an assumption; default {scaling.DEFAULT_SCALING_EFFICIENCY:g}: "
                                 f"{html.escape(scaling.DEFAULT_SCALING_EFFICIENCY_SOURCE)}</small>")
        right = W.VBox([W.HTML("<b>Data and budget</b>"), self.w_epochs, self.w_dataset, self.w_throughput,
                        self.w_efficiency, efficiency_note, self.w_price, W.HTML("<b>What this does</b>"), self.w_global, self.w_lr,
                        self.w_hints])
        super().__init__([W.HBox([left, right]), self.w_warnings, self.w_magic,
                          W.HBox([self.w_launch, self.w_reason]), self.w_status,
                          W.HBox([self.w_measured, self.w_use_measured]), self.w_job])
        self.add_class("sdp-job-setup")
        self._refresh()

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
        self._refresh()
        return self

    # ------------------------------------------------------------------ reading the form
    @staticmethod
    def _instance_options(target: str) -> list[str]:
        return list(instances.catalogue()) if target == "sagemaker" else [instances.LOCAL]

    def _read_plan(self) -> scaling.Plan:
        """The form as a Plan; ValueError for a field that is not a number."""
        return scaling.Plan(
            target=self.w_target.value,
            instance_type=self.w_instance.value,
            nodes=self.w_nodes.value,
            gpus_per_node=self.w_gpus.value,
            backend=self.w_backend.value,
            engine=self.sagemaker_options.get("engine") or "auto",
            mode=_MODE_LABELS[self.w_mode.value],
            per_gpu_batch=self.w_per_gpu.value,
            reference_lr=self.w_ref_lr.value,
            reference_batch=self.w_ref_batch.value,
            rule=self.w_rule.value,
            warmup_epochs=_optional_float(self.w_warmup.value, "warm-up epochs"),
            epochs=self.w_epochs.value,
            dataset_size=self.w_dataset.value,
            optimizer=self.w_optimizer.value,
            batchnorm=self.w_batchnorm.value,
            throughput_per_gpu=_optional_float(self.w_throughput.value, "throughput / GPU"),
            scaling_efficiency=self.w_efficiency.value,
            price_per_hour=_optional_float(self.w_price.value, "USD per node-hour"),
            cpus=self._cpus,
        )

    @property
    def ssh_hosts(self) -> list[str]:
        """The "SSH hosts" field as a list; ValueError when the target is ssh and it is empty."""
        hosts = [h.strip() for h in self.w_hosts.value.split(",") if h.strip()]
        if not hosts and self.w_target.value == "ssh":
            raise ValueError("SSH hosts: enter the host names, e.g. gpu1,gpu2")
        return hosts

    @property
    def plan(self) -> scaling.Plan:
        return self._read_plan()

    @property
    def outcome(self) -> scaling.Outcome:
        return scaling.evaluate(self._read_plan())

    @property
    def hyperparameters(self) -> dict:
        """What the script receives: the form's hyperparameters, then those passed to JobSetup()."""
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
        """The JobSpec that Launch starts. ValueError (naming every reason) while the form has errors."""
        from sdp_jupyter.launch import JobSpec

        out = self.outcome
        if not out.ok:
            raise ValueError("the setup cannot launch: " + "; ".join(str(e) for e in out.errors))
        plan = out.plan
        extra = {}
        if plan.target == "sagemaker":
            extra["sagemaker"] = {**self.sagemaker_options, "instance_type": plan.instance_type}
        if plan.target == "ssh":
            extra["ssh"] = {**self.ssh_options, "hosts": self.ssh_hosts}
        if plan.target == "ray" and self.w_address.value.strip():
            extra["ray"] = {"address": self.w_address.value.strip()}
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

    # ------------------------------------------------------------------ drawing
    def _changed(self, change):
        if self._updating:  # a change made by _changed/_refresh themselves
            return
        self._updating = True
        try:
            self._apply(change)
        finally:
            self._updating = False
        self._refresh()

    def _apply(self, change) -> None:
        if change["owner"] is self.w_target:
            self.w_instance.options = self._instance_options(change["new"])
            if change["new"] != "sagemaker":
                self.w_instance.value = instances.LOCAL
                self.w_gpus.value = max(1, instances.get(instances.LOCAL).gpus)
            else:
                self.w_instance.value = "ml.p4d.24xlarge"

    def _refresh(self) -> None:
        self._updating = True
        try:
            self._redraw()
        finally:
            self._updating = False

    def _redraw(self) -> None:
        sagemaker = self.w_target.value == "sagemaker"
        inst = instances.get(self.w_instance.value)
        info = inst.describe()
        if sagemaker:  # who serves smddp on this type with --engine auto (docs/sagemaker.md, Engine)
            info += f"; smddp (engine auto): {instances.ENGINE_NAMES[inst.smddp_engine]}"
        self.w_instance_info.value = f"<small>{html.escape(info)}</small>"
        self.w_hosts.layout.display = None if self.w_target.value == "ssh" else "none"
        self.w_address.layout.display = None if self.w_target.value == "ray" else "none"
        self.w_instance.layout.display = "none" if self.w_target.value in ("ssh", "ray") else None
        self.w_instance_info.layout.display = self.w_instance.layout.display
        if sagemaker:
            self.w_gpus.value = max(1, inst.gpus)
        self.w_gpus.disabled = sagemaker
        if not sagemaker and not self.w_price.value:
            self.w_price.placeholder = "n/a for local"
        elif sagemaker:
            self.w_price.placeholder = "unknown (no checked price)" if inst.price_per_hour_usd is None \
                else f"{inst.price_per_hour_usd:g} (catalogue)"
        self.w_per_gpu.disabled = _MODE_LABELS[self.w_mode.value] == "keep_global"
        try:
            out = scaling.evaluate(self._read_plan())
        except ValueError as e:
            self._show_blocked([html.escape(str(e))])
            self.w_global.value = self.w_lr.value = self.w_hints.value = self.w_magic.value = ""
            return
        self._show(out)

    def _show(self, out: scaling.Outcome) -> None:
        if out.global_batch is not None:
            self.w_global.value = (f"global batch <b>{out.global_batch}</b> = {out.plan.nodes} nodes x "
                                   f"{out.world_size // out.plan.nodes} GPUs x {out.per_gpu_batch} per GPU")
            k = out.global_batch / out.plan.reference_batch
            self.w_lr.value = (f"learning rate <b>{out.lr:.6g}</b> ({out.plan.rule} rule: x{out.lr / out.plan.reference_lr:.4g}"
                               f" for {k:.4g} x the reference batch {out.plan.reference_batch})")
            rows = [("world size", f"{out.world_size} processes"),
                    ("iterations / epoch", f"{out.iterations_per_epoch}"),
                    ("warm-up", f"{out.warmup.epochs:g} epochs = {out.warmup.steps} steps, "
                                f"{out.warmup.start_lr:.6g} -> {out.warmup.target_lr:.6g}"
                     if out.warmup.steps else "none")]
            est = out.estimate
            if est is None:
                rows.append(("time / cost", "enter a measured throughput per GPU to estimate"))
            else:
                cost = (f"${est.cost_per_epoch:,.2f} / epoch, ${est.cost_per_run:,.2f} / run"
                        if est.cost_per_run is not None else "unknown (enter USD per node-hour)")
                rows += [("time", f"{_duration(est.epoch_seconds)} / epoch, {_duration(est.run_seconds)} / run"),
                         ("cost", cost), ("assuming", est.assumptions)]
            self.w_hints.value = "<table>" + "".join(
                f"<tr><td style='padding-right:1em'>{k}</td><td>{html.escape(v)}</td></tr>" for k, v in rows) + "</table>"
        else:
            self.w_global.value = self.w_lr.value = self.w_hints.value = ""
        items = []
        for w in out.warnings:
            colour = "#b00020" if w.level == scaling.ERROR else "#8a5a00"
            items.append(f"<li style='color:{colour}' data-code='{w.code}'><b>{w.level}</b>: "
                         f"{html.escape(w.message)} <i>{html.escape(w.advice)}</i></li>")
        self.w_warnings.value = f"<ul>{''.join(items)}</ul>" if items else ""
        if out.ok:
            try:
                spec = self.spec
            except ValueError as e:  # nothing to run, or a value the JobSpec rejects
                self._show_blocked([html.escape(str(e))])
                self.w_magic.value = ""
                return
            line = self.magic_line(spec)
            missing = {k: v for k, v in spec.sagemaker.items() if f"--{k.replace('_', '-')}" not in line}
            note = ("<br><small>plus the SageMaker options the line does not carry: "
                    + html.escape(", ".join(f"{k}={v}" for k, v in missing.items())) + "</small>") if missing else ""
            self.w_magic.value = ("<small>the same job from a cell (the training code goes below this line):</small>"
                                  f"<pre style='white-space:pre-wrap'>{html.escape(line)}</pre>{note}")
            self.w_launch.disabled = False
            self.w_reason.value = ""
        else:
            self.w_magic.value = ""
            self._show_blocked([html.escape(str(e)) for e in out.errors])

    def _show_blocked(self, reasons: list[str]) -> None:
        self.w_launch.disabled = True
        self.w_reason.value = "<span style='color:#b00020'>Launch is off: " + "; ".join(reasons) + "</span>"

    def magic_line(self, spec=None) -> str:
        """The `%%sdp_train ...` line (plus, for a script, the line that runs it) reproducing this job."""
        spec = spec or self.spec
        line = spec.to_magic_line()
        if spec.script is not None:
            # %%sdp_train runs a cell's code: the cell body runs the script as __main__, args included
            return line + f"\nimport runpy; runpy.run_path({str(spec.script)!r}, run_name='__main__')"
        return line

    # ------------------------------------------------------------------ launching
    def launch(self):
        """Start the job through the launcher and show its live view below the form. Returns the Job."""
        spec = self.spec
        launch_job = self._launch_job
        if launch_job is None:
            from sdp_jupyter.launch import launch as launch_job
        self.w_launch.disabled = True
        self.measured = None
        self.w_measured.value = ""
        self.w_use_measured.layout.display = "none"
        try:
            job = launch_job(spec)
        except Exception as e:
            self.w_status.value = f"<span style='color:#b00020'>launch failed: {html.escape(str(e))}</span>"
            self._refresh()
            raise
        self.job = job
        self._show_state(job)
        try:
            view = job.view()
        except Exception as e:  # the job runs; only its view is missing
            view = W.HTML(f"<small>(no live view: {html.escape(repr(e))})</small>")
        self.w_job.children = [view]
        job.on_done(self._job_done)
        return job

    def _show_state(self, job) -> None:
        state = job.state
        colour = {"succeeded": "#1b5e20", "failed": "#b00020", "stopped": "#8a5a00"}.get(state, "#333")
        text = f"job <b>{html.escape(job.name)}</b>: <span style='color:{colour}' class='sdp-state'>{state}</span>"
        if job.error:
            text += f"<pre>{html.escape(job.error)}</pre>"
        self.w_status.value = text

    def _job_done(self, job) -> None:  # called from the launcher's supervisor thread
        self._show_state(job)
        if job.state == "succeeded":
            self.measure(job)
        self._refresh()

    def measure(self, job_or_dir) -> tuple[float, int] | None:
        """Read the throughput a finished job reported and offer it for the estimate."""
        try:
            self.measured = measured_throughput(job_or_dir)
        except Exception as e:  # no metrics reader, unreadable files: the estimate stays as entered
            self.w_measured.value = f"<small>(throughput not measured: {html.escape(repr(e))})</small>"
            return None
        if self.measured is None:
            self.w_measured.value = ("<small>no throughput measured: call sdp_jupyter.report(samples=...) "
                                     "in the training loop to get one</small>")
            self.w_use_measured.layout.display = "none"
        else:
            per_rank, ranks = self.measured
            self.measurements[ranks] = per_rank
            text = f"measured <b>{per_rank:,.0f}</b> samples/s per GPU on {ranks} ranks (communication included)"
            eff = self.measured_efficiency()
            if eff is not None:
                text += (f"; scaling efficiency {eff[0]:.2f} at {eff[1]} ranks vs 1 rank alone"
                         + (" (above 1: noise or a cache effect; 1 is used)" if eff[0] > 1 else ""))
            self.w_measured.value = text
            self.w_use_measured.layout.display = None
        return self.measured

    def measured_efficiency(self) -> tuple[float, int] | None:
        """(efficiency, N) from this form's measured 1-rank job and its largest measured N-rank job."""
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
            self.w_throughput.value = f"{self.measurements[1]:.6g}"
            if eff is not None:
                self.w_efficiency.value = round(min(1.0, eff[0]), 4)
            return
        per_rank, ranks = self.measured
        efficiency = self.w_efficiency.value if self.w_efficiency.value > 0 else 1.0
        self.w_throughput.value = f"{per_rank / efficiency:.6g}"



# --------------------------------------------------------------------------- magics
def setup_arguments() -> list[tuple[tuple, dict]]:
    """`%sdp_setup`'s options as (flags, argparse keywords): one per JobSetup keyword
    (``--per-gpu-batch 64``), plus the script and ``--cell``. The magic (magics.py, built with
    magic_arguments) and `setup_from_line` both take them from here."""
    rows: list[tuple[tuple, dict]] = [
        (("script",), {"nargs": "?", "help": "training script (.py); or use --cell NAME"}),
        (("--cell",), {"help": "a cell stored with %%sdp_cell NAME"}),
        (("--name",), {"help": "job name"}),
    ]
    for f in dc_fields(scaling.Plan):
        if f.name == "cpus":
            continue
        flag = "--" + f.name.replace("_", "-")
        if f.name in ("batchnorm", "drop_last"):
            rows.append(((flag,), {"dest": f.name, "choices": ("yes", "no"), "help": f"{f.name}: yes or no"}))
        elif f.type in ("int", int):
            rows.append(((flag,), {"dest": f.name, "type": int}))
        elif "float" in str(f.type):
            rows.append(((flag,), {"dest": f.name, "type": float}))
        else:
            rows.append(((flag,), {"dest": f.name}))
    return rows


def setup_from_options(values: dict) -> JobSetup:
    """A JobSetup from parsed `%sdp_setup` options (argparse dests; None = not given)."""
    kwargs = {k: v for k, v in values.items() if v is not None}
    for flag in ("batchnorm", "drop_last"):
        if flag in kwargs:
            kwargs[flag] = kwargs[flag] == "yes"
    return JobSetup(**kwargs)


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
