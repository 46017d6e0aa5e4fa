"""`--target sagemaker` against a local moto server, never AWS: a job driven through InProgress ->
Training -> Completed / Failed by the test, with log events and instance metrics written into moto's
CloudWatch, and what the job handle, its directory, the reader, the job view, the dashboard, the
magics and the setup form make of them; stop. (The requests themselves: test_sagemaker.py.)
"""
from __future__ import annotations

import json
import re
import time

import pytest

from helpers.moto import BUCKET, REGION, ROLE, MotoAWS

pytest.importorskip("sagemaker.train")
pytest.importorskip("moto.server")

from sdp_jupyter.launch import launch  # noqa: E402
from sdp_jupyter.launch.targets.sagemaker.training_job import SageMakerJob  # noqa: E402
from sdp_jupyter.launch.targets.sagemaker.submit import SageMakerLauncher  # noqa: E402
from sdp_jupyter.monitor import cloudwatch  # noqa: E402
from helpers.sagemaker_jobs import CELL, make_spec, s3_json, wait_for, wire_request  # noqa: E402


# ------------------------------------------------------------------------------------------------
# A job driven through its states by the test
# ------------------------------------------------------------------------------------------------
def metric_lines(rank: int, steps: int, t0: float) -> list[str]:
    return [cloudwatch.format_log_line({"t": t0 + s * 0.5, "kind": "step", "rank": rank, "step": s,
                                        "samples": 32, "loss": 2.0 / (s + 1), "step_time": 0.5})
            for s in range(steps)]


def test_job_runs_to_completion_with_logs_and_metrics(aws, tmp_path):
    job = launch(make_spec(tmp_path, "life-ok", nodes=2, backend="smddp", procs_per_node=2,
                           hyperparameters={"total_steps": 4}, sagemaker={"instance_type": "ml.p4d.24xlarge"}))
    name = job.training_job_name
    view = job.view()
    wait_for(lambda: job.sagemaker.get("secondary_status") == "Starting", what="first poll")
    assert job.state == "pending"
    aws.set_status(name, "InProgress", "Training", message="Training image download completed.")
    wait_for(lambda: job.state == "running", what="running")
    t0 = time.time()
    aws.put_log_lines(name, 1, ["hello from algo-1"] + metric_lines(0, 4, t0) + metric_lines(1, 4, t0), t0)
    aws.put_log_lines(name, 2, ["hello from algo-2"] + metric_lines(2, 4, t0) + metric_lines(3, 4, t0), t0)
    for host, gpu in ((1, 640.0), (2, 320.0)):  # 0-100 x 8 GPUs
        aws.put_host_metric(name, host, "GPUUtilization", gpu, t0)
        aws.put_host_metric(name, host, "GPUMemoryUtilization", 400.0, t0)
        aws.put_host_metric(name, host, "CPUUtilization", 960.0, t0)  # 0-100 x 96 vCPUs
        aws.put_host_metric(name, host, "MemoryUtilization", 25.0, t0)
    wait_for(lambda: "hello from algo-2" in job.logs(1), what="host 2's log")
    aws.set_status(name, "Completed")
    assert job.wait(30) == "succeeded"
    assert job.error is None
    assert job.logs(0).startswith("hello from algo-1\n") and "hello from algo-2" not in job.logs(0)
    st = job.status["sagemaker"]
    assert [t["status"] for t in st["transitions"]] == ["Starting", "Training", "Completed"]
    # the reader sees the job like a local one: steps per rank, throughput, normalised utilisation
    from sdp_jupyter.monitor.reader import read

    frame = read(job)
    assert frame.ranks == [0, 1, 2, 3] and frame.last_step == 3 and frame.total_steps == 4
    assert frame.steps[0]["loss"] == [2.0, 1.0, 2.0 / 3, 0.5]
    assert frame.unit == "samples/s"
    gpu = {node: frame.system[(node, "gpu")] for node in (0, 1)}
    assert gpu[0]["util"] == [80.0] and gpu[1]["util"] == [40.0]
    assert frame.system[(0, "cpu")]["util"] == [10.0]
    assert gpu[0]["mem_total"] == [8 * 40 * 2**30] and gpu[0]["mem_used"] == [0.5 * 8 * 40 * 2**30]
    # the dashboard draws them (per-host GPU lines from CloudWatch, per-rank loss from the log lines)
    dash = job.dashboard()
    try:
        assert dash.trace("node 0 GPU").y == (80.0,) and dash.trace("node 1 GPU").y == (40.0,)
        assert dash.trace("node 0 CPU, whole machine").y == (10.0,)
        assert dash.trace("loss rank 3").y == (2.0, 1.0, 2.0 / 3, 0.5)
    finally:
        dash.stop()
    # the view: one pane per host, rank 0's host open, SageMaker status in the header
    wait_for(lambda: "Completed" in view.header.value and "succeeded" in view.header.value, what="view")
    assert [view.ranks.get_title(h) for h in (0, 1)] == ["algo-1 (ranks 0-1)", "algo-2 (ranks 2-3) (opens its log)"]
    wait_for(lambda: view.outputs[0].outputs and "hello from algo-1" in view.outputs[0].outputs[0]["text"],
             what="host 1's pane")
    assert "[sagemaker] Training: Training image download completed." in view.outputs[0].outputs[0]["text"]
    assert not view.outputs[1].outputs
    view.ranks.selected_index = 1
    assert "hello from algo-2" in view.outputs[1].outputs[0]["text"]
    # and a new handle reopened from the directory alone
    from sdp_jupyter.launch import Job

    again = Job.open(job.dir)
    assert isinstance(again, SageMakerJob)
    assert again.state == "succeeded" and again.training_job_name == name and not again.live
    assert again.logs(1).startswith("hello from algo-2\n")


