"""The dashboard on real jobs: a live 2-node job through the launcher, finished jobs reopened from disk,
bounded windows, the header's figures and the HTML snapshot."""
from __future__ import annotations

import json
import time

import pytest

from sdp_jupyter.monitor.reader import Metrics, read
from sdp_jupyter.monitor.reporter import Reporter
from sdp_jupyter.ui.dashboard import dashboard, header_text, scaling_efficiency, snapshot
from helpers.monitor_jobs import lines, run_job, set_state, wait_for

STEPS = 60
TRAIN = f"""
import time, sdp_jupyter
from sdp_jupyter.monitor.reporter import timed
for i in timed(range({STEPS})):
    time.sleep(0.12)
    sdp_jupyter.report(step=i, samples=8, loss=1.0 / (i + 1), total_steps={STEPS})
"""


@pytest.mark.slow
def test_live_two_node_job_streams_into_the_dashboard(tmp_path):
    import sdp_jupyter

    job = sdp_jupyter.launch(code=TRAIN, nodes=2, backend="gloo", jobs_dir=str(tmp_path))
    try:
        dash = dashboard(job, interval=0.2)
        assert dash.running
        # Successive states while the job runs: the newest step and the throughput trace must grow.
        seen = []
        deadline = time.monotonic() + 120
        while len(seen) < 4 and time.monotonic() < deadline and job.state in ("pending", "running"):
            fr = dash.frame
            n = len(dash.trace("throughput total").x) if dash.trace("throughput total") else 0
            if fr is not None and fr.last_step is not None and (not seen or (fr.last_step > seen[-1][0] and n > seen[-1][1])):
                seen.append((fr.last_step, n, job.state))
            time.sleep(0.05)
        assert len(seen) == 4, f"the dashboard did not keep updating while the job ran: {seen}"
        assert all(state == "running" for *_, state in seen)
        assert "ETA" in dash.layout.title.text and f"/ {STEPS}" in dash.layout.title.text
        assert job.wait(timeout=180) == "succeeded"
        wait_for(lambda: not dash.running, timeout=30, what="the dashboard thread to stop after the job ended")
        for rank in (0, 1):
            assert dash.trace(f"loss rank {rank}").x == tuple(range(STEPS))
            assert dash.trace(f"loss rank {rank}").y == tuple(1.0 / (i + 1) for i in range(STEPS))
            assert len(dash.trace(f"throughput rank {rank}").x) == STEPS - 1
        for node in (0, 1):
            samples = [x for x in lines(job.dir / "metrics" / f"system-node-{node}.jsonl") if x["kind"] == "system"]
            assert samples and len(dash.trace(f"node {node} CPU, whole machine").y) == len(samples)
        assert "CPU utilization, no GPU" in dash.layout.annotations[1].text
        assert "succeeded" in dash.layout.title.text and "CPU util (no GPU)" in dash.layout.title.text
        # 2 ranks x 8 samples per ~0.12 s step
        assert 60 < dash.frame.steady_samples_per_s < 140
        dash.close()
    finally:
        if job.state in ("pending", "running"):
            job.stop()


@pytest.mark.slow
def test_redraws_are_rate_limited(tmp_path):
    from helpers.monitor_jobs import start_workers

    procs = start_workers(tmp_path, ranks=2, steps=300, dt=0.01)  # ~100 lines/s per rank
    t0 = time.monotonic()
    dash = dashboard(tmp_path, interval=0.5)
    for p in procs:
        p.wait(timeout=120)
    elapsed = time.monotonic() - t0
    set_state(tmp_path, "succeeded")
    wait_for(lambda: not dash.running, timeout=30, what="the dashboard to stop")
    assert 2 <= dash.redraws <= elapsed / 0.5 + 3
    assert dash.trace("loss rank 1").x == tuple(range(300))


@pytest.mark.slow
def test_finished_job_reopened_from_disk_is_drawn_once_with_everything(tmp_path):
    from sdp_jupyter.launch import Job

    import sdp_jupyter

    job = sdp_jupyter.launch(code=TRAIN.replace(f"range({STEPS})", "range(12)").replace("0.12", "0.02"),
                             nodes=2, backend="gloo", jobs_dir=str(tmp_path))
    assert job.wait(timeout=120) == "succeeded"
    dash = Job.open(job.dir).dashboard()
    assert not dash.running and dash.redraws == 1
    assert dash.trace("loss rank 1").x == tuple(range(12))
    assert "succeeded" in dash.layout.title.text and "ETA" not in dash.layout.title.text


