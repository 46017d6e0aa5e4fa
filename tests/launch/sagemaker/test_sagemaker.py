"""`--target sagemaker` against a local moto server (tests/helpers/moto.py), never AWS.

What is checked: the CreateTrainingJob request as it reached the server for an smddp, a spot and a
gloo job (plus the driver files the SDK uploads next to it); validation against botocore's service
model before anything is sent; a job driven through InProgress -> Training -> Completed / Failed by
the test with log events and instance metrics written into moto's CloudWatch, and what the job
handle, its directory, the reader, the job view and the dashboard make of them; stop.
"""
from __future__ import annotations

import json
import os
import tarfile
import re
import time

import pytest

from helpers.moto import BUCKET, REGION, ROLE, MotoAWS

pytest.importorskip("sagemaker.train")
pytest.importorskip("moto.server")

import sdp_jupyter  # noqa: E402
from sdp_jupyter.launch import JobSpec, SpecError, launch  # noqa: E402
from sdp_jupyter.launch.kernel import sagemaker as sm# noqa: E402
from sdp_jupyter.monitor import cloudwatch  # noqa: E402

IMAGE_230_GPU = "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.3.0-gpu-py311"
SDK_ENTRY = ["/bin/bash"]
SDK_ARGS = ["-c", "chmod +x /opt/ml/input/data/sm_drivers/sm_train.sh && /opt/ml/input/data/sm_drivers/sm_train.sh"]
CELL = "import os\nprint('rank', os.environ.get('RANK'))\n"


def make_spec(tmp_path, name, **kw) -> JobSpec:
    options = {"role": ROLE, "bucket": BUCKET, "poll_interval": 0.1}
    options.update(kw.pop("sagemaker", {}))
    return JobSpec(code=kw.pop("code", CELL), name=name, target="sagemaker", jobs_dir=str(tmp_path / "jobs"),
                   sagemaker=options, **kw)


def wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wire_request() -> dict:
    """The newest CreateTrainingJob body that reached the server."""
    assert MotoAWS.create_requests, "no CreateTrainingJob reached the server"
    return MotoAWS.create_requests[-1]


def s3_json(aws, uri_prefix: str, name: str) -> dict:
    bucket, _, key = uri_prefix[len("s3://"):].partition("/")
    body = aws.client("s3").get_object(Bucket=bucket, Key=f"{key}/{name}")["Body"].read()
    return json.loads(body)


def s3_keys(aws, uri_prefix: str) -> set:
    bucket, _, key = uri_prefix[len("s3://"):].partition("/")
    pages = aws.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/")
    return {o["Key"][len(key) + 1:] for p in pages for o in p.get("Contents", [])}


def sdk_channels(base: str, job_name: str) -> list:
    prefix = f"s3://{BUCKET}/{base}/{job_name}/input"
    return [{"ChannelName": ch, "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": f"{prefix}/{ch}", "S3DataDistributionType": "FullyReplicated"}},
        "InputMode": "File"} for ch in ("code", "sm_drivers")]


