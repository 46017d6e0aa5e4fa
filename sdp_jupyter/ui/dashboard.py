"""Live monitoring dashboard: a plotly FigureWidget fed by sdp_jupyter.monitor.reader.

`dashboard(job_or_dir, reference=None)` returns a `Dashboard` (a `go.FigureWidget`) with six panels:
throughput over time (total and per rank), GPU or CPU utilization per node and device, loss per rank,
per-step compute vs exposed communication (and data wait), and per rank the share of time spent waiting
inside collectives and the share of collectives it came to last (a straggler's bar in red, named in the
header: sdp_jupyter.flight.stragglers). Its title is the header: current
samples/s, mean utilization (saying GPU or CPU), step / total and ETA, scaling efficiency against a
reference job, and an input-bound warning.

While the job runs, a background thread polls the reader every `interval` seconds (0.5: at most two
redraws a second) and redraws inside `batch_update()` only when events arrived; windows are bounded so
a long job costs the kernel what a short one does. The thread stops when the job has ended and its
last lines are drawn, or on `stop()` / `close()`. A finished job reopened from disk is drawn once.
`write_html(path)` (plotly's) saves a self-contained snapshot; `snapshot(job, path)` does it in one call.
"""
from __future__ import annotations

import contextlib
import math
import threading
import traceback
import weakref
from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from sdp_jupyter.monitor.reader import Frame, Reader

__all__ = ["Dashboard", "dashboard", "snapshot", "header_text"]

INPUT_BOUND_SHARE = 0.3   # data wait above this share of the step time flags the job as input-bound
BAR_STEPS = 200           # steps shown in the compute-vs-communication panel

_PANELS = {"throughput": (1, 1), "util": (1, 2), "loss": (2, 1), "steps": (2, 2), "waiting": (3, 1), "last": (3, 2)}
_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf"]


def _fmt_duration(s: float) -> str:
    s = int(round(s))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{sec:02d}s" if m else f"{sec}s")


