"""JobView: the small live view of a Job (state, elapsed time, per-rank output, Stop button).

It is a view over a `Job`, which works without a notebook; the view only subscribes to the job's
output lines and redraws from a background thread at a bounded rate (4 per second), so the Stop
button and the output keep working while other cells run.
"""
from __future__ import annotations

import collections
import html
import importlib.util
import threading

import ipywidgets as w

REFRESH_S = 0.25
SHOWN_LINES = 1000  # lines per rank kept in the view; the rank's log has all of them

_STATE_COLOURS = {"pending": "#888", "running": "#1f77b4", "succeeded": "#2ca02c", "failed": "#d62728",
                  "stopped": "#ff7f0e"}


def widgets_enabled() -> bool:
    """True inside a Jupyter kernel (a frontend can render widgets); False in a terminal IPython."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


class JobView(w.VBox):
    def __init__(self, job):
        self.job = job
        self._lock = threading.Lock()
        self._lines = {r: collections.deque(maxlen=SHOWN_LINES) for r in range(job.world_size)}
        self._dirty: set[int] = set()
        self._live = set(range(job.world_size)) if job.spec.ranks_output == "all" else {0}
        self.header = w.HTML()
        self.error = w.HTML()
        self.stop_button = w.Button(description="Stop", icon="stop", button_style="danger",
                                    tooltip="stop every rank of this job", layout=w.Layout(width="90px"))
        self.stop_button.on_click(self._on_stop)
        buttons = [self.stop_button]
        self.extra = w.Output()
        if importlib.util.find_spec("sdp_jupyter.ui.dashboard") is not None:
            self.dashboard_button = w.Button(description="Dashboard", icon="line-chart",
                                             layout=w.Layout(width="120px"))
            self.dashboard_button.on_click(self._on_dashboard)
            buttons.append(self.dashboard_button)
        self.outputs = [w.Output(layout=w.Layout(max_height="320px", overflow="auto"))
                        for _ in range(job.world_size)]
        self.ranks = w.Accordion(children=self.outputs, selected_index=0)
        for r in range(job.world_size):
            self.ranks.set_title(r, f"rank {r}" + ("" if r in self._live else " (opens its log)"))
        self.ranks.observe(self._on_open_rank, names="selected_index")
        super().__init__([w.HBox([self.header] + buttons), self.error, self.ranks, self.extra])
        for rank, lines in job.subscribe(self._on_line).items():
            if rank in self._live:
                self._add(rank, lines)
        self._redraw()
        self._thread = threading.Thread(target=self._refresh_loop, daemon=True, name=f"sdp-view-{job.name}")
        self._thread.start()

    # ------------------------------------------------------------------ events
    def _on_line(self, rank: int, text: str) -> None:
        if rank in self._live:
            self._add(rank, [text])

    def _add(self, rank: int, lines) -> None:
        with self._lock:
            self._lines.setdefault(rank, collections.deque(maxlen=SHOWN_LINES)).extend(lines)
            self._dirty.add(rank)

    def _on_open_rank(self, change) -> None:
        rank = change.get("new")
        if rank is None or rank in self._live:
            return
        self._live.add(rank)
        self.ranks.set_title(rank, f"rank {rank}")
        self._add(rank, self.job.logs(rank, tail=SHOWN_LINES).splitlines(keepends=True))
        self._flush()

    def _on_stop(self, _button) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping"
        threading.Thread(target=lambda: self.job.stop(wait=False), daemon=True).start()

    def _on_dashboard(self, _button) -> None:
        self.dashboard_button.disabled = True
        with self.extra:
            from IPython.display import display

            display(self.job.dashboard())

    # ------------------------------------------------------------------ drawing
    def _flush(self) -> None:
        with self._lock:
            dirty, self._dirty = self._dirty, set()
            texts = {r: "".join(self._lines[r]) for r in dirty}
        for rank, text in texts.items():
            self.outputs[rank].outputs = ({"output_type": "stream", "name": "stdout", "text": text},)

    def _redraw(self) -> None:
        job = self.job
        st = job.status
        state = st.get("state", "pending")
        colour = _STATE_COLOURS.get(state, "#888")
        spec = job.spec
        restarts = f" · restarts {st.get('restarts')}" if st.get("restarts") else ""
        self.header.value = (
            f"<b>{html.escape(job.name)}</b> · <span style='color:{colour}'><b>{state}</b></span>"
            f" · {job.elapsed:.1f} s · {spec.nodes} node(s) × {spec.procs_per_node or 1} · "
            f"{spec.backend}{restarts} · <code>{html.escape(str(job.dir))}</code>")
        if st.get("error"):
            self.error.value = (f"<pre style='color:{colour};white-space:pre-wrap;margin:0'>"
                                f"{html.escape(st['error'])}</pre>")
        if state in ("succeeded", "failed", "stopped"):
            self.stop_button.disabled = True
            self.stop_button.description = "Stop"

    def _refresh_loop(self) -> None:
        while not self.job.done:
            self.job._done.wait(REFRESH_S)
            self._flush()
            self._redraw()
        self.job.wait()  # a live job's output readers have finished when it is done
        self._flush()
        self._redraw()
        self.job.unsubscribe(self._on_line)
