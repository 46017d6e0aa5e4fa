"""Issue 11, items 5-7: private job directories, safe pickles and checkpoints, bounded and
type-checked metrics and logs, escaped HTML, and Stop when SIGINT is ignored."""
from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from sdp_jupyter import jobdir


def _mode(p):
    return stat.S_IMODE(os.lstat(p).st_mode)


# ---------------------------------------------------------------- 5: job directory and pickles

def test_job_directory_is_private(tmp_path, jobs_dir):
    from sdp_jupyter.launch import launch

    job = launch(code="print('hi')\n42", nodes=1, backend="gloo", name="private", env={"TOKEN": "s3cret"})
    assert job.wait(120) == "succeeded", job.error
    assert _mode(job.dir) == 0o700 and _mode(job.dir.parent) == 0o700
    for f in ("spec.json", "script.py", "result.pkl", "status.json", "logs/rank-0.log"):
        assert _mode(job.dir / f) == 0o600, f
    for d in ("logs", "metrics"):
        assert _mode(job.dir / d) == 0o700, d
    assert job.result() == 42


def test_directory_owned_by_someone_else_is_refused(tmp_path):
    victim = tmp_path / "theirs"
    victim.mkdir()
    os.chown(victim, 12345, 12345)
    with pytest.raises(jobdir.UnsafeJobDir, match="belongs to user id 12345"):
        jobdir.ensure_private_dir(victim)
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    with pytest.raises(jobdir.UnsafeJobDir, match="not a directory"):
        jobdir.ensure_private_dir(link)


def test_private_writes_never_follow_a_planted_link(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("untouched")
    d = jobdir.ensure_private_dir(tmp_path / "job")
    # a predictable temporary name of the old code, planted as a link
    (d / f".status.json.{os.getpid()}.tmp").symlink_to(target)
    jobdir.write_json_atomic(d / "status.json", {"state": "running"})
    assert target.read_text() == "untouched"
    assert json.loads((d / "status.json").read_text()) == {"state": "running"}
    assert _mode(d / "status.json") == 0o600
    (d / "status.json").unlink()
    (d / "status.json").symlink_to(target)
    with pytest.raises(OSError):
        with jobdir.open_private(d / "status.json") as f:
            f.write(b"x")
    assert target.read_text() == "untouched"


def test_pickles_load_only_from_private_files(tmp_path):
    import pickle

    d = jobdir.ensure_private_dir(tmp_path / "job")
    jobdir.write_private(d / "result.pkl", pickle.dumps({"w": 1}))
    assert jobdir.load_pickle(d / "result.pkl") == {"w": 1}
    os.chmod(d / "result.pkl", 0o666)
    with pytest.raises(jobdir.UnsafeJobDir, match="not yours alone"):
        jobdir.load_pickle(d / "result.pkl")
    os.chmod(d / "result.pkl", 0o600)
    os.chmod(d, 0o777)
    with pytest.raises(jobdir.UnsafeJobDir, match="directory"):
        jobdir.load_pickle(d / "result.pkl")


def test_checkpoint_load_refuses_code_by_default(tmp_path, monkeypatch):
    import torch

    from sdp_jupyter import checkpoint

    monkeypatch.setenv("SDP_CHECKPOINT_DIR", str(tmp_path))
    checkpoint.save({"step": 3, "w": torch.ones(2)})
    assert checkpoint.load()["step"] == 3
    assert _mode(tmp_path / "checkpoint.pt") == 0o600

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="[Ww]eights only"):
        checkpoint.load("evil.pt")


# ---------------------------------------------------------------- 6: metrics and logs