def test_failed_job_shows_the_failure_reason(aws, tmp_path):
    job = launch(make_spec(tmp_path, "life-fail", backend="gloo", sagemaker={"instance_type": "ml.m5.xlarge"}))
    view = job.view()
    name = job.training_job_name
    aws.set_status(name, "InProgress", "Training")
    aws.put_log_lines(name, 1, ["Traceback (most recent call last):", "ZeroDivisionError: division by zero"])
    reason = "AlgorithmError: rank 0 of job life-fail failed: ZeroDivisionError: division by zero"
    wait_for(lambda: "ZeroDivisionError" in job.logs(0), what="the traceback")
    aws.set_status(name, "Failed", failure_reason=reason)
    assert job.wait(30) == "failed"
    assert job.error == reason
    from sdp_jupyter.launch import JobError

    with pytest.raises(JobError, match="division by zero"):
        job.raise_for_state()
    wait_for(lambda: "division by zero" in view.error.value and "failed" in view.header.value, what="view error")
    assert "Failed" in view.header.value
    assert reason in job.summary()


def test_stop_button_calls_stop_training_job(aws, tmp_path):
    job = launch(make_spec(tmp_path, "to-stop", backend="gloo", sagemaker={"instance_type": "ml.m5.xlarge"}))
    name = job.training_job_name
    view = job.view()
    aws.set_status(name, "InProgress", "Training")
    wait_for(lambda: job.state == "running", what="running")
    view.stop_button.click()
    wait_for(lambda: aws.status(name) == "Stopping", what="StopTrainingJob")
    wait_for(lambda: job.sagemaker.get("status") == "Stopping", what="Stopping seen")
    assert job.state == "running" and not job.done  # SageMaker is still stopping it
    aws.set_status(name, "Stopped")
    assert job.wait(30) == "stopped"
    assert job.stop() == "stopped"  # stopping a stopped job is a no-op


def test_result_comes_from_the_output_archive(aws, tmp_path):
    import io
    import pickle
    import tarfile

    job = launch(make_spec(tmp_path, "with-result", backend="gloo", sagemaker={"instance_type": "ml.m5.xlarge"}))
    name = job.training_job_name
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:  # what SageMaker uploads from /opt/ml/output/data
        data = pickle.dumps({"accuracy": 0.97})
        info = tarfile.TarInfo("sdp_job/result.pkl")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    aws.client("s3").put_object(Bucket=BUCKET, Key=f"with-result/{name}/output/output.tar.gz", Body=buf.getvalue())
    aws.set_status(name, "Completed")
    assert job.wait(30) == "succeeded"
    assert job.result() == {"accuracy": 0.97}


