"""The job view in JupyterLab and chromium: rank 0's output streams into the page, and the Stop button
stops the job while another cell keeps the kernel busy. Reuses the fixtures of tests/browser/conftest.py."""
from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CELLS = [
    "%load_ext sdp_jupyter",
    "%%sdp_train --nodes 2 --backend gloo --name browser-stop\n"
    "import time\nfor i in range(300):\n    print('tick', i, flush=True)\n    time.sleep(1)",
    "import time\ntime.sleep(45)  # keeps the kernel busy",
]

STATE = """() => {
    const header = document.querySelector('.jp-OutputArea .widget-html-content b');
    const views = Array.from(document.querySelectorAll('.jp-OutputArea .widget-vbox'));
    const text = views.map(v => v.innerText).join('\\n');
    const prompts = Array.from(document.querySelectorAll('.jp-InputPrompt')).map(p => p.textContent);
    return {text: text, busyLast: (prompts[prompts.length - 1] || '').includes('*'),
            hasStop: !!document.querySelector('button.sdp-stop')};
}"""


def test_job_view_streams_and_stops_while_another_cell_runs(lab, jupyter_server):
    lab.open_cells("jobview_browser", CELLS)
    lab.page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); return null; }")

    def wait_for(check, what, timeout=120):
        deadline = time.monotonic() + timeout
        state = None
        while time.monotonic() < deadline:
            state = lab.page.evaluate(STATE)
            if check(state):
                return state
            time.sleep(0.25)
        lab.fail(f"{what}; last state {state}")

    state = wait_for(lambda s: "tick 2" in s["text"] and s["hasStop"] and s["busyLast"],
                     "rank 0's output in the job view while the sleep cell runs")
    assert "browser-stop" in state["text"] and "running" in state["text"]
    lab.screenshot("jobview-running")
    lab.page.locator("button.sdp-stop").click()
    state = wait_for(lambda s: "stopped" in s["text"], "the view to show the job stopped", timeout=20)
    assert state["busyLast"], "the job stopped only after the busy cell ended"
    status = (jupyter_server.jobs_dir / "browser-stop" / "status.json").read_text()
    assert '"state": "stopped"' in status
    lab.screenshot("jobview-stopped")
