"""JupyterLab + Debian's chromium (driven by Playwright) for tests of what a person sees.

Fixtures (reuse them in any tests/browser/test_*.py):

``jupyter_server``  session-wide JupyterLab on 127.0.0.1 (free port, no token), serving the repository
                    root; kernels get ``PYTHONPATH`` = the repository, ``SDP_JOBS_DIR`` = a temporary
                    folder, and no ``PYTEST_CURRENT_TEST`` (ipykernel stops capturing subprocess output
                    when it sees it). Yields a ``JupyterServer`` (``url``, ``root``, ``jobs_dir``, ``log()``).
``browser``         session-wide chromium: ``/usr/bin/chromium`` (or ``$SDP_CHROMIUM``) launched with
                    ``executable_path``; ``playwright install`` is never run.
``lab``             a fresh page per test, wrapped in ``LabPage``: ``open_notebook(path)``,
                    ``open_cells(name, sources)`` (a scratch notebook of code cells in
                    ``test-artifacts/``), ``run_all()``, ``run_cell(source)`` (one cell; what its
                    output area shows), ``wait_idle()``, ``wait_text(locator, regex)``,
                    ``screenshot(name)`` (into ``test-artifacts/``).

Every wait has a deadline and a failure says what it waited for; the server's log is attached to
the failure message so a broken kernel or extension is visible.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from sdp_jupyter._net import free_port

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("SDP_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking"]

# No network here: stop JupyterLab asking for news and update checks (a toast would cover the page).
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        '{"fetchNews": "false", "checkForUpdates": false, "doNotDisturbMode": true}',
    # tests open notebooks of the repository: never write their outputs back into it
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": '{"autosave": false}',
}


@dataclass
class JupyterServer:
    url: str
    root: Path
    jobs_dir: Path
    log_path: Path
    proc: subprocess.Popen

    def log(self, tail: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no server log)"
        return "\n".join(lines[-tail:])


@pytest.fixture(scope="session")
def jupyter_server():
    workdir = Path(tempfile.mkdtemp(prefix="sdp-lab-"))
    settings = workdir / "lab-settings"
    for rel, text in LAB_SETTINGS.items():
        path = settings / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    jobs_dir = workdir / "jobs"
    jobs_dir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(ROOT)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
        "SDP_JOBS_DIR": str(jobs_dir),
        "JUPYTERLAB_SETTINGS_DIR": str(settings),
        "JUPYTERLAB_WORKSPACES_DIR": str(workdir / "workspaces"),
        "JUPYTER_RUNTIME_DIR": str(workdir / "runtime"),
    })
    port = free_port()
    log_path = workdir / "server.log"
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", f"--port={port}",
           "--ip=127.0.0.1", "--ServerApp.token=", "--ServerApp.password=",
           "--ServerApp.disable_check_xsrf=True", f"--ServerApp.root_dir={ROOT}",
           "--LabApp.expose_app_in_browser=True"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    server = JupyterServer(f"http://127.0.0.1:{port}", ROOT, jobs_dir, log_path, proc)
    deadline = time.monotonic() + 90
    while True:
        if proc.poll() is not None:
            pytest.fail(f"jupyter lab exited with {proc.returncode}:\n{server.log()}")
        try:
            with urllib.request.urlopen(server.url + "/api/status", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"jupyter lab did not answer /api/status within 90 s:\n{server.log()}")
        time.sleep(0.5)
    yield server
    try:
        # shut kernels and their jobs down in order before the server goes
        req = urllib.request.Request(server.url + "/api/shutdown", method="POST")
        urllib.request.urlopen(req, timeout=10).close()
        proc.wait(timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, 15)
        proc.wait(timeout=10)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="session")
def browser():
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium; "
                    "./dev.sh test does) or point SDP_CHROMIUM at a chromium binary")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


class LabPage:
    """A JupyterLab tab with the steps tests need; every wait names what it waited for."""

    def __init__(self, page, server: JupyterServer):
        self.page = page
        self.server = server

    def fail(self, what: str) -> None:
        shot = self.screenshot("failure-" + "".join(c if c.isalnum() else "-" for c in what)[:60])
        pytest.fail(f"{what} (screenshot {shot})\n--- jupyter server log ---\n{self.server.log()}")

    def open_notebook(self, rel_path: str, timeout: float = 90) -> None:
        """Open ``rel_path`` (relative to the repository) with a fresh workspace and wait for its kernel."""
        self.page.goto(f"{self.server.url}/lab/tree/{rel_path}?reset", wait_until="domcontentloaded")
        try:
            self.page.wait_for_function("() => window.jupyterapp && window.jupyterapp.shell", timeout=timeout * 1000)
            self.page.locator(".jp-NotebookPanel .jp-Cell").first.wait_for(timeout=timeout * 1000)
        except Exception:
            self.fail(f"notebook {rel_path} did not open within {timeout:g} s")
        self.wait_idle(timeout)

    def open_cells(self, name: str, sources: list, timeout: float = 90) -> None:
        """Write a notebook of code cells ``sources`` as ``test-artifacts/NAME.ipynb`` and open it."""
        import nbformat

        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in sources])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        ARTIFACTS.mkdir(exist_ok=True)
        nbformat.write(nb, ARTIFACTS / f"{name}.ipynb")
        self.open_notebook(f"test-artifacts/{name}.ipynb", timeout)

    def kernel_status(self) -> str:
        return self.page.evaluate("""() => {
            const w = window.jupyterapp.shell.currentWidget;
            const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
            return k ? k.status : 'none';
        }""")

    def wait_idle(self, timeout: float = 120) -> None:
        """Wait until the notebook's kernel is idle (started, and not running a cell)."""
        deadline = time.monotonic() + timeout
        seen = None
        while time.monotonic() < deadline:
            seen = self.kernel_status()
            if seen == "idle":
                return
            time.sleep(0.25)
        self.fail(f"kernel not idle within {timeout:g} s (last status {seen!r})")

    def run_all(self, timeout: float = 180) -> None:
        """Run every cell and wait for the kernel to finish them."""
        self.page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        # idle between two cells is not the end: wait until every code cell has its execution count
        done = """() => {
            const nb = window.jupyterapp.shell.currentWidget;
            if (!nb || !nb.content || !nb.content.model) return false;
            const cells = Array.from(nb.content.model.cells);
            const pending = Array.from(document.querySelectorAll('.jp-InputPrompt'))
                .some(p => p.textContent.includes('*'));
            return !pending && cells.filter(c => c.type === 'code').every(c => c.executionCount !== null);
        }"""
        try:
            self.page.wait_for_function(done, timeout=timeout * 1000, polling=250)
        except Exception:
            self.fail(f"the cells did not all run within {timeout:g} s")
        self.wait_idle(timeout)
        errors = self.page.locator(".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']")
        tracebacks = [t for t in errors.all_inner_texts() if "Traceback" in t]
        if tracebacks:
            self.fail("a cell raised:\n" + "\n".join(tracebacks)[:3000])

    def run_cell(self, source: str, timeout: float = 60) -> dict:
        """Run the one cell whose source is ``source`` (as Ctrl-Enter would) and wait until its prompt
        shows it ran. Returns what the page shows for it: ``count`` (its execution count), ``text``
        (its output area's text) and ``error`` (whether an error, stderr-styled, output is there)."""
        self.page.evaluate("""(source) => {
            const nb = window.jupyterapp.shell.currentWidget;
            nb.content.activeCellIndex = Array.from(nb.content.model.cells)
                .findIndex(c => c.sharedModel.getSource() === source);
            window.jupyterapp.commands.execute('notebook:run-cell');  // not awaited: it resolves when done
            return null;
        }""", source)
        shows = """(source) => {
            const nb = window.jupyterapp.shell.currentWidget;
            const i = Array.from(nb.content.model.cells).findIndex(c => c.sharedModel.getSource() === source);
            const cell = nb.content.widgets[i];
            const prompt = cell.node.querySelector('.jp-InputPrompt');
            const area = cell.node.querySelector('.jp-Cell-outputArea');
            const stderr = ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']";
            return {busy: !!prompt && prompt.textContent.includes('*'), count: cell.model.executionCount,
                    text: area ? area.innerText : '', error: !!cell.node.querySelector(stderr)};
        }"""
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = self.page.evaluate(shows, source)
            if state["count"] is not None and not state["busy"]:
                return state
            time.sleep(0.2)
        self.fail(f"cell {source.splitlines()[0]!r} did not finish within {timeout:g} s; last state {state}")

    def wait_text(self, locator, pattern: str, timeout: float = 30, what: str = "text") -> str:
        """Wait until ``locator``'s visible text matches the JavaScript regex ``pattern``; return the text.
        On timeout the test fails with what it waited for and the text it saw."""
        try:
            self.page.wait_for_function("([el, p]) => new RegExp(p).test(el.innerText)",
                                        arg=[locator.element_handle(), pattern], timeout=timeout * 1000)
        except Exception:
            self.fail(f"{what}: no match for /{pattern}/ within {timeout:g} s; saw {locator.inner_text()!r}")
        return locator.inner_text()

    def screenshot(self, name: str) -> Path:
        ARTIFACTS.mkdir(exist_ok=True)
        path = ARTIFACTS / f"{name}.png"
        self.page.screenshot(path=str(path), full_page=True)
        return path


