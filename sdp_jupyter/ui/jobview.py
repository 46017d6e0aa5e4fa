"""JobView: the small live view of a Job (state, elapsed time, per-rank output, Stop button).

With --ranks-output all, the first panel is every rank's output merged (launch/kernel/rank_groups.py):
a line several ranks printed shows once with their ranks, `[ranks 0-7] epoch 1 done`; the per-rank
panels below it are the raw view (--ranks-output raw shows only those). A job that failed shows its
error once: when the cell also raises it (`error_below`), the view leaves it to the error. An ended
job's view has no Stop button.

It is a view over a `Job`, which works without a notebook; the view only subscribes to the job's
output lines and redraws from a background thread at a bounded rate (4 per second), so the output
keeps streaming while other cells run.

The Stop button must work while another cell keeps the kernel busy, but a widget's comm message is
handled only when the running cell ends (even with JupyterLab's subshells). So the button also
POSTs to a small HTTP endpoint served by a kernel thread on 127.0.0.1 (random port, per-kernel
token): that reaches the job at once when the browser runs on the kernel's machine (a local
Jupyter); elsewhere the comm message still stops the job as soon as the kernel is free.
"""
from __future__ import annotations

import collections
import hmac
import html
import importlib.util
import secrets
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anywidget
import ipywidgets as w
import traitlets

from sdp_jupyter.launch.kernel import rank_groups

REFRESH_S = 0.25
SHOWN_LINES = 1000  # lines per rank kept in the view; the rank's log has all of them

MERGED = "merged"  # the merged panel's key among the ranks whose panel must be redrawn

_STATE_COLOURS = {"pending": "#888", "running": "#1f77b4", "succeeded": "#2ca02c", "failed": "#d62728",
                  "stopped": "#ff7f0e"}


class StopServer:
    """Kernel-side HTTP endpoint `POST /stop/<job name>?token=...` on 127.0.0.1, one per kernel."""

    _instance: "StopServer | None" = None
    _lock = threading.Lock()

    def __init__(self):
        self.token = secrets.token_hex(16)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                self.send_response(server.handle(self.path))
                self.send_header("Access-Control-Allow-Origin", "*")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):  # the kernel's stderr is not a request log
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True, name="sdp-stop-server").start()

    @classmethod
    def get(cls) -> "StopServer":
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def url(self, job) -> str:
        return f"http://127.0.0.1:{self.port}/stop/{urllib.parse.quote(job.name)}?token={self.token}"

    def handle(self, path: str) -> int:
        parsed = urllib.parse.urlsplit(path)
        token = urllib.parse.parse_qs(parsed.query).get("token", [""])[0]
        if not hmac.compare_digest(token, self.token):
            return 403
        if not parsed.path.startswith("/stop/"):
            return 404
        name = urllib.parse.unquote(parsed.path[len("/stop/"):])
        from sdp_jupyter.launch import jobs

        job = next((j for j in reversed(jobs()) if j.name == name), None)
        if job is None or not job.live:
            return 404
        threading.Thread(target=lambda: job.stop(wait=False), daemon=True).start()
        return 202


class StopButton(anywidget.AnyWidget):
    """A Stop button that reaches the kernel even while a cell runs (see the module docstring)."""

    _esm = """
    function render({ model, el }) {
      const button = document.createElement("button");
      button.className = "jupyter-widgets jupyter-button widget-button mod-danger sdp-stop";
      button.style.width = "90px";
      const draw = () => {
        button.textContent = model.get("description");
        button.disabled = model.get("disabled");
      };
      draw();
      model.on("change:description", draw);
      model.on("change:disabled", draw);
      button.addEventListener("click", () => {
        button.disabled = true;
        button.textContent = "Stopping";
        const url = model.get("url");
        if (url) fetch(url, { method: "POST", mode: "no-cors" }).catch(() => {});
        model.send({ event: "stop" });
      });
      el.appendChild(button);
    }
    export default { render };
    """
    description = traitlets.Unicode("Stop").tag(sync=True)
    disabled = traitlets.Bool(False).tag(sync=True)
    url = traitlets.Unicode("").tag(sync=True)

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self._handlers = []
        self.on_msg(lambda _widget, content, _buffers: content.get("event") == "stop" and self.click())

    def on_click(self, handler) -> None:
        self._handlers.append(handler)

    def click(self) -> None:
        for handler in self._handlers:
            handler(self)


def _problems_html(warnings: list[str], error: str | None, colour: str, membership: list[str] = ()) -> str:
    """An elastic job's membership changes, the job's warnings (another backend than asked, ranks that
    trained independently) and its error."""
    pre = "white-space:pre-wrap;margin:0"
    out = [f"<pre class='sdp-membership' style='color:#555;{pre}'>membership: {html.escape(t)}</pre>"
           for t in membership] + [f"<pre class='sdp-warning' style='color:#b26b00;{pre}'>warning: {html.escape(t)}</pre>" for t in warnings]
    if error:
        out.append(f"<pre style='color:{colour};{pre}'>{html.escape(str(error))}</pre>")
    return "".join(out)


