"""Many ranks read as one, in JupyterLab and chromium (issue 62 item 4's acceptance): a 4-rank
`%%sdp_train --ranks-output all --wait` cell whose ranks all print one shared line and their own line,
ranks 1-3 raising the same ValueError. The job view's open panel is the merged output (the shared
line once with its ranks, every own line, the traceback once), the per-rank panels stay collapsed
below it, the cell's error groups ranks 1-3 and is the only place the failure is told (the view leaves
it out, and so does the summary printed before it), and the ended job's view shows no Stop button.

4 ranks here, not 16: this machine has 2 cores shared by JupyterLab, the kernel, chromium and the
other suite workers, and the page would only show the same merge bigger; the 16-rank case runs the
same code (the view, Job.follow, the error) with real processes in tests/launch/test_rank_groups_jobs.py.
Reuses the fixtures of tests/browser/conftest.py."""
from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

TRAIN = ("%%sdp_train --nodes 4 --backend gloo --ranks-output all --wait --name browser-merge\n"
         "import os, time\n"
         "rank = int(os.environ['RANK'])\n"
         # a barrier of files: ranks started on 2 busy cores can be seconds apart, a step's lines are not
         "barrier = os.path.join(os.environ['SDP_JOB_DIR'], 'barrier')\n"
         "os.makedirs(barrier, exist_ok=True)\n"
         "open(os.path.join(barrier, str(rank)), 'w').close()\n"
         "while len(os.listdir(barrier)) < 4:\n"
         "    time.sleep(0.01)\n"
         "print('epoch 1 done', flush=True)\n"
         "print(f'rank {rank} has shard {rank * 10}', flush=True)\n"
         "if rank > 0:\n"
         "    raise ValueError('boom on a worker')\n"
         "time.sleep(1)")

SHOWN = """(source) => {
    const nb = window.jupyterapp.shell.currentWidget;
    const i = Array.from(nb.content.model.cells).findIndex(c => c.sharedModel.getSource() === source);
    const area = nb.content.widgets[i].node.querySelector('.jp-Cell-outputArea');
    const view = area.querySelector('.widget-vbox');
    const stderr = "[data-mime-type='application/vnd.jupyter.stderr']";
    const stop = area.querySelector('button.sdp-stop');
    return {view: view ? view.innerText : '',
            error: Array.from(area.querySelectorAll(stderr)).map(e => e.innerText).join('\\n'),
            all: area.innerText,
            stopShown: !!stop && stop.offsetParent !== null};
}"""


def test_four_ranks_read_as_one_in_the_job_view_and_the_failure_stands_once(lab):
    lab.open_cells("merge_browser", ["%load_ext sdp_jupyter", TRAIN])
    assert not lab.run_cell("%load_ext sdp_jupyter")["error"]
    ran = lab.run_cell(TRAIN, timeout=120)
    assert ran["error"], f"the failing job's cell showed no error: {ran['text']!r}"
    lab.wait_text(lab.page.locator(".jp-OutputArea .widget-vbox").first, r"ranks 1-3\] ValueError", timeout=30,
                  what="the merged panel's last lines")
    shown = lab.page.evaluate(SHOWN, TRAIN)
    view, error = shown["view"], shown["error"]
    lab.screenshot("merge-four-ranks")

    # the open panel: the shared line once with its ranks, each rank's own line, one traceback
    assert view.count("epoch 1 done") == 1 and "[ranks 0-3] epoch 1 done" in view, view
    for rank in range(4):
        assert f"[rank {rank}] rank {rank} has shard {rank * 10}" in view, view
    assert view.count("Traceback (most recent call last)") == 1, view
    assert "[ranks 1-3] ValueError: boom on a worker" in view, view
    assert "all 4 ranks, merged" in view and "rank 3" in view  # the raw per-rank panels, one click away
    assert "failed" in view and not shown["stopShown"], shown  # ended: no Stop to press

    # the error groups ranks 1-3, with one traceback, and it is the only place the failure is told
    assert "ranks 1-3 raised ValueError: boom on a worker, each itself" in error, error
    assert error.count("Traceback (most recent call last)") == 1, error
    assert "lost a peer" not in error and "failed too" not in error, error
    told = shown["all"].count("raised ValueError: boom on a worker")
    assert told == 1, f"the failure is told {told} times in the cell:\n{shown['all']}"
