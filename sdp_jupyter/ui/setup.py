"""The job setup form: a view over ``sdp_jupyter.JobSetup`` (``sdp_jupyter.jobsetup``, which works
without a notebook).

    setup = sdp_jupyter.JobSetup("train.py", nodes=2, per_gpu_batch=64, reference_lr=0.05)
    setup             # displays setup.view(): live global batch, scaled LR, iterations, time and cost, warnings

Each field writes the model (``setup.set(...)``); the form redraws from the model after every change,
whoever made it (a field, code, the Launch button, the launcher's thread when a job ends). Every number
comes from ``sdp_jupyter.scaling.evaluate``; this module only draws it.
"""
from __future__ import annotations

import html

import ipywidgets as W

from sdp_jupyter import backends, instances, scaling
from sdp_jupyter.launch import targets
from sdp_jupyter.jobsetup.model import TEXT_NUMBERS, JobSetup

_MODE_LABELS = {"keep per-GPU batch": "keep_per_gpu", "keep global batch": "keep_global"}
_LAYOUT = W.Layout(width="360px")
_STYLE = {"description_width": "170px"}


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def _as_text(value) -> str:
    """A number field's widget text: '' for None, a number as %g, text as typed."""
    if value is None:
        return ""
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


class JobSetupView(W.VBox):
    """Knobs on the left, what they do on the right; warnings, the magic line, Launch and the job below."""

    def __init__(self, model: JobSetup):
        self.model = model
        v = model.values
        self._updating = False
        self._shown_job = None

        def num(cls, label, value, **kw):
            return cls(value=value, description=label, style=_STYLE, layout=_LAYOUT, **kw)

        def text(label, value, placeholder, layout=_LAYOUT):
            return W.Text(value=_as_text(value), placeholder=placeholder, description=label, style=_STYLE,
                          layout=layout)

        self.w_target = W.ToggleButtons(options=list(scaling.TARGETS), value=v["target"], description="target",
                                        style={"description_width": "170px", "button_width": "90px"})
        self.w_instance = W.Dropdown(options=self._instance_options(v["target"]), value=v["instance_type"],
                                     description="instance type", style=_STYLE,
                                     layout=W.Layout(width=_LAYOUT.width))  # its own: it is hidden for ssh
        self.w_instance_info = W.HTML()
        # the fields each target adds (its record's `form`: SSH hosts, Ray address, Slurm's options), a box
        # per target shown while it is chosen; an empty field leaves the target's default
        self.w_form = {f.name: text(f.label, v[f.name], f.placeholder).add_class("sdp-" + f.name.replace("_", "-"))
                       for _target, f in targets.form_fields()}
        self.w_form_boxes = {name: W.VBox([self.w_form[f.name] for f in t.form], layout=W.Layout())
                             .add_class(f"sdp-target-{name}") for name, t in targets.TARGETS.items() if t.form}
        self.w_nodes = num(W.BoundedIntText, "nodes", v["nodes"], min=1, max=4096).add_class("sdp-nodes")
        self.w_gpus = num(W.BoundedIntText, "Processes / node (GPUs)", v["procs_per_node"], min=1, max=64)
        self.w_backend = W.Dropdown(options=list(backends.BACKENDS), value=v["backend"], description="backend",
                                    style=_STYLE, layout=_LAYOUT)
        mode_label = {m: label for label, m in _MODE_LABELS.items()}[v["mode"]]
        self.w_mode = W.ToggleButtons(options=list(_MODE_LABELS), value=mode_label, description="when scaling",
                                      style={"description_width": "170px", "button_width": "150px"})
        self.w_per_gpu = num(W.BoundedIntText, "per-GPU batch", v["per_gpu_batch"], min=0, max=1 << 20)
        self.w_ref_lr = num(W.FloatText, "reference LR", v["reference_lr"])
        self.w_ref_batch = num(W.BoundedIntText, "reference batch", v["reference_batch"], min=0, max=1 << 24)
        self.w_rule = W.Dropdown(options=list(scaling.RULES), value=v["rule"], description="LR scaling rule",
                                 style=_STYLE, layout=_LAYOUT)
        self.w_warmup = text("warm-up epochs", v["warmup_epochs"], "auto (suggested)")
        self.w_epochs = num(W.BoundedIntText, "epochs", v["epochs"], min=0, max=100_000)
        self.w_dataset = num(W.BoundedIntText, "dataset size (samples)", v["dataset_size"], min=0, max=10**12)
        self.w_optimizer = W.Dropdown(options=list(scaling.OPTIMIZERS), value=v["optimizer"],
                                      description="optimizer", style=_STYLE, layout=_LAYOUT)
        self.w_batchnorm = W.Checkbox(value=v["batchnorm"], description="model uses BatchNorm", indent=False)
        self.w_throughput = text("throughput / GPU", v["throughput_per_gpu"], "samples/s, measured")
        self.w_efficiency = num(W.BoundedFloatText, "scaling efficiency", v["scaling_efficiency"],
                                min=0.0, max=1.0, step=0.05)
        self.w_efficiency.tooltip = scaling.DEFAULT_SCALING_EFFICIENCY_SOURCE
        self.w_price = text("USD per node-hour", v["price_per_hour"], "unknown")

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
        self.w_use_measured.on_click(lambda _b: model.use_measured())
        self.w_launch.on_click(lambda _b: self.launch())

        # widget -> model field (and the widget value -> field value conversion)
        self._fields = {
            self.w_target: ("target", None), self.w_instance: ("instance_type", None),
            **{w: (name, None) for name, w in self.w_form.items()}, self.w_nodes: ("nodes", None),
            self.w_gpus: ("procs_per_node", None), self.w_backend: ("backend", None),
            self.w_mode: ("mode", _MODE_LABELS.__getitem__), self.w_per_gpu: ("per_gpu_batch", None),
            self.w_ref_lr: ("reference_lr", None), self.w_ref_batch: ("reference_batch", None),
            self.w_rule: ("rule", None), self.w_warmup: ("warmup_epochs", None), self.w_epochs: ("epochs", None),
            self.w_dataset: ("dataset_size", None), self.w_optimizer: ("optimizer", None),
            self.w_batchnorm: ("batchnorm", None), self.w_throughput: ("throughput_per_gpu", None),
            self.w_efficiency: ("scaling_efficiency", None), self.w_price: ("price_per_hour", None),
        }
        for w in self._fields:
            w.observe(self._edited, names="value")

        left = W.VBox([W.HTML("<b>Where</b>"), self.w_target, self.w_instance, self.w_instance_info,
                       *self.w_form_boxes.values(), self.w_nodes, self.w_gpus, self.w_backend,
                       W.HTML("<b>Batch and learning rate</b>"), self.w_mode, self.w_per_gpu, self.w_ref_lr,
                       self.w_ref_batch, self.w_rule, self.w_warmup, self.w_optimizer, self.w_batchnorm])
        efficiency_note = W.HTML(f"<small>an assumption; default {scaling.DEFAULT_SCALING_EFFICIENCY:g}: "
                                 f"{html.escape(scaling.DEFAULT_SCALING_EFFICIENCY_SOURCE)}</small>")
        right = W.VBox([W.HTML("<b>Data and budget</b>"), self.w_epochs, self.w_dataset, self.w_throughput,
                        self.w_efficiency, efficiency_note, self.w_price, W.HTML("<b>What this does</b>"),
                        self.w_global, self.w_lr, self.w_hints])
        super().__init__([W.HBox([left, right]), self.w_warnings, self.w_magic,
                          W.HBox([self.w_launch, self.w_reason]), self.w_status,
                          W.HBox([self.w_measured, self.w_use_measured]), self.w_job])
        self.add_class("sdp-job-setup")
        model.observe(lambda _m: self.redraw())
        self.redraw()

    @staticmethod
    def _instance_options(target: str) -> list[str]:
        return list(instances.catalogue()) if targets.TARGETS[target].catalogue else [instances.LOCAL]

    # ------------------------------------------------------------------ form -> model
    def _edited(self, change) -> None:
        if self._updating:  # the form being redrawn from the model
            return
        name, convert = self._fields[change["owner"]]
        try:
            self.model.set(**{name: convert(change["new"]) if convert else change["new"]})
        except (ValueError, KeyError) as e:  # a value no choice allows: say so, keep the model as it was
            self._show_blocked([html.escape(str(e))])

    def launch(self):
        """What the Launch button does: ``model.launch()``; a failure is shown in the form, and raised."""
        self.w_launch.disabled = True
        return self.model.launch()

    # ------------------------------------------------------------------ model -> form
    def redraw(self) -> None:
        self._updating = True
        try:
            self._sync_fields()
            self._draw()
            self._draw_job()
        finally:
            self._updating = False

    def _sync_fields(self) -> None:
        v = self.model.values
        if list(self.w_instance.options) != self._instance_options(v["target"]):
            self.w_instance.options = self._instance_options(v["target"])
        for w, (name, convert) in self._fields.items():
            value = v[name]
            if convert is not None:  # the mode's label
                value = next(label for label, m in _MODE_LABELS.items() if m == value)
            elif name in TEXT_NUMBERS:
                value = _as_text(value)
            if w.value != value:
                w.value = value

    def _draw(self) -> None:
        m, v = self.model, self.model.values
        record = targets.TARGETS[v["target"]]
        catalogue = record.catalogue  # SageMaker: instance types of the catalogue, priced
        inst = instances.get(v["instance_type"])
        info = inst.describe()
        if catalogue:  # who serves smddp on this type with --engine auto (docs/sagemaker.md, Engine)
            info += f"; smddp (engine auto): {instances.ENGINE_NAMES[inst.smddp_engine]}"
        self.w_instance_info.value = f"<small>{html.escape(info)}</small>"
        for name, box in self.w_form_boxes.items():
            box.layout.display = None if v["target"] == name else "none"
        self.w_instance.layout.display = "none" if record.own_hosts else None
        self.w_instance_info.layout.display = self.w_instance.layout.display
        self.w_gpus.disabled = catalogue
        if not catalogue:  # your own machines: no catalogue price
            self.w_price.placeholder = f"n/a for {v['target']}"
        else:
            self.w_price.placeholder = "unknown (no checked price)" if inst.price_per_hour_usd is None \
                else f"{inst.price_per_hour_usd:g} (catalogue)"
        self.w_per_gpu.disabled = v["mode"] == "keep_global"
        try:
            out = m.outcome
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
        if not out.ok:
            self.w_magic.value = ""
            self._show_blocked([html.escape(str(e)) for e in out.errors])
            return
        try:
            spec = self.model.spec
        except ValueError as e:  # nothing to run, or a value the JobSpec rejects
            self._show_blocked([html.escape(str(e))])
            self.w_magic.value = ""
            return
        line = self.model.magic_line(spec)
        record = targets.TARGETS[spec.target]
        given = spec.options_of(record.field) if record.field else {}
        missing = {k: v for k, v in given.items() if f"--{k.replace('_', '-')}" not in line}
        note = (f"<br><small>plus the {record.name} options the line does not carry: "
                + html.escape(", ".join(f"{k}={v}" for k, v in missing.items())) + "</small>") if missing else ""
        self.w_magic.value = ("<small>the same job from a cell (the training code goes below this line):</small>"
                              f"<pre style='white-space:pre-wrap'>{html.escape(line)}</pre>{note}")
        if self.model.running:
            self._show_blocked([f"job {html.escape(self.model.job.name)} is running (stop it or wait for it)"])
        else:
            self.w_launch.disabled = False
            self.w_reason.value = ""

    def _show_blocked(self, reasons: list[str]) -> None:
        self.w_launch.disabled = True
        self.w_reason.value = "<span style='color:#b00020'>Launch is off: " + "; ".join(reasons) + "</span>"

    def _draw_job(self) -> None:
        m, job = self.model, self.model.job
        if m.launch_error is not None and job is None:
            self.w_status.value = f"<span style='color:#b00020'>launch failed: {html.escape(m.launch_error)}</span>"
        elif job is not None:
            state = job.state
            colour = {"succeeded": "#1b5e20", "failed": "#b00020", "stopped": "#8a5a00"}.get(state, "#333")
            text = f"job <b>{html.escape(job.name)}</b>: <span style='color:{colour}' class='sdp-state'>{state}</span>"
            if m.launch_error is not None:
                text = f"<span style='color:#b00020'>launch failed: {html.escape(m.launch_error)}</span><br>" + text
            if job.error:
                text += f"<pre>{html.escape(job.error)}</pre>"
            self.w_status.value = text
            if job is not self._shown_job:
                self._shown_job = job
                try:
                    view = job.view()
                except Exception as e:  # the job runs; only its view is missing
                    view = W.HTML(f"<small>(no live view: {html.escape(repr(e))})</small>")
                self.w_job.children = [view]
        self._draw_measured()

    def _draw_measured(self) -> None:
        m = self.model
        self.w_use_measured.layout.display = "none"
        if m.measure_error is not None:
            self.w_measured.value = f"<small>(throughput not measured: {html.escape(m.measure_error)})</small>"
        elif m.measured is not None:
            per_rank, ranks = m.measured
            text = f"measured <b>{per_rank:,.0f}</b> samples/s per GPU on {ranks} ranks (communication included)"
            eff = m.measured_efficiency()
            if eff is not None:
                text += (f"; scaling efficiency {eff[0]:.2f} at {eff[1]} ranks vs 1 rank alone"
                         + (" (above 1: noise or a cache effect; 1 is used)" if eff[0] > 1 else ""))
            self.w_measured.value = text
            self.w_use_measured.layout.display = None
        elif m.measured_from is not None:
            self.w_measured.value = ("<small>no throughput measured: call sdp_jupyter.report(samples=...) "
                                     "in the training loop to get one</small>")
        else:
            self.w_measured.value = ""