WARMUP_NOTEBOOK = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "warm", "metadata": {}, "outputs": [],
               "source": "import torch, ipywidgets, plotly.graph_objects as go\n"
                         "import sdp_jupyter.ui.dashboard\n"
                         "go.FigureWidget(go.Scatter(x=[0, 1], y=[0, 1]))"}],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture(scope="session")
def warm_lab(browser, jupyter_server):
    """Pay the first-start costs once, before any test times anything.

    Why: on a fresh machine the first page of the session paid for chromium building its font
    cache and profile, JupyterLab's first load of its bundles and the widget manager, plotly.js
    and anywidget's first ESM import, and the kernel's first import of torch and plotly from a cold
    disk cache. The dashboard test, the first browser test to run, watches a job that runs for a
    bounded time, so that one-off delay could eat the window in which the plot must grow (it failed
    once, on a fresh machine only, and passed on re-run). A scratch notebook that renders a
    FigureWidget takes those costs here, outside every test's timed window."""
    import json

    path = jupyter_server.root / "test-artifacts" / "warmup.ipynb"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(WARMUP_NOTEBOOK))
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = LabPage(context.new_page(), jupyter_server)
    try:
        page.open_notebook("test-artifacts/warmup.ipynb", timeout=180)
        page.run_all(timeout=240)
        page.page.locator(".js-plotly-plot").first.wait_for(timeout=120_000)
        page.page.evaluate("() => window.jupyterapp.commands.execute('kernelmenu:shutdown')")
    finally:
        context.close()
    return True


@pytest.fixture
def lab(browser, jupyter_server, warm_lab):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    page = context.new_page()
    yield LabPage(page, jupyter_server)
    context.close()
