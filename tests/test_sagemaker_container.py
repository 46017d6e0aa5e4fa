"""The source directory a SageMaker job uploads, run here the way the training container runs it.

A job is launched against moto (tests/moto_fixtures.py); the `code` and `sm_drivers` channels are
downloaded from moto's S3 exactly as uploaded, the container environment of every host is computed
by SageMaker's own `sm_drivers/scripts/environment.py` (`set_env`) from the job's resource config,
channels and hyperparameters, and SageMaker's own `sm_drivers/distributed_drivers/torchrun_driver.py`
is started once per host. The driver runs
`torchrun --nnodes=2 --nproc_per_node=1 --master_addr --master_port --node_rank sdp_entry.py --KEY VALUE`,
as in the container. What differs from a real container, and only that: /opt/ml/... is a folder
under the test's tmp dir, and algo-1 (SM_MASTER_ADDR) is 127.0.0.1 with a free port.
"""
from __future__ import annotations

import json
import os
import pickle
import shlex
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moto_fixtures import BUCKET, MotoAWS, ROLE, aws  # noqa: F401  (aws is a fixture)

pytest.importorskip("sagemaker.train")
pytest.importorskip("torch")

from sdp_jupyter.launch import JobSpec, launch  # noqa: E402
from sdp_jupyter.monitor.cloudwatch import parse_log_line  # noqa: E402

pytestmark = pytest.mark.slow