# ------------------------------------------------------------------------------------------------
# CloudWatch pieces on their own
# ------------------------------------------------------------------------------------------------
def test_log_line_format_round_trip_and_metric_regexes():
    record = {"t": 1.5, "kind": "step", "rank": 0, "step": 7, "samples": 64, "loss": 0.25, "step_time": 0.5,
              "exposed_comm": 0.01}
    line = cloudwatch.format_log_line(record)
    assert line.startswith('[sdp-metrics] {"kind":"step","rank":0,"step":7,')
    event = cloudwatch.parse_log_line("2026-11-21 stdout: " + line, host=1)
    assert event == {**record, "throughput": 128.0, "node": 1}
    found = {}
    for m in cloudwatch.METRIC_DEFINITIONS:
        hit = re.search(m["Regex"], line)
        found[m["Name"]] = float(hit.group(1)) if hit else None
    assert found == {"sdp:loss": 0.25, "sdp:throughput": 128.0, "sdp:step_time": 0.5}
    other_rank = cloudwatch.format_log_line({**record, "rank": 3})
    assert not any(re.search(m["Regex"], other_rank) for m in cloudwatch.METRIC_DEFINITIONS)
    # throughput from the time since the previous step when there is no step_time
    nostep = cloudwatch.format_log_line({"t": 3.0, "kind": "step", "rank": 0, "step": 8, "samples": 10}, 2.0)
    assert cloudwatch.parse_log_line(nostep)["throughput"] == 10.0
    assert cloudwatch.parse_log_line("[sdp-metrics] {not json") is None
    assert cloudwatch.parse_log_line("plain output") is None
    assert cloudwatch.host_index("job-1/algo-12-1700000000") == 11
    assert cloudwatch.host_index("job-1/algo-2") == 1


def test_cloudwatch_source_is_a_metrics_source(aws, tmp_path):
    from sdp_jupyter.monitor.reader import MetricsSource, Reader

    job = launch(make_spec(tmp_path, "cw-source", nodes=2, backend="smddp", procs_per_node=1,
                           sagemaker={"instance_type": "ml.p4de.24xlarge"}))
    name = job.training_job_name
    lines = []
    source = cloudwatch.CloudWatchSource(name, region=REGION, world_size=2,
                                         on_line=lambda h, text, t: lines.append((h, text)))
    assert isinstance(source, MetricsSource)
    assert (source.hosts, source.instance_type) == (2, "ml.p4de.24xlarge")
    reader = Reader(source)
    t0 = time.time()
    aws.set_status(name, "InProgress", "Training")
    aws.put_log_lines(name, 2, ["from host two"] + metric_lines(1, 3, t0), t0)
    aws.put_host_metric(name, 2, "GPUUtilization", 800.0, t0)
    frame = reader.poll()
    assert frame is not None and frame.ranks == [1] and not reader.done()
    assert (1, "from host two") in lines
    aws.set_status(name, "Completed")
    frame = reader.poll()
    assert reader.done() and frame.done and frame.state == "succeeded"
    assert frame.system[(1, "gpu")]["util"] == [100.0]
    assert job.wait(30) == "succeeded"


