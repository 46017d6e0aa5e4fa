"""Many ranks read as one, with real rank processes (issue 62 item 4's acceptance at 16 ranks): every
rank prints one shared line and its own line, ranks 1-15 raise the same ValueError. What `Job.follow`
writes (the terminal's and `--wait`'s output), the job view's merged panel, the job's error, the
`%sdp_jobs` row and `--ranks-output raw`. The cell is plain Python (no torch, no collectives), so 16
ranks start in seconds even on 2 cores; tests/browser/test_merge_browser.py shows the view in a page."""
from __future__ import annotations

import re
import time

import pytest

from sdp_jupyter.launch import launch

# A barrier of files first: 16 ranks started on 2 busy cores may be seconds apart, and lines of one step
# merge within rank_groups.WINDOW_S (a training step's collectives keep its ranks that close).
CODE = """import os, time
rank = int(os.environ["RANK"])
barrier = os.path.join(os.environ["SDP_JOB_DIR"], "barrier")
os.makedirs(barrier, exist_ok=True)
open(os.path.join(barrier, str(rank)), "w").close()
deadline = time.monotonic() + 120
while len(os.listdir(barrier)) < int(os.environ["WORLD_SIZE"]) and time.monotonic() < deadline:
    time.sleep(0.01)
print("epoch 1 done", flush=True)
print(f"rank {rank} has shard {rank * 10}", flush=True)
if rank > 0:
    raise ValueError("boom on a worker")
time.sleep(1)
"""
N = 16


@pytest.fixture(scope="module")
def job16(tmp_path_factory):
    """One 16-rank job for the module's tests (each reads it another way), in a jobs folder of its own
    (as conftest's jobs_dir, module-wide); no rank process outlives it."""
    import os

    from conftest import REPO, wait_no_processes

    root = tmp_path_factory.mktemp("jobs")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDP_JOBS_DIR", str(root))
        mp.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        job = launch(code=CODE, nodes=N, backend="gloo", name="merged16", ranks_output="all")
        written: list[str] = []
        job.follow(written.append)
        yield job, "".join(written)
    assert wait_no_processes(root) == []


def test_sixteen_ranks_print_the_shared_line_once_and_their_own_lines_each(job16):
    job, out = job16
    assert job.state == "failed"
    # the line every rank printed: once, with its ranks (they print it within a second of each other)
    assert out.count("epoch 1 done") == 1, out
    assert "[ranks 0-15] epoch 1 done\n" in out, out
    for rank in range(N):  # every rank's own line, with its own label
        assert f"[rank {rank}] rank {rank} has shard {rank * 10}\n" in out, out
    # the traceback ranks 1-15 wrote to their output: merged like any line, not fifteen times
    assert out.count("ValueError: boom on a worker") == 1 and out.count("Traceback") == 1, out
    assert "[ranks 1-15] ValueError: boom on a worker" in out, out


def test_the_error_groups_the_ranks_that_raised_and_names_no_cascade(job16):
    from sdp_jupyter.launch.kernel.rank_groups import describe
    from sdp_jupyter.magics.job_magics import _JobTable

    job, _ = job16
    error = job.error
    assert error.splitlines()[0] == "ranks 1-15 raised ValueError: boom on a worker, each itself; the first to end:", error
    assert re.match(r"rank \d+ \(node \d+, local rank 0\) exited with code 1; its last lines:$", error.splitlines()[1]), error
    assert error.count("Traceback") == 1 and error.count("ValueError: boom on a worker") == 2, error  # headline + traceback
    assert "lost a peer" not in error and "failed too" not in error, error
    assert describe(job.status["failure_groups"]) == "ranks 1-15 raised ValueError: boom on a worker"
    assert _JobTable._why(job) == "ranks 1-15 raised ValueError: boom on a worker"
    # the summary printed before the error is raised leaves the error to it
    assert "ValueError" not in job.summary(error=False) and "ValueError" in job.summary()


def test_the_job_view_merges_in_its_first_panel_keeps_the_raw_panels_and_offers_no_stop(job16):
    from sdp_jupyter.ui.jobview import JobView

    job, _ = job16
    view = JobView(job)
    view._thread.join(30)  # an ended job's view draws once and stops

    def shown(output):
        return "".join(o.get("text", "") for o in output.outputs)

    merged = shown(view.merged)
    assert merged.count("epoch 1 done") == 1 and "[ranks 0-15] epoch 1 done" in merged, merged
    assert "[rank 7] rank 7 has shard 70" in merged and merged.count("Traceback") == 1, merged
    assert view.ranks.get_title(0).startswith("all 16 ranks, merged") and view.ranks.selected_index == 0
    assert shown(view.outputs[7]).startswith("epoch 1 done\nrank 7 has shard 70\n")  # the raw view: one click
    assert view.stop_button.layout.display == "none" and view.stop_button.disabled
    assert "boom on a worker" in view.error.value  # shown alone, the view carries the error...
    view.error_below = True  # ...under a cell that raises it, it leaves it to the error
    view._redraw()
    assert "boom on a worker" not in view.error.value


def test_ranks_output_raw_labels_every_line_with_its_rank(jobs_dir):
    job = launch(code="print('same line', flush=True)", nodes=3, backend="gloo", name="raw3", ranks_output="raw")
    written: list[str] = []
    started = time.monotonic()
    assert job.follow(written.append) == "succeeded"
    out = "".join(written)
    assert sorted(ln for ln in out.splitlines() if ln) == [f"[rank {r}] same line" for r in range(3)], out
    assert time.monotonic() - started < 60