def test_wrong_types_are_skipped_and_counted(tmp_path):
    from sdp_jupyter.monitor.reader import read
    from sdp_jupyter.ui.dashboard import header_text

    job = tmp_path / "job"
    (job / "metrics").mkdir(parents=True)
    good = [{"t": 1.0 + i, "kind": "step", "rank": 0, "step": i, "samples": 8, "loss": 1.0 / (i + 1)}
            for i in range(5)]
    bad = [{"t": 2.0, "kind": "step", "rank": [0], "step": 1}, {"t": float("inf"), "kind": "step", "rank": 0},
           {"t": 3.0, "kind": "step", "rank": 0, "step": 9, "samples": "many"}, [1, 2], {"t": "x"},
           {"t": 4.0, "kind": "system", "node": 0, "device": "cpu", "util": {"a": 1}}]
    lines = [json.dumps(r) for r in good[:3]] + [json.dumps(r) for r in bad] + [json.dumps(r) for r in good[3:]]
    (job / "metrics" / "rank-0.jsonl").write_text("\n".join(lines) + "\n")
    fr = read(str(job))
    assert fr.skipped_lines == len(bad)
    assert fr.last_step == 4
    assert f"{len(bad)} bad records skipped" in header_text(fr, "job")


def test_huge_lines_are_never_held_whole(tmp_path):
    job = tmp_path / "job"
    (job / "metrics").mkdir(parents=True)
    with open(job / "metrics" / "rank-0.jsonl", "wb") as f:
        f.write(json.dumps({"t": 1.0, "kind": "step", "rank": 0, "step": 0}).encode() + b"\n")
        f.write(b'{"t": 2.0, "junk": "' + b"x" * (3 * jobdir.LINE_CAP) + b'"}\n')
        f.write(json.dumps({"t": 3.0, "kind": "step", "rank": 0, "step": 1}).encode() + b"\n")
    tail = jobdir.JsonLinesTail(job / "metrics" / "rank-0.jsonl")  # the one tailer the reader uses
    out = tail.records(final=True)
    assert [e["step"] for e in out] == [0, 1] and tail.bad == 1
    assert len(tail.rest) <= jobdir.LINE_CAP

    log = tmp_path / "rank-0.log"
    with open(log, "wb") as f:
        f.write(b"first\n" + b"y" * (5 * jobdir.LINE_CAP) + b"\nlast\n")
    text = jobdir.read_log(log)
    assert text.startswith("first\n") and text.endswith("last\n") and "line cut at" in text
    assert len(text) < 2 * jobdir.LINE_CAP
    assert jobdir.read_log(log, tail=1) == "last\n"


def test_job_view_escapes_what_it_reads(tmp_path, jobs_dir):
    pytest.importorskip("ipywidgets")
    from sdp_jupyter.launch import launch

    job = launch(code="1", nodes=1, backend="gloo", name="esc")
    job.wait(120)
    st = json.loads((job.dir / "status.json").read_text())
    st["state"] = "<img src=x onerror=alert(1)>"
    st["error"] = "<script>alert(2)</script>"
    st["restarts"] = "<b>3</b>"
    jobdir.write_json_atomic(job.dir / "status.json", st)
    from sdp_jupyter.launch import Job
    view = Job.open(job.dir).view()
    view._redraw()
    assert "<img" not in view.header.value and "<script>" not in view.error.value and "<b>3</b>" not in view.header.value


# ---------------------------------------------------------------- 7: Stop when SIGINT is ignored

_STOP_FROM_IGNORING_SHELL = textwrap.dedent("""
    import json, signal, sys, time
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    from sdp_jupyter.launch import launch
    job = launch(code="import time\\nprint('started', flush=True)\\nfor i in range(600):\\n    time.sleep(0.1)\\n",
                 nodes=2, backend="gloo", name="ignores-sigint")
    deadline = time.monotonic() + 60
    # both ranks in the script: a rank still starting has SIGINT ignored (inherited) until the
    # worker installs its handler, and a stop then reaches it only as SIGTERM
    while not all("started" in job.logs(r) for r in (0, 1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(json.dumps({"state": job.stop(), "codes": job.exit_codes, "log": job.logs(0)}))
""")


@pytest.mark.slow
def test_stop_works_when_the_launcher_ignores_sigint(tmp_path, jobs_dir):
    p = subprocess.run([sys.executable, "-c", _STOP_FROM_IGNORING_SHELL], capture_output=True, text=True,
                       timeout=120, cwd=REPO, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["state"] == "stopped"
    assert out["codes"] == [-signal.SIGINT, -signal.SIGINT], out
    assert "interrupted" in out["log"] and "line" in out["log"], out["log"]