def test_host_metrics_wait_for_a_complete_minute(aws):
    """A minute is emitted once per host and device, when both of its metrics are in (or it is old)."""
    name = "metrics-only-20261122000000"
    hm = cloudwatch.HostMetrics(name, 1, "ml.g5.12xlarge", region=REGION, start=time.time() - 600)
    t = (time.time() // 60) * 60
    aws.put_host_metric(name, 1, "CPUUtilization", 2400.0, t)  # 0-100 x 48 vCPUs
    aws.put_host_metric(name, 1, "GPUUtilization", 200.0, t)   # 0-100 x 4 GPUs
    assert hm.poll() == []  # MemoryUtilization / GPUMemoryUtilization of that minute may still come
    aws.put_host_metric(name, 1, "MemoryUtilization", 20.0, t)
    cpu = hm.poll()
    assert [(e["device"], e["util"], e["mem_util"], e["ncpu"]) for e in cpu] == [("cpu", 50.0, 20.0, 48)]
    gpu = hm.poll(now=t + hm.lag_s + 1)  # an old minute is complete as it is
    assert [(e["device"], e["util"], e["gpus"], "mem_util" in e) for e in gpu] == [("gpu", 50.0, 4, False)]
    assert hm.poll(final=True) == []  # each minute once


def test_gate_reaches_a_client_the_sdk_made_before(aws, tmp_path, capsys):
    """botocore clients copy the session's hooks when they are made, and the SDK caches its client per
    session: with a given session whose client already exists the gate must still see the request."""
    import boto3
    from sagemaker.core.helper.session_helper import Session
    from sagemaker.core.resources import Base

    boto = boto3.Session(region_name=REGION)
    Base.get_sagemaker_client(session=boto, region_name=None, service_name="sagemaker")
    launcher = SageMakerLauncher(session=Session(boto_session=boto, default_bucket=BUCKET))
    job = launcher.start(make_spec(tmp_path, "given-session", backend="gloo",
                                   sagemaker={"instance_type": "ml.m5.xlarge"}))
    assert job.request == wire_request()  # seen (and checked) by the gate
    assert "was not checked" not in capsys.readouterr().out
    aws.set_status(job.training_job_name, "Completed")
    assert job.wait(20) == "succeeded"


def test_magics_start_list_and_stop_a_sagemaker_job(aws, tmp_path, monkeypatch):
    import threading

    from IPython.testing.globalipapp import get_ipython

    monkeypatch.setenv("SDP_JOBS_DIR", str(tmp_path / "jobs"))
    monkeypatch.setenv("SDP_SAGEMAKER_POLL_INTERVAL", "0.1")
    ip = get_ipython()
    ip.run_line_magic("load_ext", "sdp_jupyter")
    result = ip.run_cell(f"%%sdp_train --target sagemaker --name magic-sm --nodes 2 --backend gloo "
                         f"--instance-type ml.m5.xlarge --role {ROLE} --bucket {BUCKET} --spot --max-run 600\n"
                         "print('hi')\n")
    assert result.error_in_exec is None and result.error_before_exec is None
    job = result.result
    assert isinstance(job, SageMakerJob) and job.spec.sagemaker["spot"] is True
    req = wire_request()
    assert req["TrainingJobName"] == job.training_job_name
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 600, "MaxWaitTimeInSeconds": 1200}
    assert (job.dir / "script.py").read_text().startswith(
        "# %%sdp_train --nodes 2 --procs-per-node 1 --backend gloo --name magic-sm --target sagemaker "
        f"--instance-type ml.m5.xlarge --role {ROLE} --bucket {BUCKET} --spot --max-run 600\n")
    table = ip.run_cell("%sdp_jobs")
    assert table.error_in_exec is None
    from sdp_jupyter.launch import list_jobs

    listed = {j.name: j for j in list_jobs()}
    assert isinstance(listed["magic-sm"], SageMakerJob)

    def play_stop():  # SageMaker: Stopping, then Stopped
        wait_for(lambda: aws.status(job.training_job_name) == "Stopping", what="StopTrainingJob")
        aws.set_status(job.training_job_name, "Stopped")

    player = threading.Thread(target=play_stop)
    player.start()
    stopped = ip.run_cell("%sdp_stop magic-sm")
    player.join(30)
    assert stopped.error_in_exec is None
    assert job.state == "stopped"


