"""Interactive sessions (launch/kernel/session.py) without a kernel: the refusals before anything
starts, the failed cell's message, and a session on the SSH test hosts (cells through the agents)."""
from __future__ import annotations

import os
import signal
import time

import pytest

from helpers.remote_jobs import drive_cells
from sdp_jupyter.launch import JobSpec, SpecError
from sdp_jupyter.launch.kernel import session as sessions


@pytest.mark.parametrize("spec, option", [
    (JobSpec(code="pass", target="sagemaker", sagemaker={"instance_type": "ml.c5.xlarge"}), "--target"),
    (JobSpec(code="pass", max_restarts=1), "--max-restarts"),
    (JobSpec(code="pass", result="x"), "--result"),
])
def test_what_a_session_cannot_be_is_refused_before_anything_starts(spec, option, jobs_dir):
    with pytest.raises(SpecError) as e:
        sessions.Session.start(spec)
    assert e.value.option == option and "Fix" in str(e.value) or "%%sdp_px" in str(e.value)
    assert not any(jobs_dir.iterdir())


def test_a_failed_cell_names_the_rank_that_raised_before_the_ranks_it_left_waiting():
    result = sessions.CellResult(7, [0, 1, 2, 3], causes=[2])
    result.answers = {0: {"ok": False, "error": "SmddpBackendError: rank 2 shut down its process group"},
                      1: {"ok": True}, 2: {"ok": False, "error": "Traceback...\nValueError: bad"},
                      3: {"ok": False, "interrupted": True, "error": "KeyboardInterrupt"}}
    text = result.message()
    assert text.splitlines()[0] == "the cell failed on ranks 0,2-3"
    assert text.index("rank 2 failed:\nTraceback") < text.index("rank 0 failed: SmddpBackendError")
    assert "rank 3 interrupted: KeyboardInterrupt" in text and text.endswith("The session is still up.")
    assert result.failed == [0, 2, 3] and result.interrupted == [3]
    assert sessions.CellResult(1, [0, 1], answers={0: {"ok": True}, 1: {"ok": True}}).message() == ""


def test_ranks_that_raised_the_same_error_in_a_cell_show_one_traceback():
    boom = 'Traceback (most recent call last):\n  File "<cell 3>", line 2, in <module>\nValueError: boom on a worker\n'
    result = sessions.CellResult(3, list(range(4)), causes=[1, 2, 3])
    result.answers = {0: {"ok": True}} | {r: {"ok": False, "error": boom} for r in (1, 2, 3)}
    text = result.message()
    assert text.splitlines()[:2] == ["the cell failed on ranks 1-3", "ranks 1-3 failed:"], text
    assert text.count("Traceback") == 1 and text.count("ValueError: boom on a worker") == 1, text


def test_pushed_values_arrive_and_a_dead_rank_ends_the_session_naming_it(jobs_dir):
    # on gloo, whose collectives may wait on a dead peer until their timeout (test_session_replace.py:
    # on smddp the rank is started again)
    s = sessions.Session.start(JobSpec(code="pass", nodes=2, backend="gloo"))
    try:
        r = s.run("import os\nscale * (int(os.environ['RANK']) + 1)", want="gather", push_names=["scale"],
                  values={"scale": 2.5})
        assert r.failed == [] and [r.value(0), r.value(1)] == [2.5, 5.0]
        # whether a cell printed: the notebook waits for late lines only after one that did
        assert not r.printed and [a["printed"] for a in r.answers.values()] == [0, 0], r.answers
        r = s.run("import sys, warnings\nif int(os.environ['RANK']) == 1:\n    print('hi')\n"
                  "    warnings.warn('careful')")
        assert r.printed and r.answers[0]["printed"] == 0 and r.answers[1]["printed"] > len("hi\n"), r.answers
        with pytest.raises(SpecError, match="'missing' is not defined in the notebook"):
            s.run("x = 1", push_names=["missing"], values={})
        with pytest.raises(SpecError, match="rank 5 is not in this session"):
            s.run("x = 1", ranks=[5])
        os.kill(s.ready[1]["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while s.alive and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(sessions.SessionError, match=r"has ended: rank 1 .*(killed|signal|SIGKILL)"):
            s.run("x = 1")
    finally:
        s.stop()


# The cells driver (helpers/remote_jobs.py, shared with the Ray and Slurm session tests): a gather, a
# cell that raises on rank 2 and the reconnect after it, an interrupt, rank 2 SIGKILLed and replaced, stop.
@pytest.mark.slow
def test_a_session_on_the_ssh_hosts_keeps_its_ranks_between_cells(ssh_hosts, hosts, tmp_path):
    args = {"target": "ssh", "ssh": {"hosts": ssh_hosts.hosts, "config": str(ssh_hosts.config)},
            "jobs_dir": str(tmp_path / "jobs")}
    drive_cells(ssh_hosts.cluster, args, ["h1", "h2", "h3"])
    assert ssh_hosts.wait_clean(10) == {}