CELL = r'''
import argparse, json, os
import torch
import torch.distributed as dist
import sdp_jupyter

p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int)
p.add_argument("--lr", type=float)
p.add_argument("--tag")
a = p.parse_args()
dist.init_process_group(os.environ["SDP_BACKEND"])
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
data = open(os.path.join(os.environ["SM_CHANNEL_TRAIN"], "data.txt")).read().strip()
for step in range(3):
    sdp_jupyter.report(step=step, samples=8, loss=1.0 / (step + 1), step_time=0.25)
with open(os.path.join(os.environ["SDP_CHECKPOINT_DIR"], f"rank{rank}.json"), "w") as f:
    json.dump({"sum": t.item()}, f)
if a.tag == "boom" and rank == 1:
    raise ZeroDivisionError("division by zero in rank 1")
print(f"RESULT rank={rank} world={world} sum={t.item()} epochs={a.epochs} lr={a.lr} data={data} "
      f"host={os.environ['SM_CURRENT_HOST']} nodes={os.environ['SDP_NUM_NODES']} "
      f"pkg={sdp_jupyter.__file__}", flush=True)
{"sum": t.item(), "world": world}
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def download(aws, uri: str, dest: Path) -> None:
    bucket, _, prefix = uri[len("s3://"):].partition("/")
    s3 = aws.client("s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            target = dest / obj["Key"][len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(target))


SET_ENV = r'''
import json, os, sys
drivers, out, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, os.path.join(drivers, "scripts"))
import environment  # SageMaker's own: sm_drivers/scripts/environment.py
# it reads these two from /opt/ml/input/data/sm_drivers; ours are under the test's tmp dir
environment.read_source_code_json = lambda: json.load(open(os.path.join(drivers, "sourcecode.json")))
environment.read_distributed_json = lambda: json.load(open(os.path.join(drivers, "distributed.json")))
environment.set_env(config["resource"], config["channels"], config["hyperparameters"], output_file=out)
'''


def container_env(drivers: Path, host: int, hosts: int, request: dict, root: Path, port: int) -> dict:
    """The environment of host `host` (1-based), as SageMaker's environment.py computes it."""
    resource = {"current_host": f"algo-{host}", "current_instance_type": request["ResourceConfig"]["InstanceType"],
                "hosts": [f"algo-{h}" for h in range(1, hosts + 1)], "network_interface_name": "lo"}
    channels = {c["ChannelName"]: {"TrainingInputMode": "File"} for c in request["InputDataConfig"]}
    root.mkdir(parents=True, exist_ok=True)
    out = root / "sm_training.env"
    config = {"resource": resource, "channels": channels, "hyperparameters": request["HyperParameters"]}
    done = subprocess.run([sys.executable, "-c", SET_ENV, str(drivers), str(out), json.dumps(config)],
                          env={**os.environ, "TRAINING_JOB_NAME": request["TrainingJobName"]},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "SDP_", "SM_"))}
    env.pop("PYTHONPATH", None)  # the job must find sdp_jupyter in its own source directory
    env.update(request["Environment"])
    for line in out.read_text().splitlines():
        key, _, value = line[len("export "):].partition("=")
        env[key] = shlex.split(value)[0] if value else ""
    opt_ml = root / "opt" / "ml"
    for key, value in list(env.items()):
        if value.startswith("/opt/ml"):
            env[key] = str(opt_ml) + value[len("/opt/ml"):]
    env.update({
        "TRAINING_JOB_NAME": request["TrainingJobName"],
        "SM_MASTER_ADDR": "127.0.0.1", "SM_MASTER_PORT": str(port),  # algo-1 does not resolve here
        "GLOO_SOCKET_IFNAME": "lo",
        "PATH": f"{Path(sys.executable).parent}:{env.get('PATH', '')}",  # torchrun of this venv
    })
    for sub in ("model", "output/data", "checkpoints", "input/data/train"):
        (opt_ml / sub).mkdir(parents=True, exist_ok=True)
    (opt_ml / "input" / "data" / "train" / "data.txt").write_text("hello\n")
    return env


def run_job_like_sagemaker(aws, tmp_path, name: str, tag: str, first_done=(1, 2)):
    spec = JobSpec(code=CELL, name=name, target="sagemaker", nodes=2, procs_per_node=1, backend="gloo",
                   hyperparameters={"epochs": 2, "lr": 0.1, "tag": tag}, jobs_dir=str(tmp_path / "jobs"),
                   sagemaker={"role": ROLE, "bucket": BUCKET, "instance_type": "ml.m5.xlarge", "poll_interval": 0.2,
                              "inputs": [f"train=s3://{BUCKET}/data/train"]})
    job = launch(spec)
    request = MotoAWS.create_requests[-1]
    assert request["TrainingJobName"] == job.training_job_name
    uris = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in request["InputDataConfig"]}
    image = tmp_path / "image"
    code, drivers = image / "code", image / "sm_drivers"
    download(aws, uris["code"], code)
    download(aws, uris["sm_drivers"], drivers)
    port = free_port()
    hosts = []
    for host in (1, 2):
        root = tmp_path / f"algo-{host}"
        env = container_env(drivers, host, 2, request, root, port)
        # sm_train.sh: cd /opt/ml/input/data/code; $SM_PYTHON_CMD .../torchrun_driver.py
        proc = subprocess.Popen([sys.executable, str(drivers / "distributed_drivers" / "torchrun_driver.py")],
                                cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        hosts.append((proc, root, env))
    outputs = {}
    try:
        for host in first_done:
            proc, root, env = hosts[host - 1]
            out, _ = proc.communicate(timeout=240)
            outputs[host] = (proc.returncode, out, root, env)
    finally:
        # SageMaker ends the whole job when one host's algorithm fails; the other host's torchrun
        # would otherwise wait in its exit barrier for the failed one
        for proc, _, _ in hosts:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    job.stop(wait=False)
    aws.set_status(job.training_job_name, "Stopped")
    job.wait(20)
    return code, outputs


def test_uploaded_source_runs_under_sagemakers_torchrun_driver(aws, tmp_path):
    code, outputs = run_job_like_sagemaker(aws, tmp_path, "in-container", "ok")
    for host, (rc, out, root, env) in sorted(outputs.items()):
        assert rc == 0, out
        assert env["SM_HOSTS"] == '["algo-1", "algo-2"]' and env["SM_CURRENT_HOST"] == f"algo-{host}"
        rank = host - 1
        assert "torchrun --nnodes=2 --nproc_per_node=1 --master_addr=127.0.0.1" in out
        assert f"--node_rank={rank} sdp_entry.py --epochs 2 --lr 0.1 --tag ok" in out
        # the same script, unchanged: hyperparameters as argv, channel, checkpoint dir, our package copy
        assert (f"RESULT rank={rank} world=2 sum=3.0 epochs=2 lr=0.1 data=hello host=algo-{host} nodes=2 "
                f"pkg={code}/sdp_jupyter/__init__.py") in out
        ckpt = root / "opt" / "ml" / "checkpoints" / f"rank{rank}.json"
        assert json.loads(ckpt.read_text()) == {"sum": 3.0}
        # report() lines reach stdout (so CloudWatch) in the documented format
        events = [parse_log_line(line) for line in out.splitlines() if "[sdp-metrics]" in line]
        assert [(e["rank"], e["step"], e["loss"]) for e in events] == [(rank, s, 1.0 / (s + 1)) for s in range(3)]
        assert all(e["throughput"] == 32.0 for e in events)
        metrics = root / "opt" / "ml" / "output" / "data" / "sdp_job" / "metrics" / f"rank-{rank}.jsonl"
        assert len(metrics.read_text().splitlines()) == 3
    result = outputs[1][2] / "opt" / "ml" / "output" / "data" / "sdp_job" / "result.pkl"
    assert pickle.loads(result.read_bytes()) == {"sum": 3.0, "world": 2}
    assert not (outputs[2][2] / "opt" / "ml" / "output" / "data" / "sdp_job" / "result.pkl").exists()


def test_a_failing_rank_becomes_the_failure_reason(aws, tmp_path):
    _, outputs = run_job_like_sagemaker(aws, tmp_path, "in-container-fail", "boom", first_done=(2,))
    rc, out, root, env = outputs[2]
    assert rc != 0
    assert "ZeroDivisionError: division by zero in rank 1" in out
    failure = Path(env["SM_OUTPUT_FAILURE"])
    assert failure.read_text() == ("rank 1 of job in-container-fail failed: "
                                   "ZeroDivisionError: division by zero in rank 1")