class JobView(w.VBox):
    def __init__(self, job):
        self.job = job
        self._lock = threading.Lock()
        self._lines = {r: collections.deque(maxlen=SHOWN_LINES) for r in range(job.world_size)}
        self._dirty: set = set()  # ranks whose panel changed; MERGED for the merged panel
        self._live = set(range(job.world_size)) if job.spec.ranks_output in ("all", rank_groups.RAW) else {0}
        # --ranks-output all: every rank's output merged in the first panel, the raw per-rank panels below
        self._merger = rank_groups.Stream(job.world_size, "all") \
            if job.spec.ranks_output == "all" and job.world_size > 1 else None
        self._merged: collections.deque = collections.deque(maxlen=SHOWN_LINES)
        self.error_below = False  # the cell raises the job's error under this view: not shown twice
        self.header = w.HTML()
        self.error = w.HTML()
        self.stop_button = StopButton(url=StopServer.get().url(job) if job.live else "",
                                      disabled=not job.live or job.done)
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
        self.merged = w.Output(layout=w.Layout(max_height="320px", overflow="auto"))
        self._first = 1 if self._merger else 0  # accordion index of rank 0's panel
        self.ranks = w.Accordion(children=([self.merged] if self._merger else []) + self.outputs, selected_index=0)
        if self._merger:
            self.ranks.set_title(0, f"all {job.world_size} ranks, merged (identical lines once)")
        for r in range(job.world_size):
            self.ranks.set_title(self._first + r, f"rank {r}" + ("" if r in self._live else " (opens its log)"))
        self.ranks.observe(self._on_open_rank, names="selected_index")
        super().__init__([w.HBox([self.header] + buttons), self.error, self.ranks, self.extra])
        seen = job.subscribe(self._on_line)
        for rank, lines in seen.items():
            if rank in self._live:
                self._add(rank, lines)
        if self._merger:  # what came before this view
            self._merger.add_seen(seen)
        if job.done:
            self._hide_stop()
        self._redraw()
        self._thread = threading.Thread(target=self._refresh_loop, daemon=True, name=f"sdp-view-{job.name}")
        self._thread.start()

    def __repr__(self) -> str:  # text/plain for frontends without widgets: the job, not the widget tree
        return f"JobView of {self.job!r} ({self.job.dir})"

    # ------------------------------------------------------------------ events
    def _on_line(self, rank: int, text: str) -> None:
        if rank in self._live:
            self._add(rank, [text])
        if self._merger:
            self._merger.add(rank, text)

    def _add(self, rank: int, lines) -> None:
        with self._lock:
            self._lines.setdefault(rank, collections.deque(maxlen=SHOWN_LINES)).extend(lines)
            self._dirty.add(rank)

    def _on_open_rank(self, change) -> None:
        index = change.get("new")
        rank = None if index is None else index - self._first
        if rank is None or rank < 0 or rank in self._live:
            return
        self._live.add(rank)
        self.ranks.set_title(index, f"rank {rank}")
        self._add(rank, self.job.logs(rank, tail=SHOWN_LINES).splitlines(keepends=True))
        self._flush()

    def _on_stop(self, _button) -> None:
        self.stop_button.disabled = True
        self.stop_button.description = "Stopping"
        if self.job.live and not self.job.done:
            threading.Thread(target=lambda: self.job.stop(wait=False), daemon=True).start()

    def _on_dashboard(self, _button) -> None:
        self.dashboard_button.disabled = True
        with self.extra:
            from IPython.display import display

            display(self.job.dashboard())

    # ------------------------------------------------------------------ drawing
    def _flush(self, final: bool = False) -> None:
        with self._lock:
            merged = self._merger.take(final) if self._merger else ""
            if merged:
                self._merged.extend(merged.splitlines(keepends=True))
                self._dirty.add(MERGED)
            dirty, self._dirty = self._dirty, set()
            texts = {r: "".join(self._merged if r == MERGED else self._lines[r]) for r in dirty}
        for rank, text in texts.items():
            out = self.merged if rank == MERGED else self.outputs[rank]
            out.outputs = ({"output_type": "stream", "name": "stdout", "text": text},)

    def _hide_stop(self) -> None:
        """An ended job has nothing to stop: its view offers no Stop button."""
        self.stop_button.disabled = True
        self.stop_button.layout.display = "none"

    def _redraw(self) -> None:
        job = self.job
        st = job.status
        state = st.get("state", "pending")
        colour = _STATE_COLOURS.get(state, "#888")
        spec = job.spec
        # Everything read from the job directory is text someone else may have written: escaped.
        esc = lambda v: html.escape(str(v))  # noqa: E731
        restarts = f" · restarts {esc(st.get('restarts'))}" if st.get("restarts") else ""
        start = f" · <span class='sdp-start'>{esc(job.start_label)}</span>" if job.start_label else ""
        where = f" · <span class='sdp-where'>on {esc(job.where_label)}</span>" if job.where_label else ""
        self.header.value = (
            f"<b>{esc(job.name)}</b> · <span style='color:{colour}'><b>{esc(state)}</b></span>"
            f" · {job.elapsed:.1f} s · {esc(job.nodes_label)} node(s) × {esc(spec.procs_per_node or 1)}{where} · "
            f"{esc(job.backend_label)}{start}{restarts} · <code>{esc(job.dir)}</code>")
        # a hang the flight recorder sees while the job runs is shown, and goes when the wait ends
        error = None if self.error_below else st.get("error")
        self.error.value = _problems_html(job.warnings, error or (
            f"waiting: {st['hang']}" if st.get("hang") else None), colour if error else "#b26b00",
            job.membership)
        if state in ("succeeded", "failed", "stopped"):
            self._hide_stop()

    def _refresh_loop(self) -> None:
        while not self.job.done:
            self.job.wait(timeout=REFRESH_S)
            self._flush()
            self._redraw()
        self.job.wait()  # a live job's output readers have finished when it is done
        self._flush(final=True)
        self._redraw()
        self.job.unsubscribe(self._on_line)
