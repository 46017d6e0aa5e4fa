"""The model-parallel advisor as a widget: a view over ``sdp_jupyter.advisor`` (which works without
a notebook). Every change of a knob re-estimates at once; "Recommend" walks the guide's ladder from
the knobs as they are and sets the ones it chose; "Explain" says why each knob that is on is there.

    from sdp_jupyter.ui.advisor import AdvisorView
    AdvisorView.from_reference("GPT-2 60B")          # or AdvisorView(workload, cluster, config)
"""
from __future__ import annotations

import html

import ipywidgets as W

from sdp_jupyter import advisor as A

_CUSTOM = "custom"


def _instance_types() -> list[str]:
    try:
        from sdp_jupyter import instances

        return sorted(n for n, i in instances.catalogue().items() if i.gpus and i.gpu_memory_gb)
    except ImportError:  # pragma: no cover - the catalogue ships with the package
        return []


class AdvisorView:
    """Knobs on the left, the per-GPU memory of the peak stage on the right."""

    def __init__(self, workload: A.Workload, cluster: A.Cluster,
                 config: A.ParallelConfig = A.ParallelConfig()):
        m = workload.model
        st = dict(description_width="150px")
        lay = W.Layout(width="300px")

        def num(desc, value, lo=1, hi=1 << 20):
            return W.BoundedIntText(value=value, min=lo, max=hi, description=desc, style=st, layout=lay)

        def pick(desc, options, value):
            return W.Dropdown(options=options, value=value, description=desc, style=st, layout=lay)

        refs = [r.name for r in A.REFERENCES]
        self.preset = pick("model", [_CUSTOM] + refs, m.name if m.name in refs else _CUSTOM)
        self.layers, self.hidden = num("layers", m.layers), num("hidden", m.hidden)
        self.heads, self.vocab = num("heads", m.heads), num("vocab", m.vocab)
        self.seq_len, self.batch = num("sequence length", workload.seq_len), num("batch / replica", workload.batch)
        self.precision = pick("precision", list(A.PRECISIONS), workload.precision)
        self.optimizer = pick("optimizer", list(A.OPTIMIZERS), workload.optimizer)
        types = _instance_types()
        itype = cluster.instance_type if cluster.instance_type in types else _CUSTOM
        self.instance = pick("instance type", [_CUSTOM] + types, itype)
        self.nodes = num("instances", cluster.nodes)
        self.gpus = num("GPUs per node", cluster.gpus_per_node)
        self.gpu_mem = W.BoundedFloatText(value=cluster.gpu_memory_gib, min=0.5, max=4096,
                                          description="GiB per GPU", style=st, layout=lay)
        self.tp, self.pp = num("tensor parallel", config.tp), num("pipeline parallel", config.pp)
        self.microbatches = num("microbatches", config.microbatches)
        self.active = num("active microbatches (0: no cap)", config.active_microbatches or 0, lo=0)
        self.schedule = pick("schedule", list(A.SCHEDULES), config.schedule)
        self.sharding = pick("sharding", list(A.SHARDING), config.sharding)
        self.checkpointing = pick("checkpointing", list(A.CHECKPOINTING), config.checkpointing)
        self.offload = W.Checkbox(value=config.offload_activations, description="offload activations")
        self.sp = W.Checkbox(value=config.sequence_parallel, description="sequence parallel")
        self.flash = W.Checkbox(value=config.flash_attention, description="flash attention")
        self.runtime = pick("memory accounting", list(A.RUNTIMES), config.runtime)
        self.allow_instance = W.Checkbox(value=False, description="recommend may change instance type")
        self.recommend_button = W.Button(description="Recommend", button_style="primary")
        self.explain_button = W.Button(description="Explain")
        self.result = W.HTML()
        self.notes = W.HTML()
        self._quiet = False
        self._ladder = ""
        knobs = [self.preset, self.layers, self.hidden, self.heads, self.vocab, self.seq_len, self.batch,
                 self.precision, self.optimizer, self.instance, self.nodes, self.gpus, self.gpu_mem,
                 self.tp, self.pp, self.microbatches, self.active, self.schedule, self.sharding,
                 self.checkpointing, self.offload, self.sp, self.flash, self.runtime]
        for w in knobs:
            w.observe(self._changed, names="value")
        self.recommend_button.on_click(lambda _: self.recommend())
        self.explain_button.on_click(lambda _: self.explain())
        left = W.VBox(knobs + [self.allow_instance, W.HBox([self.recommend_button, self.explain_button])])
        self.widget = W.HBox([left, W.VBox([self.result, self.notes], layout=W.Layout(width="640px"))])
        self._sync_instance()
        self.refresh()

    @classmethod
    def from_reference(cls, name: str) -> "AdvisorView":
        """The view preset with one of the advisor's reference jobs, by name (sdp_jupyter.advisor.REFERENCES,
        e.g. "GPT-2 60B"); StopIteration for a name that is not there."""
        r = next(r for r in A.REFERENCES if r.name == name)
        return cls(r.workload, r.cluster(), r.config)

    # -- the model behind the view
    @property
    def workload(self) -> A.Workload:
        """The model, sequence length, batch, precision and optimizer as the knobs stand (an advisor Workload)."""
        model = A.ModelShape(layers=self.layers.value, hidden=self.hidden.value, heads=self.heads.value,
                             vocab=self.vocab.value, name=self.preset.value if self.preset.value != _CUSTOM else "")
        return A.Workload(model, self.seq_len.value, self.batch.value, self.precision.value, self.optimizer.value)

    @property
    def cluster(self) -> A.Cluster:
        """GPUs per node, GPU memory, nodes and instance type as the knobs stand (an advisor Cluster)."""
        itype = None if self.instance.value == _CUSTOM else self.instance.value
        return A.Cluster(self.gpus.value, float(self.gpu_mem.value), self.nodes.value, itype)

    @property
    def config(self) -> A.ParallelConfig:
        """The parallelism knobs as they stand (an advisor ParallelConfig: tp, pp, microbatches, sharding, ...)."""
        return A.ParallelConfig(
            tp=self.tp.value, pp=self.pp.value, microbatches=self.microbatches.value,
            active_microbatches=self.active.value or None, sharding=self.sharding.value,
            checkpointing=self.checkpointing.value, offload_activations=self.offload.value,
            schedule=self.schedule.value, sequence_parallel=self.sp.value, flash_attention=self.flash.value,
            runtime=self.runtime.value)

    @property
    def estimate(self) -> A.Estimate:
        """sdp_jupyter.advisor.estimate of the knobs: per-GPU memory of every pipeline stage and the findings;
        ValueError for a shape the formula cannot take."""
        return A.estimate(self.workload, self.cluster, self.config)

    # -- events
    def _changed(self, change):
        if self._quiet:
            return
        owner = change["owner"]
        if owner is self.preset and self.preset.value != _CUSTOM:
            r = next(r for r in A.REFERENCES if r.name == self.preset.value)
            self.set(r.workload, r.cluster(), r.config)
            return
        if owner is self.instance:
            self._sync_instance()
        self._ladder = ""
        self.refresh()

    def _sync_instance(self):
        if self.instance.value == _CUSTOM:
            self.gpus.disabled = self.gpu_mem.disabled = False
            return
        c = A.Cluster.from_instance(self.instance.value, self.nodes.value)
        self._quiet = True
        try:
            self.gpus.value, self.gpu_mem.value = c.gpus_per_node, c.gpu_memory_gib
        finally:
            self._quiet = False
        self.gpus.disabled = self.gpu_mem.disabled = True

    def set(self, workload: A.Workload | None = None, cluster: A.Cluster | None = None,
            config: A.ParallelConfig | None = None) -> None:
        """Set knobs from the advisor's objects (one refresh at the end)."""
        self._quiet = True
        try:
            if workload is not None:
                m = workload.model
                for w, v in ((self.layers, m.layers), (self.hidden, m.hidden), (self.heads, m.heads),
                             (self.vocab, m.vocab), (self.seq_len, workload.seq_len),
                             (self.batch, workload.batch), (self.precision, workload.precision),
                             (self.optimizer, workload.optimizer)):
                    w.value = v
            if cluster is not None:
                if cluster.instance_type in self.instance.options:
                    self.instance.value = cluster.instance_type
                self.nodes.value, self.gpus.value = cluster.nodes, cluster.gpus_per_node
                self.gpu_mem.value = cluster.gpu_memory_gib
            if config is not None:
                for w, v in ((self.tp, config.tp), (self.pp, config.pp),
                             (self.microbatches, config.microbatches),
                             (self.active, config.active_microbatches or 0), (self.schedule, config.schedule),
                             (self.sharding, config.sharding), (self.checkpointing, config.checkpointing),
                             (self.offload, config.offload_activations), (self.sp, config.sequence_parallel),
                             (self.flash, config.flash_attention), (self.runtime, config.runtime)):
                    w.value = v
        finally:
            self._quiet = False
        self._sync_instance()
        self.refresh()

    def recommend(self) -> A.Recommendation:
        """What the Recommend button does: sdp_jupyter.advisor.recommend from the knobs as they are; sets
        the knobs it chose (when it found a configuration that fits), shows its reasoning and returns it."""
        rec = A.recommend(self.workload, self.cluster, self.config,
                          allow_instance_change=self.allow_instance.value)
        if rec.estimate is not None:
            self.set(rec.estimate.workload, rec.estimate.cluster, rec.estimate.config)
        self._ladder = rec.reasoning()
        self.notes.value = "<b>Recommendation</b><pre>" + html.escape(self._ladder) + "</pre>"
        return rec

    def explain(self) -> list[A.KnobReason]:
        """What the Explain button does: for every knob that is on, why (needed to fit, or what it buys);
        shows the list and returns it."""
        reasons = A.explain(self.workload, self.cluster, self.config)
        rows = "".join(f"<li><b>{html.escape(r.knob)}</b>: {html.escape(r.message)}</li>" for r in reasons)
        self.notes.value = "<b>Why each knob</b><ul>" + (rows or "<li>no knob is on</li>") + "</ul>"
        return reasons

    # -- drawing
    def refresh(self) -> None:
        """Redraw the estimate (verdict, memory per term, the %%sdp_train line) from the knobs; every knob
        change calls it."""
        try:
            e = self.estimate
        except ValueError as exc:  # a shape the formula cannot take (e.g. hidden % heads)
            self.result.value = f"<b style='color:#b00'>{html.escape(str(exc))}</b>"
            return
        self.result.value = render(e) + (
            "<div style='font-size:smaller'>run it: <code>%%sdp_train --nodes "
            f"{e.cluster.nodes} --procs-per-node {e.cluster.gpus_per_node} "
            f"{html.escape(e.config.env_options())}</code></div>")
        if not self._ladder:
            self.notes.value = ""

    def _ipython_display_(self):
        from IPython.display import display

        display(self.widget)