def channel(name: str, uri: str) -> dict:
    return {"ChannelName": name, "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}}, "InputMode": "File"}


def expected_environment(backend: str, base: str, nodes: int, **extra) -> dict:
    return {**extra, "SDP_BACKEND": backend, "SDP_JOB_NAME": base, "SDP_NUM_NODES": str(nodes),
            "SDP_CHECKPOINT_DIR": "/opt/ml/checkpoints", "PYTHONUNBUFFERED": "1"}


# ------------------------------------------------------------------------------------------------
# The exact requests
# ------------------------------------------------------------------------------------------------
def test_smddp_job_request(aws, tmp_path):
    spec = make_spec(tmp_path, "mnist_smddp", nodes=2, backend="smddp", hyperparameters={"lr": 0.1, "epochs": 3},
                     env={"MY_FLAG": "1"}, sagemaker={"instance_type": "ml.p4d.24xlarge",
                                                     "inputs": [f"train=s3://{BUCKET}/data/train"]})
    job = launch(spec)
    req = wire_request()
    name = req["TrainingJobName"]
    assert re.fullmatch(r"mnist-smddp-\d{14}", name)
    assert job.training_job_name == name
    assert req == {
        "TrainingJobName": name,
        "HyperParameters": {"lr": "0.1", "epochs": "3"},
        "AlgorithmSpecification": {"TrainingInputMode": "File", "TrainingImage": IMAGE_230_GPU,
                                   "MetricDefinitions": [dict(m) for m in cloudwatch.METRIC_DEFINITIONS],
                                   "ContainerEntrypoint": SDK_ENTRY, "ContainerArguments": SDK_ARGS},
        "RoleArn": ROLE,
        "InputDataConfig": [channel("train", f"s3://{BUCKET}/data/train")] + sdk_channels("mnist-smddp", name),
        "OutputDataConfig": {"S3OutputPath": f"s3://{BUCKET}/mnist-smddp", "CompressionType": "GZIP"},
        "ResourceConfig": {"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 2, "VolumeSizeInGB": 30},
        "StoppingCondition": {"MaxRuntimeInSeconds": sm.DEFAULT_MAX_RUN},
        "CheckpointConfig": {"S3Uri": f"s3://{BUCKET}/mnist-smddp/checkpoints", "LocalPath": "/opt/ml/checkpoints"},
        "Environment": expected_environment("smddp", "mnist-smddp", 2, MY_FLAG="1", SDP_ENGINE="aws"),
    }
    # torchrun's processes per node and the entry script travel in the SDK's driver files
    drivers = f"s3://{BUCKET}/mnist-smddp/{name}/input/sm_drivers"
    assert s3_json(aws, drivers, "distributed.json") == {"process_count_per_node": 8, "smp": None}
    source = s3_json(aws, drivers, "sourcecode.json")
    assert (source["entry_script"], source["requirements"]) == ("sdp_entry.py", "requirements.txt")
    code = s3_keys(aws, f"s3://{BUCKET}/mnist-smddp/{name}/input/code")
    assert {"script.py", "sdp_entry.py", "spec.json", "requirements.txt", "sdp_jupyter/__init__.py",
            "sdp_jupyter/launch/rank/worker.py", "sdp_jupyter/monitor/reporter.py",
            "sdp_jupyter/monitor/cloudwatch.py"} <= code
    assert not any(k.endswith(".so") or "__pycache__" in k for k in code)
    # what was sent is kept in the job directory, and the spec there is the resolved one
    assert job.request["Environment"] == req["Environment"]
    assert json.loads((job.dir / "spec.json").read_text())["procs_per_node"] == 8
    assert job.world_size == 16
    job.stop(wait=False)
    aws.set_status(name, "Stopped")
    assert job.wait(20) == "stopped"


def test_engine_auto_is_ours_where_aws_refuses_and_ships_the_sources(aws, tmp_path):
    """--engine auto on ml.g5.12xlarge (SageMaker's smddp does not run there): our engine, shipped as
    a source package with native/; hybrid options reach the job's Environment as locally."""
    from sdp_jupyter import instances

    assert instances.get("ml.g5.12xlarge").smddp_engine == "sdp"
    assert instances.get("ml.p4d.24xlarge").smddp_engine == "aws"
    spec = make_spec(tmp_path, "g5-ours", nodes=2, backend="smddp", parallel={"tp": 2},
                     sagemaker={"instance_type": "ml.g5.12xlarge"})
    plan = sm.make_plan(spec)
    assert plan.engine == "sdp" and plan.procs_per_node == 4
    assert any("does not run on this type" in w and "sdp_jupyter's engine" in w for w in plan.warnings)
    assert plan.environment["SDP_ENGINE"] == "sdp" and plan.environment["SDP_TP"] == "2"
    assert sm.make_plan(spec.replace(sagemaker={**spec.sagemaker, "engine": "aws", "instance_type":
                                                "ml.p4d.24xlarge"})).engine == "aws"
    job = launch(spec)
    req = wire_request()
    env = req["Environment"]
    assert (env["SDP_ENGINE"], env["SDP_TP"], env["SDP_BACKEND"]) == ("sdp", "2", "smddp")
    assert env["SDP_IMAGE_URI"] == req["AlgorithmSpecification"]["TrainingImage"]
    assert req["ResourceConfig"]["InstanceType"] == "ml.g5.12xlarge"
    code = s3_keys(aws, f"s3://{BUCKET}/g5-ours/{req['TrainingJobName']}/input/code")
    sdist = f"sdp_jupyter-{sdp_jupyter.__version__}.tar.gz"
    assert sdist in code and not any(k.startswith("sdp_jupyter/") for k in code)
    with tarfile.open(job.dir / "sagemaker_source" / sdist) as tar:
        names = set(tar.getnames())
    base = f"sdp_jupyter-{sdp_jupyter.__version__}"
    assert {f"{base}/{n}" for n in ("PKG-INFO", "pyproject.toml", "setup.py", "README.md",
                                     "native/src/engine.cpp", "native/include/sdp/engine.h",
                                     "native/python/module.cpp", "sdp_jupyter/torch/__init__.py")} <= names
    assert not any(n.endswith(".so") or "__pycache__" in n for n in names)
    # the same sources give the same bytes: a host that built this package knows it by its digest
    again = sm.build_sdist(tmp_path)
    assert again.read_bytes() == (job.dir / "sagemaker_source" / sdist).read_bytes()
    assert job.sagemaker["engine"] == "sdp" and "smddp engine: sdp_jupyter's engine (planned" in job.summary()
    job.stop(wait=False)
    aws.set_status(req["TrainingJobName"], "Stopped")
    assert job.wait(20) == "stopped"


def test_engine_sdp_without_the_sources_is_refused_before_any_aws_call(tmp_path, monkeypatch):
    """sdp_jupyter installed from a wheel has no native/ to ship: --engine sdp says so up front."""
    from sdp_jupyter.launch.kernel.sagemaker import plan as plan_module

    monkeypatch.setattr(plan_module, "source_tree", lambda: None)
    spec = make_spec(tmp_path, "no-sources", backend="smddp", sagemaker={"instance_type": "ml.g5.12xlarge"})
    with pytest.raises(SpecError) as err:
        sm.make_plan(spec)
    assert err.value.option == "--engine" and "installed without them" in str(err.value)
    assert "--engine aws on ml.p4d.24xlarge" in str(err.value)
    # AWS's library needs no sources
    assert sm.make_plan(spec.replace(sagemaker={"instance_type": "ml.p4d.24xlarge"})).engine == "aws"


def test_entry_names_the_image_when_it_has_no_compiler(tmp_path, monkeypatch):
    from sdp_jupyter.launch.rank import sagemaker_entry as entry

    (tmp_path / "sdp_jupyter-0.1.0.tar.gz").write_bytes(b"not built")
    monkeypatch.setattr(entry.shutil, "which", lambda name: None)
    env = {"SDP_BACKEND": "smddp", "SDP_ENGINE": "sdp", "SDP_IMAGE_URI": "my.registry/slim:1",
           "TRAINING_JOB_NAME": f"no-cxx-{os.getpid()}"}
    monkeypatch.setattr(entry.sys, "prefix", str(tmp_path))
    for _ in range(2):  # the host's second rank gets the same error without trying again
        with pytest.raises(entry.EngineInstallError) as err:
            entry.install_engine(str(tmp_path), env)
        assert "the training image my.registry/slim:1 has no C++ compiler" in str(err.value)
        assert "Fix: --image-uri an image with g++" in str(err.value) and "--engine aws" in str(err.value)
    assert entry.install_engine(str(tmp_path), {**env, "SDP_ENGINE": "aws"}) is None


def test_spot_job_request_and_stable_checkpoint_uri(aws, tmp_path):
    spec = make_spec(tmp_path, "spot-run", nodes=1, backend="nccl", procs_per_node=4,
                     sagemaker={"instance_type": "ml.g5.12xlarge", "spot": True, "max_run": 3600,
                                "volume_size": 100})
    first = launch(spec)
    req = wire_request()
    assert req["ResourceConfig"] == {"InstanceType": "ml.g5.12xlarge", "InstanceCount": 1, "VolumeSizeInGB": 100}
    assert req["EnableManagedSpotTraining"] is True
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 3600, "MaxWaitTimeInSeconds": 7200}
    assert req["CheckpointConfig"] == {"S3Uri": f"s3://{BUCKET}/spot-run/checkpoints",
                                       "LocalPath": "/opt/ml/checkpoints"}
    assert req["Environment"]["SDP_CHECKPOINT_DIR"] == "/opt/ml/checkpoints"
    newest = sm.default_framework_version("nccl")  # the newest PyTorch training image the SDK knows
    assert re.fullmatch(rf"763104351884\.dkr\.ecr\.us-west-2\.amazonaws\.com/pytorch-training:{newest}-gpu-py3\d+",
                        req["AlgorithmSpecification"]["TrainingImage"])
    drivers = f"s3://{BUCKET}/spot-run/{req['TrainingJobName']}/input/sm_drivers"
    assert s3_json(aws, drivers, "distributed.json")["process_count_per_node"] == 4
    aws.set_status(first.training_job_name, "Completed")
    assert first.wait(20) == "succeeded"
    # a second job of the same name resumes from the same checkpoint URI
    time.sleep(1.1)  # the SDK's job-name suffix has one-second resolution
    second = launch(spec)
    again = wire_request()
    assert again["TrainingJobName"] != req["TrainingJobName"]
    assert again["CheckpointConfig"] == req["CheckpointConfig"]
    aws.set_status(second.training_job_name, "Completed")
    assert second.wait(20) == "succeeded"


def test_gloo_job_request(aws, tmp_path):
    spec = make_spec(tmp_path, "cpu-gloo", nodes=3, backend="gloo", procs_per_node=2, args="--epochs 2",
                     hyperparameters={"batch_size": 64, "optimizer": "sgd"}, timeout=1800,
                     sagemaker={"instance_type": "ml.m5.xlarge", "framework_version": "2.8.0", "keep_alive": 600,
                                "output_path": f"s3://{BUCKET}/teams/a/"})
    job = launch(spec)
    req = wire_request()
    name = req["TrainingJobName"]
    assert req["AlgorithmSpecification"]["TrainingImage"] == \
        "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.8.0-cpu-py312"
    assert req["ResourceConfig"] == {"InstanceType": "ml.m5.xlarge", "InstanceCount": 3, "VolumeSizeInGB": 30,
                                     "KeepAlivePeriodInSeconds": 600}
    assert req["StoppingCondition"] == {"MaxRuntimeInSeconds": 1800}  # from --timeout
    assert "EnableManagedSpotTraining" not in req
    assert req["HyperParameters"] == {"batch_size": "64", "optimizer": "sgd"}
    assert req["Environment"] == expected_environment("gloo", "cpu-gloo", 3)
    assert req["OutputDataConfig"]["S3OutputPath"] == f"s3://{BUCKET}/teams/a/cpu-gloo"
    assert req["CheckpointConfig"]["S3Uri"] == f"s3://{BUCKET}/teams/a/cpu-gloo/checkpoints"
    drivers = f"s3://{BUCKET}/cpu-gloo/{name}/input/sm_drivers"
    assert s3_json(aws, drivers, "distributed.json")["process_count_per_node"] == 2
    # --args reach the script through spec.json (the entry puts them before the hyperparameters)
    assert json.loads((job.dir / "sagemaker_source" / "spec.json").read_text())["args"] == ["--epochs", "2"]
    aws.set_status(name, "Completed")
    assert job.wait(20) == "succeeded"


# ------------------------------------------------------------------------------------------------
# Validation: nothing is sent
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("changes, option, field, words", [
    ({"sagemaker": {"instance_type": "ml.p4d.48xlarge"}, "backend": "gloo"}, "--instance-type",
     "ResourceConfig.InstanceType", "ml.p4d.24xlarge"),
    ({"sagemaker": {"role": "my-role"}}, "--role", "RoleArn", "pattern"),
    ({"sagemaker": {"keep_alive": 30000}}, "--keep-alive", "ResourceConfig.KeepAlivePeriodInSeconds", "21600"),
    ({"env": {"BIG": "x" * 600}}, "--env", "Environment['BIG']", "512"),
    ({"hyperparameters": {"notes": "y" * 2600}}, "--hp", "HyperParameters['notes']", "2500"),
    ({"sagemaker": {"inputs": {"bad name": "s3://b/x"}}}, "--input", "InputDataConfig[0].ChannelName", "pattern"),
])
def test_service_model_rejects_before_sending(aws, tmp_path, changes, option, field, words):
    kw = {"backend": "gloo"} | changes
    extra = kw.pop("sagemaker", {})
    before = len(MotoAWS.create_requests)
    with pytest.raises(sm.SageMakerRequestError) as err:
        launch(make_spec(tmp_path, "bad-job", sagemaker=extra, **kw))
    assert err.value.option == option
    assert field in err.value.fields
    assert option in str(err.value) and words in str(err.value)
    assert len(MotoAWS.create_requests) == before


@pytest.mark.parametrize("changes, option, words", [
    ({"name": "a" * 49}, "--name", "at most 48"),
    ({"backend": "smddp", "sagemaker": {"instance_type": "ml.g5.48xlarge", "engine": "aws"}}, "--instance-type",
     "ml.p4d.24xlarge, ml.p4de.24xlarge"),
    ({"backend": "smddp", "sagemaker": {"instance_type": "ml.p5.48xlarge", "engine": "aws"}}, "--instance-type",
     "Fix: --instance-type ml.p4d.24xlarge, or --engine sdp"),
    ({"backend": "smddp", "sagemaker": {"engine": "nccl"}}, "--engine", "one of auto, sdp, aws"),
    ({"sagemaker": {"engine": "sdp"}}, "--engine", "this job uses --backend gloo"),
    ({"parallel": {"tp": 3}, "procs_per_node": 3}, "--tp", "power of two"),
    ({"sagemaker": {"max_wait": 100}}, "--max-wait", "--spot"),
    ({"sagemaker": {"spot": True, "max_run": 600, "max_wait": 300}}, "--max-wait", "at least --max-run"),
    ({"sagemaker": {"spot": True, "keep_alive": 60}}, "--keep-alive", "warm pools"),
    ({"sagemaker": {"inputs": ["code=s3://b/x"]}}, "--input", "used by the SageMaker SDK"),
    ({"sagemaker": {"inputs": ["train"]}}, "--input", "NAME=s3://"),
    ({"sagemaker": {"volume_size": 0}}, "--volume-size", "1 or more"),
    ({"sagemaker": {"output_path": "/tmp/out"}}, "--output-path", "S3 URI"),
    ({"sagemaker": {"bucket": "s3://x"}}, "--bucket", "bucket name only"),
    ({"sagemaker": {"instance_typ": "ml.p4d.24xlarge"}}, "sagemaker", "instance_type"),
    ({"backend": "nccl", "sagemaker": {"instance_type": "ml.g5.12xlarge"}, "procs_per_node": 8},
     "--procs-per-node", "4 GPU"),
])
def test_option_errors_name_the_option(tmp_path, changes, option, words):
    kw = {"backend": "gloo"} | changes
    extra = kw.pop("sagemaker", {})
    name = kw.pop("name", "opt-job")
    with pytest.raises(SpecError) as err:
        sm.make_plan(make_spec(tmp_path, name, sagemaker=extra, **kw))
    assert err.value.option == option, str(err.value)
    assert words in str(err.value)


def test_missing_role_is_named(aws, tmp_path):
    spec = make_spec(tmp_path, "no-role", backend="gloo")
    spec.sagemaker.pop("role")
    with pytest.raises(SpecError) as err:
        launch(spec)
    assert err.value.option == "--role" and "arn:aws:iam::" in str(err.value)


def test_final_request_gate_blocks_a_bad_request(aws, tmp_path):
    """The hook on CreateTrainingJob checks the SDK's final request too (required fields included)."""
    import boto3

    boto = boto3.Session(region_name=REGION)
    gate = sm.RequestGate(tmp_path / "request.json").install(boto)
    before = len(MotoAWS.create_requests)
    client = boto.client("sagemaker")
    with pytest.raises(sm.SageMakerRequestError) as err:
        client.create_training_job(
            TrainingJobName="x" * 64, RoleArn=ROLE, OutputDataConfig={"S3OutputPath": f"s3://{BUCKET}/o"},
            AlgorithmSpecification={"TrainingInputMode": "File", "TrainingImage": IMAGE_230_GPU},
            ResourceConfig={"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 1, "VolumeSizeInGB": 30},
            StoppingCondition={"MaxRuntimeInSeconds": 60})
    assert set(err.value.fields) == {"TrainingJobName"} and "at most 63 allowed" in str(err.value)
    assert len(MotoAWS.create_requests) == before and not (tmp_path / "request.json").exists()
    gate.remove(boto)
    with pytest.raises(sm.SageMakerRequestError, match=r"RoleArn \(--role\): is required"):
        sm.validate_request({"TrainingJobName": "ok", "OutputDataConfig": {"S3OutputPath": "s3://b/o"}})


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
    assert isinstance(again, sm.SageMakerJob)
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
    launcher = sm.SageMakerLauncher(session=Session(boto_session=boto, default_bucket=BUCKET))
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
    assert isinstance(job, sm.SageMakerJob) and job.spec.sagemaker["spot"] is True
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
    assert isinstance(listed["magic-sm"], sm.SageMakerJob)

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
    assert isinstance(job, sm.SageMakerJob) and req["TrainingJobName"] == job.training_job_name
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
