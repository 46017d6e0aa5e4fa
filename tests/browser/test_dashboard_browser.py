"""notebooks/03_monitoring.ipynb in JupyterLab and chromium: the dashboard's throughput trace gains points
in the page while the 2-node job runs (at least twice while a later cell blocks in job.wait()), and the header
shows the job as running, then succeeded. Screenshots go to test-artifacts/."""
import shutil
import time

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

NOTEBOOK = "notebooks/03_monitoring.ipynb"
# JupyterLab autosaves open notebooks, outputs and widget ids included: open a copy in the (ignored)
# artifacts folder so the tracked notebook is never rewritten by a test run.
COPY = "test-artifacts/03_monitoring-browser.ipynb"

# The rendered plotly graph divs carry their data: find the dashboard's by its trace names.
STATE = """() => {
    for (const gd of document.querySelectorAll('.js-plotly-plot')) {
        const tr = (gd.data || []).find(t => t.name === 'throughput total');
        if (!tr) continue;
        const title = (gd.layout && gd.layout.title && gd.layout.title.text) || '';
        const util = (gd.data || []).filter(t => (t.name || '').includes('CPU') || (t.name || '').includes('GPU'));
        return {points: tr.x ? tr.x.length : 0, title: title, utilTraces: util.length,
                svgPaths: gd.querySelectorAll('.scatterlayer .trace path.js-line').length};
    }
    return null;
}"""


RUN_FROM = """([needle, command]) => {
    const nb = window.jupyterapp.shell.currentWidget;
    const cells = Array.from(nb.content.model.cells);
    nb.content.activeCellIndex = cells.findIndex(c => c.sharedModel.getSource().includes(needle));
    window.jupyterapp.commands.execute(command);  // not awaited: it resolves when the cells are done
    return null;
}"""

# Whether the cell whose source contains `needle` is executing now (its prompt shows [*]).
RUNNING = """(needle) => {
    const nb = window.jupyterapp.shell.currentWidget;
    const i = Array.from(nb.content.model.cells).findIndex(c => c.sharedModel.getSource().includes(needle));
    const prompt = nb.content.widgets[i].node.querySelector('.jp-InputPrompt');
    return !!prompt && prompt.textContent.includes('*');
}"""


def test_dashboard_streams_into_the_page_while_the_job_runs(lab):
    page = lab.page
    console = []
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
    (lab.server.root / "test-artifacts").mkdir(exist_ok=True)
    shutil.copyfile(lab.server.root / NOTEBOOK, lab.server.root / COPY)
    lab.open_notebook(COPY)
    # As a person would: run up to the dashboard cell and see it appear (a widget view is first built
    # while the kernel is idle), then run the cell that blocks on job.wait() and watch the plot grow.
    page.evaluate(RUN_FROM, ["job.wait(", "notebook:run-all-above"])
    states = []
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        st = page.evaluate(STATE)
        states.append(st)
        if st and st["points"] > 0 and " · running · " in st["title"]:
            break
        time.sleep(0.3)
    else:
        lab.fail(f"the dashboard never showed the running job: {states[-3:]}; console {console[-15:]}")
    page.evaluate(RUN_FROM, ["job.wait(", "notebook:run-all-below"])
    seen = []  # successive (points, title, blocked) while the job runs; blocked: job.wait() cell is [*]
    shot = None
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        st = page.evaluate(STATE)
        states.append(st)
        blocked = page.evaluate(RUNNING, "job.wait(")
        if st and " · running · " in st["title"]:
            if not seen or st["points"] > seen[-1][0]:
                seen.append((st["points"], st["title"], blocked))
                if len(seen) == 3:
                    page.locator(".js-plotly-plot").first.scroll_into_view_if_needed()
                    shot = lab.screenshot("dashboard-live")
        elif st and " · succeeded · " in st["title"]:
            break
        time.sleep(0.3)
    if len(seen) < 3 or sum(b for *_, b in seen) < 2:
        lab.fail(f"the throughput trace did not gain points while the job ran: {seen}; last states {states[-3:]}; "
                 f"browser console: {console[-15:]}")
    assert [p for p, *_ in seen] == sorted({p for p, *_ in seen})
    assert shot is not None and shot.exists()
    try:
        page.get_by_text("reopened from disk").first.wait_for(timeout=300_000)
    except Exception:
        lab.fail("the notebook's last cell did not finish")
    final = page.evaluate(STATE)
    assert " · succeeded · " in final["title"]
    assert "CPU util (no GPU)" in final["title"] or "GPU util" in final["title"]
    assert final["points"] >= seen[-1][0] and final["utilTraces"] >= 2 and final["svgPaths"] >= 4
    page.locator(".js-plotly-plot").first.scroll_into_view_if_needed()
    lab.screenshot("dashboard-finished")

