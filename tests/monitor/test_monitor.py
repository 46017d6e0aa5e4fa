"""Worker side and reader: report()/emit()/timed(), the per-node sampler, and a reader that survives
partial lines, truncated files and killed jobs. Real processes wherever a process is involved."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sdp_jupyter.monitor import reporter
from sdp_jupyter.monitor.reader import JobDirSource, Metrics, Reader, read
from helpers.monitor_jobs import (lines, run_job, set_state, start_sampler, start_workers, wait_for,
                                  worker_env)


@pytest.fixture
def job_env(tmp_path, monkeypatch):
    monkeypatch.setenv("SDP_JOB_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    yield tmp_path
    reporter.flush()
    if reporter._reporter is not None:
        reporter._reporter.close()
    reporter._reporter = None


def test_report_appends_one_line_per_step_with_automatic_fields_merged(job_env):
    import torch

    reporter.emit("step", step_time=0.5, exposed_comm=0.1)
    reporter.report(step=0, samples=32, loss=torch.tensor(1.5), lr=0.1)
    reporter.report(samples=32, loss=1.0)             # step defaults to the next one
    reporter.emit("step", comm_time=0.2)              # no report() follows these two:
    reporter.emit("step", comm_time=0.3)              # the second starts a new step
    reporter.emit("event", what="checkpoint")         # other kinds are written at once
    reporter.flush()
    got = lines(job_env / "metrics" / "rank-3.jsonl")
    steps = [x for x in got if x["kind"] == "step"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert steps[0] == {**steps[0], "rank": 3, "samples": 32, "loss": 1.5, "lr": 0.1, "step_time": 0.5,
                        "exposed_comm": 0.1}
    assert "step_time" not in steps[1]
    assert steps[2]["comm_time"] == 0.2 and steps[2]["auto"] is True and steps[3]["comm_time"] == 0.3
    assert [x["what"] for x in got if x["kind"] == "event"] == ["checkpoint"]
    assert all(isinstance(x["t"], float) for x in got)


def test_timed_records_the_wait_for_each_batch(job_env):
    def slow():
        for i in range(3):
            time.sleep(0.05 * i)
            yield i

    for i in reporter.timed(slow()):
        reporter.report(step=i)
    got = lines(job_env / "metrics" / "rank-3.jsonl")
    waits = [x["data_wait"] for x in got]
    assert waits[0] < 0.04 and waits[1] >= 0.045 and waits[2] >= 0.095


def test_report_outside_a_job_warns_once_and_writes_nothing(tmp_path):
    env = dict(os.environ)
    env.pop("SDP_JOB_DIR", None)
    code = "import sdp_jupyter\nfor i in range(5): sdp_jupyter.report(step=i, loss=1.0)\nprint('ok')"
    out = subprocess.run([sys.executable, "-W", "default", "-c", code], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok"
    assert out.stderr.count("SDP_JOB_DIR is not set") == 1
    assert os.listdir(tmp_path) == []


def test_a_forked_child_writes_through_its_own_file_object(job_env):
    reporter.report(step=0)
    pid = os.fork()
    if pid == 0:
        reporter.report(step=100)
        reporter._reporter._file.flush()
        os._exit(0)
    os.waitpid(pid, 0)
    reporter.report(step=1)
    reporter.flush()
    assert sorted(x["step"] for x in lines(job_env / "metrics" / "rank-3.jsonl")) == [0, 1, 100]


# ---- reader ------------------------------------------------------------------------------------

def _line(step, rank=0, **kw):
    return json.dumps({"t": 1000.0 + step, "kind": "step", "rank": rank, "step": step, "samples": 8, **kw}) + "\n"


def test_reader_keeps_a_partial_line_until_its_newline_arrives(tmp_path):
    m = tmp_path / "metrics"
    m.mkdir()
    full = _line(1)
    (m / "rank-0.jsonl").write_text(_line(0) + full[:17])
    src = JobDirSource(tmp_path)
    assert [e["step"] for e in src.poll()] == [0]
    assert src.poll() == []
    with open(m / "rank-0.jsonl", "a") as f:
        f.write(full[17:])
    assert [e["step"] for e in src.poll()] == [1]
    assert src.skipped == 0


def test_reader_skips_garbage_and_starts_over_when_a_file_shrinks(tmp_path):
    m = tmp_path / "metrics"
    m.mkdir()
    p = m / "rank-0.jsonl"
    p.write_text(_line(0) + "not json\n" + "\x00\x00\x00\n" + "[1, 2]\n" + _line(1) + _line(2))
    reader = Reader(tmp_path)
    fr = reader.poll()
    assert fr.rank_steps(0) == [0, 1, 2] and reader.source.skipped == 3
    p.write_text(_line(0) + _line(1))  # replaced by a shorter file (a restarted job)
    reader.poll()
    with open(p, "a") as f:
        f.write(_line(2) + _line(3))
    fr = reader.poll()
    assert fr.rank_steps(0) == [0, 1, 2, 3]  # merged by (rank, step): no step counted twice
    assert fr.last_step == 3


def test_reader_of_a_finished_job_keeps_a_whole_unterminated_last_line_and_drops_a_cut_one(tmp_path):
    m = tmp_path / "metrics"
    m.mkdir()
    (m / "rank-0.jsonl").write_text(_line(0) + _line(1).rstrip("\n"))
    (m / "rank-1.jsonl").write_text(_line(0, rank=1) + _line(1, rank=1)[:30])
    set_state(tmp_path, "failed")
    fr = read(tmp_path)
    assert fr.rank_steps(0) == [0, 1] and fr.rank_steps(1) == [0]
    assert fr.done is True and fr.state == "failed" and fr.skipped_lines == 1


def test_reader_of_a_missing_or_empty_job_directory_gives_an_empty_frame(tmp_path):
    fr = read(tmp_path / "nothing-here")
    assert fr.ranks == [] and fr.samples_per_s is None and fr.throughput_total == ((), ())
    assert repr(fr).startswith("Frame(state=None, ranks=[], last_step=None")


@pytest.mark.slow
def test_reader_reads_a_job_killed_mid_run(tmp_path):
    procs = start_workers(tmp_path, ranks=2, steps=100_000, dt=0.005)
    wait_for(lambda: all(len(read(tmp_path).rank_steps(r)) > 20 for r in (0, 1)), what="20 steps per rank")
    for p in procs:
        p.send_signal(signal.SIGKILL)
        p.wait()
    with open(tmp_path / "metrics" / "rank-1.jsonl", "a") as f:
        f.write('{"t": 1, "kind": "st')  # what a crash in the middle of a write leaves
    set_state(tmp_path, "running")        # the launcher died too: the state was never updated
    fr = read(tmp_path)
    for r in (0, 1):
        got = fr.rank_steps(r)
        assert got == list(range(len(got))) and len(got) > 20
    assert fr.done is False and fr.steady_samples_per_s > 0  # no pids recorded: cannot tell
    # with the pids the launcher records, a job whose processes are all gone reads as failed, as the
    # job view says (one rule: sdp_jupyter.jobdir.seen_status)
    launcher = subprocess.Popen([sys.executable, "-c", "pass"])
    launcher.wait()
    status = {"state": "running", "pids": [p.pid for p in procs], "launcher_pid": launcher.pid}
    (tmp_path / "status.json").write_text(json.dumps(status))
    fr = read(tmp_path)
    assert fr.done is True and fr.state == "failed" and fr.skipped_lines == 1
    from sdp_jupyter.launch import Job, JobSpec

    (tmp_path / "spec.json").write_text(JobSpec(code="pass", nodes=2).to_json())
    job = Job.open(tmp_path)  # the job view reads the same directory the same way
    assert job.state == "failed" and "the launcher (pid" in job.error
    status["launcher_pid"] = os.getpid()  # a live launcher: the job may still be running
    (tmp_path / "status.json").write_text(json.dumps(status))
    assert read(tmp_path).done is False


def test_metrics_windows_are_bounded_and_totals_are_not():
    m = Metrics(window=50)
    m.update({"t": 100.0 + 0.1 * i, "kind": "step", "rank": r, "step": i, "samples": 4, "loss": 1.0}
             for i in range(1000) for r in (0, 1))
    fr = m.frame()
    assert len(fr.rank_steps(0)) == 50 and fr.rank_steps(0)[-1] == 999
    assert len(fr.throughput_total[0]) <= 51
    # two ranks, 4 samples every 0.1 s each
    assert fr.steady_samples_per_s == pytest.approx(80.0, rel=1e-6)
    assert fr.throughput[0][1][-1] == pytest.approx(40.0, rel=1e-6)


def test_metrics_flags_input_bound_steps_and_computes_eta():
    m = Metrics()
    m.update({"t": 10.0 + i, "kind": "step", "rank": 0, "step": i, "samples": 1, "step_time": 1.0,
              "data_wait": 0.6, "exposed_comm": 0.1, "total_steps": 100} for i in range(10))
    fr = m.frame()
    assert fr.input_bound == pytest.approx(0.6) and fr.comm_share == pytest.approx(0.1)
    assert fr.steps[0]["compute"][-1] == pytest.approx(0.3)
    assert fr.eta_s == pytest.approx(90.0)


# ---- sampler -----------------------------------------------------------------------------------

def _nvml_available() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        return True
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(_nvml_available(), reason="this machine has NVML: the GPU test below runs instead")
def test_sampler_without_nvml_samples_cpu_says_so_and_finds_the_job_processes(tmp_path):
    samp = start_sampler(tmp_path, 0)
    procs = start_workers(tmp_path, ranks=1, steps=400, dt=0.01)  # ~4 s of busy CPU
    path = tmp_path / "metrics" / "system-node-0.jsonl"
    try:
        busy = wait_for(lambda: [x for x in lines(path) if x.get("proc_util", 0) > 20] if path.exists() else [],
                        timeout=60, what="a sample that sees the worker busy")
    finally:
        for p in procs:
            p.wait(timeout=60)
        samp.send_signal(signal.SIGTERM)
        _, err = samp.communicate(timeout=10)
    assert samp.returncode == 0
    assert "NVML unavailable" in err and "CPU, not GPU" in err
    got = lines(path)
    assert got[0]["kind"] == "sampler" and got[0]["source"] == "psutil" and "not GPU" in got[0]["note"]
    system = [x for x in got if x["kind"] == "system"]
    assert {x["device"] for x in system} == {"cpu"} and {x["source"] for x in system} == {"psutil"}
    assert all(0 <= x["util"] <= 100 and x["mem_total"] > x["mem_used"] > 0 for x in system)
    assert busy[0]["nproc"] >= 1 and busy[0]["ncpu"] >= 1


@pytest.mark.slow
@pytest.mark.skipif(not _nvml_available(), reason="needs NVML (a GPU machine)")
def test_sampler_with_nvml_reports_each_gpu(tmp_path):
    samp = start_sampler(tmp_path, 0)
    path = tmp_path / "metrics" / "system-node-0.jsonl"
    wait_for(lambda: path.exists() and len(lines(path)) >= 3, timeout=30, what="samples")
    samp.send_signal(signal.SIGTERM)
    _, err = samp.communicate(timeout=10)
    got = lines(path)
    assert got[0]["source"] == "nvml" and "NVML" in err
    gpus = [x for x in got if x["kind"] == "system"]
    assert gpus and all(x["device"].startswith("gpu") and 0 <= x["util"] <= 100 for x in gpus)


@pytest.mark.slow
def test_sampler_stops_when_its_parent_dies(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-m", "sdp_jupyter.monitor.sampler", "--job-dir", {str(tmp_path)!r},
                              "--node", "1", "--interval", "0.2"])
        print(p.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, env=worker_env(tmp_path, 0))
    pid = int(parent.stdout.readline())
    path = tmp_path / "metrics" / "system-node-1.jsonl"
    wait_for(lambda: path.exists() and len(lines(path)) >= 2, timeout=30, what="first samples")
    parent.kill()
    parent.wait()
    wait_for(lambda: not _alive(pid), timeout=10, what="the sampler to exit after its parent died")


@pytest.mark.slow
def test_sampler_stops_when_the_job_reaches_a_final_state_and_never_counts_itself(tmp_path):
    samp = start_sampler(tmp_path, 0, "--interval", "0.2", "--cpu")  # started with the job's environment
    path = tmp_path / "metrics" / "system-node-0.jsonl"
    wait_for(lambda: path.exists() and len(lines(path)) >= 4, timeout=30, what="first samples")
    set_state(tmp_path, "succeeded")
    assert samp.wait(timeout=10) == 0
    assert "CPU sampling requested" in lines(path)[0]["note"]
    assert all(x["nproc"] == 0 for x in lines(path)[1:])  # no worker ran: the sampler is not one


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_real_job_directory_from_two_ranks_and_a_sampler(tmp_path):
    run_job(tmp_path, ranks=2, steps=30, dt=0.02)
    fr = read(tmp_path)
    assert fr.ranks == [0, 1]
    for r in (0, 1):
        assert fr.rank_steps(r) == list(range(30))
        assert fr.steps[r]["loss"] == [2.0 / (i + 1) for i in range(30)]
        assert all(w is not None for w in fr.steps[r]["data_wait"])
    assert fr.system[(0, "cpu")]["util"] and fr.util_kind == "CPU" and fr.system_sources == {0: "psutil"}
    # 16 samples per ~0.02 s step per rank: between 200 and 1600 samples/s in all on a loaded 2-core box
    assert 200 < fr.steady_samples_per_s < 1600
    assert "ranks=[0, 1], last_step=29" in repr(fr) and "CPU" in repr(fr) and len(repr(fr)) < 400


def test_mean_utilization_covers_the_gpus_when_there_are_any():
    m = Metrics()
    m.update([{"t": 10.0, "kind": "system", "node": 0, "device": "gpu", "source": "cloudwatch", "util": 80.0},
              {"t": 10.0, "kind": "system", "node": 1, "device": "gpu0", "source": "nvml", "util": 40.0},
              {"t": 10.0, "kind": "system", "node": 0, "device": "cpu", "source": "cloudwatch", "util": 5.0}])
    fr = m.frame()
    assert (fr.util_kind, fr.mean_util) == ("GPU", 60.0)
    cpu_only = Metrics()
    cpu_only.update([{"t": 10.0 + i, "kind": "system", "node": 0, "device": "cpu", "source": "psutil", "util": 10.0 * i}
                     for i in range(10)])  # within 5 s of the last sample (t=19): t=14..19, util 40..90
    assert (cpu_only.frame().util_kind, cpu_only.frame().mean_util) == ("CPU", 65.0)


def test_a_ranks_metrics_file_is_private_and_never_written_through_a_link(tmp_path):
    """report() writes metrics/rank-R.jsonl 0600 (logs can carry what a script printed; docs/security.md),
    and refuses a link planted in its place."""
    import stat

    from sdp_jupyter import jobdir

    rep = reporter.Reporter(str(tmp_path), 0)
    rep.report(step=1, samples=4, loss=1.0)
    rep.close()
    path = jobdir.rank_metrics_path(tmp_path, 0)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and b'"step":1' in path.read_bytes().replace(b" ", b"")
    other = tmp_path / "elsewhere.jsonl"
    other.write_text("")
    link = jobdir.rank_metrics_path(tmp_path, 1)
    link.symlink_to(other)
    rep = reporter.Reporter(str(tmp_path), 1)
    with pytest.raises(OSError):
        rep._open()
    assert other.read_text() == ""
