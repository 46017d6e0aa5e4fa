"""Kernel side: metrics events in, frames out.

Two halves, so that another source (a SageMaker job read through CloudWatch) plugs in without the UI
knowing where numbers come from:

- A **source** yields *events*: plain dicts shaped like the metrics lines of docs/jobs.md
  (`{"t", "kind": "step" | "system" | "sampler" | ..., ...}`). It implements `MetricsSource`:
  `poll() -> list[dict]` (new events since the last call, never raises on bad data), `done() -> bool`
  (no more events will come) and `info() -> dict` (best effort: `name`, `state`, `total_steps`,
  `world_size`). `JobDirSource` tails a local job directory. The sources live in
  sdp_jupyter/monitor/sources.py; their names are importable from here too.
- A `Metrics` folds events into bounded per-rank / per-device windows and returns a `Frame`: the
  columns the dashboard draws (steps, throughput, utilization, loss, compute vs exposed comm) and
  the header figures (samples/s, mean utilization, ETA, input-bound share).

`Reader(source)` ties them together; `read(job_or_dir)` is the one-shot form for a finished job.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from sdp_jupyter.monitor.sources import (STEP_COLUMNS, SYSTEM_COLUMNS, JobDirSource, MetricsSource, job_dir_of,
                                         open_source)

__all__ = ["MetricsSource", "JobDirSource", "Metrics", "Frame", "Reader", "open_source", "read", "job_dir_of"]


@dataclass
class Frame:
    """What the dashboard draws at one moment. Times are seconds since `t0` (the first event)."""

    t0: float | None = None
    now: float | None = None                       # latest event time (unix)
    ranks: list = field(default_factory=list)
    steps: dict = field(default_factory=dict)      # rank -> column -> list (STEP_COLUMNS + "compute")
    throughput: dict = field(default_factory=dict)  # rank -> (x, rate)
    throughput_total: tuple = ((), ())
    unit: str = "samples/s"
    system: dict = field(default_factory=dict)     # (node, device) -> column -> list (SYSTEM_COLUMNS)
    system_sources: dict = field(default_factory=dict)  # node -> "nvml" | "psutil"
    samples_per_s: float | None = None             # current, over the last few seconds
    steady_samples_per_s: float | None = None      # whole run after warm-up (for scaling efficiency)
    mean_util: float | None = None                 # recent mean over the GPUs (else the CPUs), percent
    util_kind: str | None = None                   # "GPU" or "CPU": what mean_util covers
    last_step: Any = None
    total_steps: int | None = None
    eta_s: float | None = None
    input_bound: float | None = None               # recent share of step time spent waiting for data
    comm_share: float | None = None                # recent share of step time in exposed communication
    state: str | None = None
    done: bool = False
    stragglers: Any = None                         # sdp_jupyter.stragglers.Stragglers, from the ranks' arrivals
    world_size: int | None = None
    events: int = 0
    skipped_lines: int = 0
    cells: list = field(default_factory=list)      # an interactive session's cells: (seconds since start, n)
    changes: list = field(default_factory=list)    # an elastic job's membership changes: (seconds, label)

    def __repr__(self) -> str:  # job.metrics() in a notebook: a summary, not every column
        def num(v, fmt):
            return "-" if v is None else format(v, fmt)

        return (f"Frame(state={self.state!r}, ranks={self.ranks}, last_step={self.last_step!r}, "
                f"total_steps={self.total_steps!r}, {self.unit}={num(self.samples_per_s, '.1f')}, "
                f"steady={num(self.steady_samples_per_s, '.1f')}, util={num(self.mean_util, '.0f')}% "
                f"{self.util_kind or ''}, input_bound={num(self.input_bound, '.2f')}, "
                f"comm_share={num(self.comm_share, '.2f')}, devices={len(self.system)}, events={self.events})")

    def rank_steps(self, rank: int) -> list:
        """Step numbers recorded for `rank` (within the window)."""
        return list(self.steps.get(rank, {}).get("step", ()))


class Metrics:
    """Folds events into bounded windows. `window` bounds the points kept per rank and per device,
    so a long job costs the kernel the same as a short one; totals used by the header are running
    sums over the whole job."""

    WARMUP_STEPS = 3  # steps left out of the steady samples/s (start-up, first allreduce)

    def __init__(self, window: int = 600, smooth_s: float = 1.0, recent_s: float = 5.0):
        self.window = window
        self.smooth_s = smooth_s
        self.recent_s = recent_s
        self.t0: float | None = None
        self.now: float | None = None
        self.ranks: dict[int, OrderedDict] = {}  # rank -> step -> merged record
        self.agg: dict[int, dict] = {}           # rank -> running totals
        self.system: dict[tuple, deque] = {}
        self.sources: dict[int, str] = {}
        self.total_steps: int | None = None
        self.events = 0
        self.has_samples = False
        self.cells: deque = deque(maxlen=window)
        self.changes: deque = deque(maxlen=window)
        self.arrivals: deque = deque(maxlen=window)
        self._stragglers = None  # sdp_jupyter.stragglers.Stragglers of the arrivals above

    def update(self, events: Iterable[dict]) -> int:
        n = 0
        for ev in events:
            t = ev.get("t")
            if not isinstance(t, (int, float)):
                continue
            kind = ev.get("kind")
            if kind == "step":
                self._step(ev, t)
            elif kind == "system":
                node = ev.get("node", 0)
                key = (node, str(ev.get("device", "?")))
                q = self.system.get(key)
                if q is None:
                    q = self.system[key] = deque(maxlen=self.window)
                q.append(ev)
                self.sources.setdefault(node, ev.get("source", "?"))
            elif kind == "sampler":
                self.sources[ev.get("node", 0)] = ev.get("source", "?")
            elif kind == "cell":  # a session's cell began (launch/rank/cell_loop.py): a marker on the timeline
                self.cells.append((t, ev.get("cell")))
            elif kind == "membership":  # an elastic job re-formed (launch/kernel/elastic.py): a marker too
                self.changes.append((t, str(ev.get("label", ""))))
            elif kind == "arrivals":  # when a rank came to its collectives (comm/recorder.py): stragglers
                self.arrivals.append(ev)
                self._stragglers = None  # recomputed at the next frame, not at every frame
            else:
                continue
            n += 1
            self.t0 = t if self.t0 is None else min(self.t0, t)
            self.now = t if self.now is None else max(self.now, t)
        self.events += n
        return n

    def _step(self, ev: dict, t: float) -> None:
        rank = ev.get("rank", 0)
        steps = self.ranks.get(rank)
        if steps is None:
            steps = self.ranks[rank] = OrderedDict()
            self.agg[rank] = {"n": 0, "samples": 0.0, "warm_t": None, "warm_samples": 0.0, "last_t": None}
        key = ev.get("step")
        rec = steps.get(key)
        if rec is None:
            steps[key] = rec = dict(ev)
            a = self.agg[rank]
            a["n"] += 1
            s = ev.get("samples")
            if isinstance(s, (int, float)):
                self.has_samples = True
                a["samples"] += s
                if a["n"] > self.WARMUP_STEPS + 1:
                    a["warm_samples"] += s
            if a["n"] == self.WARMUP_STEPS + 1:
                a["warm_t"] = t
            a["last_t"] = t if a["last_t"] is None else max(a["last_t"], t)
            if len(steps) > self.window:
                steps.popitem(last=False)
        else:  # a second line for the same step (re-read file, late automatic fields): merge
            rec.update(ev)
        total = ev.get("total_steps")
        if isinstance(total, int):
            self.total_steps = total

    # ---- frames -------------------------------------------------------------------------------

    def frame(self, info: dict | None = None) -> Frame:
        info = info or {}
        fr = Frame(t0=self.t0, now=self.now, events=self.events, state=info.get("state"),
                   skipped_lines=info.get("skipped_lines", 0))
        fr.unit = "samples/s" if self.has_samples else "steps/s"
        fr.total_steps = self.total_steps if self.total_steps is not None else info.get("total_steps")
        fr.ranks = sorted(self.ranks, key=_sort_key)
        fr.world_size = info.get("world_size") or (len(fr.ranks) or None)
        t0 = self.t0 or 0.0
        rates_now, waits, comms = [], [], []
        for rank in fr.ranks:
            recs = sorted(self.ranks[rank].values(), key=lambda r: r["t"])
            cols = {c: [r.get(c) for r in recs] for c in STEP_COLUMNS}
            ts = cols["t"]
            # step_time missing (no wrapper): the time between this rank's consecutive lines
            st = cols["step_time"]
            for i in range(len(st)):
                if st[i] is None and i > 0:
                    st[i] = ts[i] - ts[i - 1]
            cols["compute"] = [
                None if s is None else max(0.0, s - (e or 0.0) - (w or 0.0))
                for s, e, w in zip(st, cols["exposed_comm"], cols["data_wait"])
            ]
            cols["t"] = [x - t0 for x in ts]
            fr.steps[rank] = cols
            x, y = self._rates(ts, cols["samples"] if self.has_samples else [1] * len(ts))
            fr.throughput[rank] = ([v - t0 for v in x], y)
            if y and self.now is not None and self.now - x[-1] <= self.recent_s:
                rates_now.append(self._recent_rate(ts, cols["samples"] if self.has_samples else None))
            recent = [i for i, tv in enumerate(ts) if self.now - tv <= self.recent_s and st[i]]
            for i in recent:
                waits.append((cols["data_wait"][i] or 0.0, st[i]))
                comms.append((cols["exposed_comm"][i] or 0.0, st[i]))
            if recs:
                last = recs[-1].get("step")
                if fr.last_step is None or (isinstance(last, (int, float)) and last > fr.last_step):
                    fr.last_step = last
        fr.throughput_total = self._total(fr)
        rates_now = [r for r in rates_now if r is not None]
        fr.samples_per_s = sum(rates_now) if rates_now else None
        fr.steady_samples_per_s = self._steady()
        if waits and any(w for w, _ in waits):
            fr.input_bound = sum(w for w, _ in waits) / sum(s for _, s in waits)
        if comms and any(c for c, _ in comms):
            fr.comm_share = sum(c for c, _ in comms) / sum(s for _, s in comms)
        self._system_frame(fr, t0)
        fr.cells = [(t - t0, n) for t, n in self.cells]
        fr.changes = [(t - t0, label) for t, label in self.changes]
        fr.eta_s = self._eta(fr)
        if self.arrivals and self._stragglers is None:
            from sdp_jupyter.stragglers import stragglers

            self._stragglers = stragglers(list(self.arrivals))
        fr.stragglers = self._stragglers
        return fr

    def _rates(self, ts: list, samples: list) -> tuple[list, list]:
        """Per-line rate over a trailing span of at least smooth_s: exact in steady state, no
        bin jitter."""
        x, y = [], []
        j = 0
        acc = 0.0
        for i in range(1, len(ts)):
            acc += samples[i] or 0.0
            while j < i - 1 and ts[i] - ts[j + 1] >= self.smooth_s:
                acc -= samples[j + 1] or 0.0
                j += 1
            span = ts[i] - ts[j]
            if span > 0:
                x.append(ts[i])
                y.append(acc / span)
        return x, y

    def _recent_rate(self, ts: list, samples: list | None) -> float | None:
        lo = bisect.bisect_left(ts, self.now - self.recent_s)
        lo = max(0, min(lo, len(ts) - 2))
        span = ts[-1] - ts[lo]
        if span <= 0:
            return None
        got = sum((s or 0.0) for s in samples[lo + 1:]) if samples is not None else len(ts) - 1 - lo
        return got / span

    def _total(self, fr: Frame) -> tuple:
        """Sum of the per-rank rates on a grid of smooth_s; a rank counts at T while its latest
        line before T is recent (so ranks that finished drop out)."""
        series = [(fr.throughput[r][0], fr.throughput[r][1]) for r in fr.ranks if fr.throughput[r][0]]
        if not series:
            return ((), ())
        start = max(x[0] for x, _ in series)  # from when every rank has a rate: no ramp-up artefact
        end = max(x[-1] for x, _ in series)
        stale = max(3 * self.smooth_s, 2.0)
        n = int((end - start) / self.smooth_s) + 1
        n0 = max(0, n - self.window)
        gx, gy = [], []
        for k in range(n0, n):
            T = start + k * self.smooth_s
            total, any_rank = 0.0, False
            for x, y in series:
                i = bisect.bisect_right(x, T + 1e-9) - 1
                if i >= 0 and T - x[i] <= stale:
                    total += y[i]
                    any_rank = True
            if any_rank:
                gx.append(T)
                gy.append(total)
        if gx and gx[-1] < end:  # always end at the latest point
            gx.append(end)
            gy.append(sum(y[-1] for x, y in series if end - x[-1] <= stale))
        return gx, gy

    def _steady(self) -> float | None:
        total = 0.0
        for a in self.agg.values():
            if a["warm_t"] is None or a["last_t"] is None or a["last_t"] <= a["warm_t"]:
                continue
            total += (a["warm_samples"] if self.has_samples else a["n"] - self.WARMUP_STEPS - 1) / (
                a["last_t"] - a["warm_t"])
        return total or None

    def _system_frame(self, fr: Frame, t0: float) -> None:
        utils: dict[str, list] = {"GPU": [], "CPU": []}
        for key in sorted(self.system, key=lambda k: (_sort_key(k[0]), _device_key(k[1]))):
            recs = list(self.system[key])
            cols = {c: [r.get(c) for r in recs] for c in SYSTEM_COLUMNS}
            cols["t"] = [x - t0 for x in cols["t"]]
            fr.system[key] = cols
            # "recent" is relative to the device's own latest sample: CloudWatch points lag by minutes
            last = recs[-1]["t"] if recs else 0.0
            utils["CPU" if key[1] == "cpu" else "GPU"].extend(
                r["util"] for r in recs if last - r["t"] <= self.recent_s and isinstance(r.get("util"), (int, float)))
        fr.system_sources = dict(self.sources)
        # The mean covers the GPUs when there are any (CPU lines next to them are context, not the answer).
        kind = "GPU" if utils["GPU"] else ("CPU" if utils["CPU"] else None)
        fr.util_kind = kind
        fr.mean_util = sum(utils[kind]) / len(utils[kind]) if kind else None

    def _eta(self, fr: Frame) -> float | None:
        if not fr.total_steps or not isinstance(fr.last_step, (int, float)) or not fr.ranks:
            return None
        rank = fr.ranks[0]
        recs = list(self.ranks[rank].values())
        ts = [r["t"] for r in recs]
        lo = bisect.bisect_left(ts, self.now - max(self.recent_s, 1e-9))
        lo = max(0, min(lo, len(recs) - 2))
        if len(recs) < 2 or ts[-1] <= ts[lo]:
            return None
        per_step = (ts[-1] - ts[lo]) / (len(recs) - 1 - lo)
        # steps may be numbered from 0 or from 1: the step after the last is fr.last_step + 1
        left = max(0, fr.total_steps - 1 - fr.last_step) if fr.last_step < fr.total_steps else 0
        return 0.0 if fr.done else left * per_step


def _sort_key(v):
    return (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v))


def _device_key(d: str):
    return (d == "cpu", int(d[3:]) if d.startswith("gpu") and d[3:].isdigit() else 0, d)


class Reader:
    """A source plus the folded state. `poll()` returns a new Frame when events arrived (or the job
    just ended), else None; `frame()` always returns the current one."""

    def __init__(self, source: Any, window: int = 600, smooth_s: float = 1.0):
        self.source = open_source(source)
        self.metrics = Metrics(window=window, smooth_s=smooth_s)
        self._was_done = False
        self._frame: Frame | None = None

    def poll(self) -> Frame | None:
        events = self.source.poll()
        self.metrics.update(events)
        done = self.source.done()
        if events or (done and not self._was_done) or self._frame is None:
            self._was_done = done
            self._frame = self._make(done)
            return self._frame
        return None

    def _make(self, done: bool) -> Frame:
        fr = self.metrics.frame(self.source.info())
        fr.done = done
        if done and fr.eta_s is not None:
            fr.eta_s = 0.0
        return fr

    def frame(self) -> Frame:
        return self._frame if self._frame is not None else self.poll() or self._frame

    def done(self) -> bool:
        return self.source.done()


def read(job_or_dir: Any, window: int = 100_000) -> Frame:
    """Everything a (finished or running) job has recorded so far, as one Frame."""
    reader = Reader(job_or_dir, window=window)
    reader.poll()
    return reader.frame()
