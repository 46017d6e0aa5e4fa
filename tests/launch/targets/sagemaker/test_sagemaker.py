"""`--target sagemaker` against a local moto server (tests/helpers/moto.py), never AWS.

What is checked: the CreateTrainingJob request as it reached the server for an smddp, a spot and a
gloo job (plus the driver files the SDK uploads next to it); validation against botocore's service
model before anything is sent; a job driven through its states: test_sagemaker_job.py.
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
from sdp_jupyter.launch import SpecError, launch  # noqa: E402
from sdp_jupyter.launch.targets.sagemaker.options import DEFAULT_MAX_RUN, SageMakerRequestError, validate_request  # noqa: E402
from sdp_jupyter.launch.targets.sagemaker.plan import default_framework_version, make_plan  # noqa: E402
from sdp_jupyter.launch.targets.sagemaker.source import build_sdist  # noqa: E402
from sdp_jupyter.launch.targets.sagemaker.submit import RequestGate  # noqa: E402
from sdp_jupyter.monitor import cloudwatch  # noqa: E402
from helpers.sagemaker_jobs import (IMAGE_230_GPU, SDK_ARGS, SDK_ENTRY, channel, expected_environment, make_spec,  # noqa: E402
                                     s3_json, s3_keys, sdk_channels, wire_request)


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
        "StoppingCondition": {"MaxRuntimeInSeconds": DEFAULT_MAX_RUN},
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
    plan = make_plan(spec)
    assert plan.engine == "sdp" and plan.procs_per_node == 4
    assert any("does not run on this type" in w and "sdp_jupyter's engine" in w for w in plan.warnings)
    assert plan.environment["SDP_ENGINE"] == "sdp" and plan.environment["SDP_TP"] == "2"
    assert make_plan(spec.replace(sagemaker={**spec.sagemaker, "engine": "aws", "instance_type":
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
    again = build_sdist(tmp_path)
    assert again.read_bytes() == (job.dir / "sagemaker_source" / sdist).read_bytes()
    assert job.sagemaker["engine"] == "sdp" and "smddp engine: sdp_jupyter's engine (planned" in job.summary()
    job.stop(wait=False)
    aws.set_status(req["TrainingJobName"], "Stopped")
    assert job.wait(20) == "stopped"


def test_engine_sdp_without_the_sources_is_refused_before_any_aws_call(tmp_path, monkeypatch):
    """sdp_jupyter installed from a wheel has no native/ to ship: --engine sdp says so up front."""
    from sdp_jupyter.launch.targets.sagemaker import plan as plan_module

    monkeypatch.setattr(plan_module, "source_tree", lambda: None)
    spec = make_spec(tmp_path, "no-sources", backend="smddp", sagemaker={"instance_type": "ml.g5.12xlarge"})
    with pytest.raises(SpecError) as err:
        make_plan(spec)
    assert err.value.option == "--engine" and "installed without them" in str(err.value)
    assert "--engine aws on ml.p4d.24xlarge" in str(err.value)
    # AWS's library needs no sources
    assert make_plan(spec.replace(sagemaker={"instance_type": "ml.p4d.24xlarge"})).engine == "aws"


def test_entry_names_the_image_when_it_has_no_compiler(tmp_path, monkeypatch):
    from sdp_jupyter.launch.targets.sagemaker import entry

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
    newest = default_framework_version("nccl")  # the newest PyTorch training image the SDK knows
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
    with pytest.raises(SageMakerRequestError) as err:
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
        make_plan(make_spec(tmp_path, name, sagemaker=extra, **kw))
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
    gate = RequestGate(tmp_path / "request.json").install(boto)
    before = len(MotoAWS.create_requests)
    client = boto.client("sagemaker")
    with pytest.raises(SageMakerRequestError) as err:
        client.create_training_job(
            TrainingJobName="x" * 64, RoleArn=ROLE, OutputDataConfig={"S3OutputPath": f"s3://{BUCKET}/o"},
            AlgorithmSpecification={"TrainingInputMode": "File", "TrainingImage": IMAGE_230_GPU},
            ResourceConfig={"InstanceType": "ml.p4d.24xlarge", "InstanceCount": 1, "VolumeSizeInGB": 30},
            StoppingCondition={"MaxRuntimeInSeconds": 60})
    assert set(err.value.fields) == {"TrainingJobName"} and "at most 63 allowed" in str(err.value)
    assert len(MotoAWS.create_requests) == before and not (tmp_path / "request.json").exists()
    gate.remove(boto)
    with pytest.raises(SageMakerRequestError, match=r"RoleArn \(--role\): is required"):
        validate_request({"TrainingJobName": "ok", "OutputDataConfig": {"S3OutputPath": "s3://b/o"}})


ECHO_BESIDE_PRINTS = r'''
import json, os, sys, threading
from sdp_jupyter.launch.targets.sagemaker.entry import MetricsEcho
from sdp_jupyter import jobdir

sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
job = sys.argv[1]
path = jobdir.rank_metrics_path(job, 0)
path.parent.mkdir(parents=True)
echo = MetricsEcho(job, 0, interval=0.0005).start()
with open(path, "a") as f:
    for step in range(400):
        f.write(json.dumps({"kind": "step", "rank": 0, "step": step, "loss": 1.0, "t": 1.0 + step}) + "\n")
        f.flush()
        print("script line", step, "x" * 40)
echo.stop()
'''


@pytest.mark.parametrize("unbuffered", ["1", None], ids=["PYTHONUNBUFFERED", "buffered"])
def test_metrics_lines_stay_whole_beside_the_scripts_prints(tmp_path, unbuffered):
    """The echo thread's `[sdp-metrics]` lines share stdout with the script's prints; a line cut by a
    print would be lost to CloudWatch's parser (CI run 47 lost one)."""
    import subprocess
    import sys as _sys
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    p = subprocess.run([_sys.executable, "-c", ECHO_BESIDE_PRINTS, str(tmp_path / "job")], capture_output=True,
                       text=True, timeout=120, env=env)
    assert p.returncode == 0, p.stderr[-3000:]  # what failed (a fresh-clone run saw exit 1 without it)
    out = p.stdout
    lines = out.splitlines()
    events = [cloudwatch.parse_log_line(line) for line in lines if "[sdp-metrics]" in line]
    assert [e and e["step"] for e in events] == list(range(400))
    assert [line for line in lines if line.startswith("script line")] == \
        [f"script line {s} {'x' * 40}" for s in range(400)]