def render(e: A.Estimate) -> str:
    """HTML for an estimate: verdict, the peak stage's terms as bars against the budget, findings."""
    color = "#1a7f37" if e.ok else "#b00"
    verdict = "fits" if e.fits else "does NOT fit"
    scale = max(e.budget, e.peak, 1.0)
    rows = []
    for t in e.terms():
        width = 100.0 * t.bytes / scale
        phase = f" <i>({html.escape(t.phase)} phase)</i>" if t.phase else ""
        rows.append(f"<tr><td>{html.escape(t.name)}</td><td style='text-align:right'>{t.gib:.2f} GiB</td>"
                    f"<td><div style='background:#4c78a8;height:10px;width:{width:.1f}%'></div></td>"
                    f"<td style='font-size:smaller'>{html.escape(t.how)}{phase}</td></tr>")
    stages = ""
    if len(e.stages) > 1:
        stages = "<br>stages: " + ", ".join(f"{s.stage}: {s.total / A.GiB:.1f} GiB ({s.in_flight:g} in flight)"
                                          for s in e.stages)
        stages += f"<br>pipeline bubble {e.bubble:.0%}"
    findings = "".join(
        f"<li style='color:{'#b00' if f.level == 'error' else '#a60' if f.level == 'warning' else '#333'}'>"
        f"<b>{f.level}</b> {html.escape(f.knob)}: {html.escape(f.message)}"
        + (f" <i>Fix: {html.escape(f.fix)}</i>" if f.fix else "") + "</li>" for f in e.findings)
    return (f"<div><b style='color:{color}'>{e.peak_gib:.1f} GiB per GPU (stage {e.peak_stage.stage}) "
            f"{verdict}</b> in {e.budget / A.GiB:.1f} GiB ({e.headroom:.0%} of {e.cluster.gpu_memory_gib:g} GiB); "
            f"dp={e.dp}, global batch {e.global_batch}, {e.workload.model.params(e.workload.seq_len) / 1e9:.2f}B "
            f"parameters{stages}"
            f"<table style='width:100%'>{''.join(rows)}</table>"
            + (f"<ul>{findings}</ul>" if findings else "") + "</div>")