def test_window_bounds_every_trace(tmp_path):
    rep = Reporter(str(tmp_path), 0)
    for i in range(3000):
        rep.emit("step", step_time=0.01, exposed_comm=0.002)
        rep.report(step=i, samples=4, loss=1.0)
    rep.close()
    set_state(tmp_path, "succeeded")
    dash = dashboard(tmp_path, window=250)
    assert all(len(d.x) <= 251 for d in dash.data)
    assert dash.trace("loss rank 0").x[-1] == 2999 and len(dash.trace("compute (rank 0)").x) <= 200
    assert len(dash.trace("exposed comm (rank 0)").y) == len(dash.trace("compute (rank 0)").y)


def _frame(ranks, rate_per_rank, wait=0.0):
    m = Metrics()
    m.update({"t": 100 + 0.1 * i, "kind": "step", "rank": r, "step": i, "samples": rate_per_rank * 0.1,
              "step_time": 0.1, "data_wait": wait} for i in range(50) for r in range(ranks))
    return m.frame()


def test_header_scaling_efficiency_and_input_bound_flag():
    ref, linear, half = _frame(1, 100.0), _frame(4, 100.0), _frame(4, 50.0)
    assert scaling_efficiency(linear, ref) == pytest.approx(1.0)
    assert scaling_efficiency(half, ref) == pytest.approx(0.5)
    text = header_text(half, "big", ref, "small")
    assert "scaling efficiency 0.50 vs small (1→4 ranks)" in text
    assert "input-bound" not in text
    assert "⚠ input-bound: 60% of step time waiting for data" in header_text(_frame(2, 10.0, wait=0.06))


@pytest.mark.slow
def test_reference_job_and_input_bound_job_on_real_processes(tmp_path):
    ref = run_job(tmp_path / "ref", ranks=1, steps=25, dt=0.005, wait=0.03, sampler=False)
    big = run_job(tmp_path / "big", ranks=2, steps=25, dt=0.005, wait=0.03, sampler=False)
    dash = dashboard(big, reference=ref)
    title = dash.layout.title.text
    assert "scaling efficiency" in title and "vs ref (1→2 ranks)" in title
    assert "input-bound" in title  # 30 ms of waiting for data against 5 ms of compute
    assert dash.trace("data wait (rank 0)") is not None


@pytest.mark.slow
def test_snapshot_is_self_contained_html(tmp_path):
    run_job(tmp_path / "job", ranks=2, steps=15, dt=0.01)
    path = snapshot(tmp_path / "job", str(tmp_path / "snap.html"))
    html = open(path, encoding="utf-8").read()
    assert len(html) > 1_000_000  # plotly.js inlined: opens offline
    assert '"name":"throughput rank 1"' in html and "CPU util (no GPU)" in html  # traces and header
    fr = read(tmp_path / "job")
    loss = [json.dumps(v) for v in fr.steps[0]["loss"][:3]]
    assert all(v in html for v in loss)


def test_a_diverging_loss_is_drawn_as_a_gap(tmp_path):
    rep = Reporter(str(tmp_path), 0)
    for i, loss in enumerate([1.0, float("nan"), float("inf"), 0.5]):
        rep.report(step=i, samples=4, loss=loss)
    rep.close()
    set_state(tmp_path, "failed")
    dash = dashboard(tmp_path)
    assert dash.trace("loss rank 0").y == (1.0, None, None, 0.5)
    json.dumps(dash.to_plotly_json()["data"], allow_nan=False)  # what the widget sends must be strict JSON


def test_a_sessions_cells_are_marked_on_both_time_panels(tmp_path):
    rep = Reporter(str(tmp_path), 0)
    for cell in (0, 1):
        rep.emit("cell", cell=cell)
        for i in range(3):
            rep.report(step=cell * 3 + i, samples=4, loss=1.0)
            time.sleep(0.01)
    rep.close()
    set_state(tmp_path, "succeeded")
    dash = dashboard(tmp_path)
    assert [n for _, n in dash.frame.cells] == [0, 1] and dash.frame.cells[0][0] == 0.0
    assert sorted({s.xref for s in dash.layout.shapes}) == ["x", "x2"] and len(dash.layout.shapes) == 4
    assert [a.text for a in dash.layout.annotations][-2:] == ["cell 0", "cell 1"]
    assert dash.layout.annotations[0].text.startswith("Throughput")  # the subplot titles stay