def _fmt_rate(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _world(frame: Frame) -> int:
    return frame.world_size or len(frame.ranks) or 1


def scaling_efficiency(frame: Frame, ref: Frame) -> float | None:
    """(per-rank throughput of this job) / (per-rank throughput of the reference): 1.0 is linear."""
    mine = frame.steady_samples_per_s or frame.samples_per_s
    theirs = ref.steady_samples_per_s or ref.samples_per_s
    if not mine or not theirs:
        return None
    return (mine / _world(frame)) / (theirs / _world(ref))


def header_text(frame: Frame, name: str = "", ref: Frame | None = None, ref_name: str = "") -> str:
    """The header line(s), as plotly title HTML."""
    top = [f"<b>{name}</b>" if name else "<b>job</b>", frame.state or ("finished" if frame.done else "live")]
    if frame.last_step is not None:
        top.append(f"step {frame.last_step}" + (f" / {frame.total_steps}" if frame.total_steps else ""))
    if frame.eta_s is not None and not frame.done:
        top.append(f"ETA {_fmt_duration(frame.eta_s)}")
    second, third = [], []
    rate = frame.samples_per_s if not frame.done else (frame.steady_samples_per_s or frame.samples_per_s)
    second.append(f"{_fmt_rate(rate)} {frame.unit}" if rate else f"- {frame.unit}")
    if frame.mean_util is not None:
        label = "CPU util (no GPU)" if frame.util_kind == "CPU" else f"{frame.util_kind} util"
        second.append(f"mean {label} {frame.mean_util:.0f}%")
    if ref is not None:
        eff = scaling_efficiency(frame, ref)
        if eff is not None:
            second.append(f"scaling efficiency {eff:.2f} vs {ref_name or 'reference'} "
                          f"({_world(ref)}→{_world(frame)} ranks)")
    if frame.comm_share is not None:
        third.append(f"exposed comm {100 * frame.comm_share:.0f}% of step")
    if frame.input_bound is not None:
        if frame.input_bound >= INPUT_BOUND_SHARE:
            third.append(f"⚠ input-bound: {100 * frame.input_bound:.0f}% of step time waiting for data")
        else:
            third.append(f"data wait {100 * frame.input_bound:.0f}% of step")
    if frame.stragglers is not None and frame.stragglers.sentence:
        third.append(f"⚠ straggler: {frame.stragglers.sentence}")
    if frame.skipped_lines:
        third.append(f"⚠ {frame.skipped_lines} bad record{'s' if frame.skipped_lines != 1 else ''} skipped")
    return "<br>".join(" · ".join(part) for part in (top, second, third) if part)


class Dashboard(go.FigureWidget):
    """The live figure. Public helpers: `refresh()`, `stop()`, `frame`, `trace(name)`, `running`."""

    def __init__(self, source: Any, reference: Any = None, window: int = 600, interval: float = 0.5,
                 name: str | None = None, start: bool = True):
        fig = make_subplots(
            rows=3, cols=2, vertical_spacing=0.1, horizontal_spacing=0.08, row_heights=[0.38, 0.38, 0.24],
            subplot_titles=("Throughput (x: seconds since start)", "Utilization", "Loss", "Per step (s): compute, exposed comm, data wait",
                            "Per rank: share of time waiting inside collectives", "Per rank: share of collectives it came to last"))
        fig.update_layout(
            width=1000, height=900, margin=dict(t=130, l=60, r=20, b=40), barmode="stack", template="plotly_white",
            legend=dict(orientation="h", y=-0.08, x=0), title=dict(text="", x=0.01, y=0.97, font=dict(size=14)),
            uirevision="sdp")  # keep the user's zoom across redraws
        fig.update_xaxes(title_text="step", row=2, col=1)
        fig.update_xaxes(title_text="step", row=2, col=2)
        fig.update_yaxes(title_text="samples/s", rangemode="tozero", row=1, col=1)
        fig.update_yaxes(title_text="%", range=[0, 105], row=1, col=2)
        fig.update_yaxes(title_text="loss", row=2, col=1)
        fig.update_yaxes(title_text="seconds", rangemode="tozero", row=2, col=2)
        fig.update_yaxes(title_text="share", range=[0, 1], row=3, col=1)
        fig.update_yaxes(title_text="share", range=[0, 1], row=3, col=2)
        fig.update_xaxes(title_text="rank", type="category", row=3, col=1)
        fig.update_xaxes(title_text="rank", type="category", row=3, col=2)
        self._lock = threading.RLock()  # before super(): messages from the browser take it (see _handle_msg)
        super().__init__(fig)
        self._reader = Reader(source, window=window)
        self._ref = Reader(reference, window=100_000) if reference is not None else None
        self._name = name or self._reader.source.info().get("name", "")
        self._ref_name = self._ref.source.info().get("name", "") if self._ref is not None else ""
        self._index: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._interval = interval
        self._frame: Frame | None = None
        self._redraws = 0
        self._errors: list[str] = []  # tracebacks from the background thread (see `errors`)
        self._titles = len(self.layout.annotations)  # the subplot titles; session cell labels come after
        self._cells_drawn: tuple = ([], [])
        self.refresh()
        if start and not self._reader.done():
            self.start()

    # ---- public ----------------------------------------------------------------------------------

    @property
    def frame(self) -> Frame | None:
        """The Frame last drawn."""
        return self._frame

    @property
    def redraws(self) -> int:
        return self._redraws

    @property
    def errors(self) -> list[str]:
        """Tracebacks of failed background refreshes (empty when all went well)."""
        return list(self._errors)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def trace(self, name: str):
        """The trace named `name` (e.g. "throughput total", "throughput rank 1", "loss rank 0")."""
        i = self._index.get(name)
        return None if i is None else self.data[i]

    def trace_names(self) -> list[str]:
        return list(self._index)

    def refresh(self) -> bool:
        """Read new events and redraw if there were any. Returns whether it redrew."""
        with self._lock:
            frame = self._reader.poll()
            ref = None
            if self._ref is not None:
                self._ref.poll()
                ref = self._ref.frame()
            if frame is None:
                return False
            self._draw(frame, ref)
            self._frame = frame
            self._redraws += 1
            return True

    def start(self) -> None:
        if self.running:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=_follow, args=(weakref.ref(self), self._stop, self._interval),
                                        name=f"sdp-dashboard-{self._name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)

    def close(self):
        self.stop()
        super().close()

    # The main thread touches the widget in two places while our thread may be drawing, and both
    # corrupt the browser's copy of the figure if they interleave with a draw (seen as a blank plot):
    # - messages from the browser (zoom, trace/layout deltas) are applied inside ipywidgets'
    #   hold_sync(), which coalesces state changes to their last value; plotly sends each edit by
    #   setting a trait to the message and straight back to None, so an edit made by our thread in
    #   that window would reach the browser as None;
    # - displaying the figure (_repr_mimebundle_) deep-copies data and layout into the traits the
    #   view starts from.
    # One lock around those and around each draw keeps them apart.
    def _handle_msg(self, msg):
        with self.__dict__.get("_lock") or _NO_LOCK:
            return super()._handle_msg(msg)

    def _repr_mimebundle_(self, *args, **kwargs):
        with self.__dict__.get("_lock") or _NO_LOCK:
            return super()._repr_mimebundle_(*args, **kwargs)

    # ---- drawing ---------------------------------------------------------------------------------

    def _ensure(self, name: str, panel: str, kind: str = "line", color: str | None = None,
                dash: str | None = None) -> int:
        i = self._index.get(name)
        if i is None:
            row, col = _PANELS[panel]
            if kind == "bar":
                trace = go.Bar(name=name, x=[], y=[], marker_color=color)
            else:
                trace = go.Scatter(name=name, x=[], y=[], mode="lines", line=dict(color=color, dash=dash))
            self.add_trace(trace, row=row, col=col)
            i = self._index[name] = len(self.data) - 1
        return i

    def _draw(self, fr: Frame, ref: Frame | None) -> None:
        # New ranks / devices get their traces first (adding traces cannot be batched).
        updates: dict[int, dict] = {}
        i = self._ensure("throughput total", "throughput", color="#111111")
        updates[i] = {"x": tuple(fr.throughput_total[0]), "y": tuple(fr.throughput_total[1])}
        for k, rank in enumerate(fr.ranks):
            color = _COLORS[k % len(_COLORS)]
            x, y = fr.throughput[rank]
            updates[self._ensure(f"throughput rank {rank}", "throughput", color=color)] = {"x": tuple(x), "y": tuple(y)}
            cols = fr.steps[rank]
            # a diverging loss (NaN, inf) is a gap: the widget's JSON sync cannot carry non-finite floats
            pts = [(s, v if math.isfinite(v) else None) for s, v in zip(cols["step"], cols["loss"])
                   if isinstance(v, (int, float))]
            if pts:
                updates[self._ensure(f"loss rank {rank}", "loss", color=color)] = {
                    "x": tuple(p[0] for p in pts), "y": tuple(p[1] for p in pts)}
        k = 0
        for (node, device), cols in fr.system.items():
            color = _COLORS[(k + 5) % len(_COLORS)]
            k += 1
            if device == "cpu":
                name = f"node {node} CPU, whole machine"
                updates[self._ensure(name, "util", color=color)] = {"x": tuple(cols["t"]), "y": tuple(cols["util"])}
                share = [None if p is None or not n else p / n for p, n in zip(cols["proc_util"], cols["ncpu"])]
                if any(v is not None for v in share):
                    i = self._ensure(f"node {node} CPU, job processes", "util", color=color, dash="dot")
                    updates[i] = {"x": tuple(cols["t"]), "y": tuple(share)}
            else:
                name = f"node {node} {device.upper()}"
                updates[self._ensure(name, "util", color=color)] = {"x": tuple(cols["t"]), "y": tuple(cols["util"])}
        if fr.ranks:
            cols = fr.steps[fr.ranks[0]]
            n = len(cols["step"])
            lo = max(0, n - BAR_STEPS)
            steps = tuple(cols["step"][lo:])
            for field, label, color in (("compute", "compute", "#4c78a8"), ("exposed_comm", "exposed comm", "#e45756"),
                                        ("data_wait", "data wait", "#f2b701")):
                vals = cols[field][lo:]
                if field == "compute" or any(v for v in vals):
                    i = self._ensure(f"{label} (rank {fr.ranks[0]})", "steps", kind="bar", color=color)
                    updates[i] = {"x": steps, "y": tuple(vals)}
        sg = fr.stragglers
        if sg is not None and sg.wait_share:
            ranks = sorted(sg.wait_share)
            colors = tuple("#d62728" if r == sg.straggler else "#4c78a8" for r in ranks)
            i = self._ensure("waiting in collectives", "waiting", kind="bar")
            updates[i] = {"x": tuple(str(r) for r in ranks), "y": tuple(sg.wait_share[r] for r in ranks), "colors": colors}
            i = self._ensure("came last", "last", kind="bar")
            updates[i] = {"x": tuple(str(r) for r in ranks), "y": tuple(sg.last_share.get(r, 0.0) for r in ranks),
                          "colors": colors}
        cpu_too = any(dev == "cpu" for _, dev in fr.system)
        util_title = {"CPU": "CPU utilization, no GPU (x: seconds)",
                      "GPU": "GPU and CPU utilization (x: seconds)" if cpu_too else "GPU utilization (x: seconds)",
                      }.get(fr.util_kind or "", "Utilization")
        title = header_text(fr, self._name, ref, self._ref_name)
        with self.batch_update():
            for i, props in updates.items():
                self.data[i].x = props["x"]
                self.data[i].y = props["y"]
                if "colors" in props:  # the straggler's bar in red
                    self.data[i].marker.color = props["colors"]
            if (fr.cells, fr.changes) != self._cells_drawn:
                self._draw_cells(fr.cells, fr.changes)
            self.layout.title.text = title
            self.layout.annotations[1].text = util_title
            self.layout.yaxis.title.text = fr.unit


    def _draw_cells(self, cells: list, changes: list) -> None:
        """Markers on both time panels (throughput: x, utilization: x2), labelled above the throughput
        panel: an interactive session's cells (a dotted line where each began, "cell N") and an elastic
        job's membership changes (a red line: "h3 lost: 2 nodes")."""
        shapes, labels = [], []
        marks = [(x, f"cell {n}", "#888888", "dot") for x, n in cells] + [(x, text, "#d62728", "solid")
                                                                          for x, text in changes]
        for x, text, color, dash in marks:
            for axis in ("x", "x2"):
                shapes.append(dict(type="line", xref=axis, x0=x, x1=x, yref=f"{axis.replace('x', 'y')} domain",
                                   y0=0, y1=1, line=dict(color=color, width=1, dash=dash)))
            labels.append(dict(xref="x", x=x, yref="y domain", y=1.0, yanchor="bottom", showarrow=False,
                               text=text, font=dict(size=9, color="#666666" if dash == "dot" else color)))
        self.layout.shapes = shapes
        self.layout.annotations = tuple(self.layout.annotations[:self._titles]) + tuple(labels)
        self._cells_drawn = (list(cells), list(changes))


_NO_LOCK = contextlib.nullcontext()


def _follow(ref: "weakref.ref[Dashboard]", stop: threading.Event, interval: float) -> None:
    """Background loop: poll, redraw when something arrived, end when the job has ended."""
    idle = failures = 0
    while not stop.wait(interval if idle < 20 else 4 * interval):
        dash = ref()
        if dash is None:
            return
        try:
            changed = dash.refresh()
            failures = 0
        except Exception:  # keep the kernel quiet: record it, retry, give up after a few in a row
            dash._errors.append(traceback.format_exc())
            failures += 1
            if failures >= 5:
                dash.layout.title.text = "dashboard stopped: " + dash._errors[-1].strip().splitlines()[-1]
                return
            continue
        idle = 0 if changed else idle + 1
        if dash._reader.done():
            return
        del dash


def dashboard(job_or_dir: Any, reference: Any = None, window: int = 600, interval: float = 0.5,
              start: bool = True) -> Dashboard:
    """The live dashboard of a job: a Job, a job directory, or a MetricsSource. `reference`: a job of
    the same kind on fewer ranks, for the scaling efficiency in the header."""
    return Dashboard(job_or_dir, reference=reference, window=window, interval=interval, start=start)


def snapshot(job_or_dir: Any, path: str, reference: Any = None) -> str:
    """Write a self-contained HTML snapshot of the job's dashboard as it is now. Returns the path."""
    d = Dashboard(job_or_dir, reference=reference, window=100_000, start=False)
    try:
        d.write_html(path, include_plotlyjs=True, full_html=True)
    finally:
        d.close()
    return path