def test_setup_widget_launches_the_same_choices_on_sagemaker(aws, tmp_path):
    """The job setup form with target sagemaker: its instance type, nodes, backend and scaled
    hyperparameters become the training job, and its live view is the SageMaker one."""
    from sdp_jupyter.ui.sagemaker_view import SageMakerJobView
    from sdp_jupyter.jobsetup import JobSetup

    form = JobSetup(code=CELL, name="widget-sm", jobs_dir=str(tmp_path / "jobs"), target="sagemaker",
                    instance_type="ml.p4de.24xlarge", nodes=2, backend="smddp",
                    sagemaker={"role": ROLE, "bucket": BUCKET, "poll_interval": 0.1})
    spec = form.spec
    job = form.launch()
    req = wire_request()
    assert isinstance(job, SageMakerJob) and req["TrainingJobName"] == job.training_job_name
    assert req["ResourceConfig"]["InstanceType"] == "ml.p4de.24xlarge" and req["ResourceConfig"]["InstanceCount"] == 2
    assert req["Environment"]["SDP_BACKEND"] == "smddp"
    assert req["HyperParameters"] == {k: v if isinstance(v, str) else json.dumps(v)
                                      for k, v in spec.hyperparameters.items()}
    drivers = f"s3://{BUCKET}/widget-sm/{req['TrainingJobName']}/input/sm_drivers"
    assert s3_json(aws, drivers, "distributed.json")["process_count_per_node"] == 8
    assert isinstance(form.view().w_job.children[0], SageMakerJobView)
    aws.set_status(job.training_job_name, "Completed")
    assert job.wait(20) == "succeeded"


def test_magic_wait_streams_host_one_and_raises_the_failure(aws, tmp_path, monkeypatch, capsys):
    """`%%sdp_train --target sagemaker --wait` in a terminal: host algo-1's stream is printed as it
    comes and a Failed job raises with its FailureReason."""
    import threading

    from IPython.testing.globalipapp import get_ipython

    monkeypatch.setenv("SDP_JOBS_DIR", str(tmp_path / "jobs"))
    monkeypatch.setenv("SDP_SAGEMAKER_POLL_INTERVAL", "0.1")
    ip = get_ipython()
    ip.run_line_magic("load_ext", "sdp_jupyter")
    before = len(MotoAWS.create_requests)

    def play():  # SageMaker: a job that prints on both hosts, then fails
        wait_for(lambda: len(MotoAWS.create_requests) > before, timeout=240, what="the job")
        name = MotoAWS.create_requests[-1]["TrainingJobName"]
        try:
            aws.set_status(name, "InProgress", "Training")
            aws.put_log_lines(name, 1, ["line from algo-1"])
            aws.put_log_lines(name, 2, ["line from algo-2"])
            time.sleep(1.0)
        finally:  # whatever happens, the cell must not wait forever
            aws.set_status(name, "Failed", failure_reason="AlgorithmError: rank 0 failed: ValueError: bad batch")

    player = threading.Thread(target=play)
    player.start()
    result = ip.run_cell(f"%%sdp_train --target sagemaker --name wait-sm --nodes 2 --backend gloo "
                         f"--instance-type ml.m5.xlarge "
                         f"--role {ROLE} --bucket {BUCKET} --wait\nprint('hi')\n")
    player.join(30)
    out = capsys.readouterr().out
    assert "line from algo-1" in out and "line from algo-2" not in out
    assert "[sagemaker] Training" in out
    err = result.error_in_exec
    assert err is not None and "ValueError: bad batch" in str(err)


def test_a_job_directory_written_before_the_module_moved_reopens_as_its_class():
    """status.json names the class that reopens a job (`job_class`); one written when SageMakerJob lived
    in launch/kernel/sagemaker/job.py (or targets/sagemaker/job.py) still finds it."""
    from sdp_jupyter.launch.kernel.job import Job

    for where in ("sdp_jupyter.launch.kernel.sagemaker.job:SageMakerJob",
                  "sdp_jupyter.launch.targets.sagemaker.job:SageMakerJob", SageMakerJob.class_record()):
        assert Job.recorded_class({"job_class": where}) is SageMakerJob, where
    assert Job.recorded_class({"job_class": "sdp_jupyter.launch.kernel.sagemaker.gone:SageMakerJob"}) is None
