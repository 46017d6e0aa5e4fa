"""An interactive session in JupyterLab and chromium, as a person sees it: `%sdp_session start`, a
`%%sdp_px` cell whose output shows one "[rank N] ..." line per rank, a cell that raises on one rank
and whose error output names that rank and says the session is still up (and it is: the next cell's
all_reduce works), then `%sdp_session stop`, after which no rank process is left. Reuses the fixtures
of tests/browser/conftest.py (one JupyterLab for every browser test)."""
from __future__ import annotations

import time

import pytest

from conftest import wait_no_processes, worker_processes

pytestmark = [pytest.mark.slow, pytest.mark.browser]

NAME = "browser-session"
START = f"%sdp_session start --nodes 4 --name {NAME}"
HELLO = ("%%sdp_px\nimport torch, torch.distributed as dist\n"
         "print(f'hello from rank {dist.get_rank()} of {dist.get_world_size()}', flush=True)")
FAIL = "%%sdp_px\nif dist.get_rank() == 2:\n    raise ValueError('rank two is bad')\nt = torch.ones(3)\ndist.all_reduce(t)"
AFTER = "%%sdp_px --result total\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
SHOW = "print('all_reduce after the error:', total)"
STOP = "%sdp_session stop"


def test_a_session_in_the_browser_shows_every_rank_and_names_the_failed_one(lab, jupyter_server):
    job_dir = jupyter_server.jobs_dir / NAME
    started = time.monotonic()
    lab.open_cells("session_browser", ["%load_ext sdp_jupyter", START, HELLO, FAIL, AFTER, SHOW, STOP])

    for source in ("%load_ext sdp_jupyter", START):
        shown = lab.run_cell(source)
        assert not shown["error"], shown["text"]
    assert f"session {NAME}: 4 ranks ready" in shown["text"], shown["text"]
    assert len(worker_processes(job_dir)) == 4

    shown = lab.run_cell(HELLO)
    lines = [ln for ln in shown["text"].splitlines() if ln.startswith("[rank ")]
    assert sorted(lines) == [f"[rank {r}] hello from rank {r} of 4" for r in range(4)], shown["text"]
    assert not shown["error"], shown["text"]
    lab.screenshot("session-every-rank")

    shown = lab.run_cell(FAIL)
    text = shown["text"]
    assert shown["error"], f"the failing cell showed no error output: {text!r}"
    assert "rank 2 failed" in text and "ValueError: rank two is bad" in text, text
    assert "The session is still up." in text, text
    lab.screenshot("session-rank-failed")
    assert len(worker_processes(job_dir)) == 4, "a rank left with the failed cell"

    for source in (AFTER, SHOW):
        shown = lab.run_cell(source)
        assert not shown["error"], shown["text"]
    assert "all_reduce after the error: 4.0" in shown["text"], shown["text"]

    shown = lab.run_cell(STOP)
    assert f"session {NAME}: succeeded" in shown["text"], shown["text"]
    left = wait_no_processes(job_dir)
    assert left == [], f"rank processes left after %sdp_session stop: {[(p.pid, p.cmdline()) for p in left]}"
    elapsed = time.monotonic() - started
    assert elapsed < 90, f"the session test took {elapsed:.0f} s"
