"""The source directory a SageMaker job uploads, run here the way the training container runs it.

A job is launched against moto (tests/helpers/moto.py); the `code` and `sm_drivers` channels are
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
import signal
import sys
from pathlib import Path

import pytest

from helpers.moto import BUCKET, ROLE, LocalContainers, MotoAWS

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
      f"backend={dist.get_backend()} provider={os.environ.get('SDP_SMDDP_PROVIDER')} "
      f"pkg={sdp_jupyter.__file__}", flush=True)
{"sum": t.item(), "world": world}
'''


# SageMaker's smdistributed exists only in AWS's images. This stand-in has its import path and, like
# the real one, registers the "smddp" torch.distributed backend when torch_smddp is imported (here
# backed by gloo); the test checks that the entry point imports it and the script's
# init_process_group("smddp") then runs on it.
STAND_IN_SMDDP = """
import torch.distributed as dist

def _create(store, rank, size, timeout):
    return dist.ProcessGroupGloo(store, rank, size, timeout)

dist.Backend.register_backend("smddp", _create, devices=["cpu"])
print("smdistributed stand-in: smddp registered", flush=True)
"""


def stand_in_smdistributed(root: Path) -> Path:
    pkg = root / "smdistributed" / "dataparallel" / "torch"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "torch_smddp.py").write_text(STAND_IN_SMDDP)
    return root


def run_job_like_sagemaker(aws, tmp_path, name: str, tag: str, first_done=(1, 2), backend="gloo",
                           instance_type="ml.m5.xlarge", pythonpath=None):
    spec = JobSpec(code=CELL, name=name, target="sagemaker", nodes=2, procs_per_node=1, backend=backend,
                   hyperparameters={"epochs": 2, "lr": 0.1, "tag": tag}, jobs_dir=str(tmp_path / "jobs"),
                   sagemaker={"role": ROLE, "bucket": BUCKET, "instance_type": instance_type, "poll_interval": 0.2,
                              "inputs": [f"train=s3://{BUCKET}/data/train"]})
    job = launch(spec)
    request = MotoAWS.create_requests[-1]
    assert request["TrainingJobName"] == job.training_job_name
    aws.client("s3").put_object(Bucket=BUCKET, Key="data/train/data.txt", Body=b"hello\n")
    containers = LocalContainers(aws, request, tmp_path)
    containers.prepare()
    if pythonpath:
        for env in containers.envs:
            env["PYTHONPATH"] = str(pythonpath)
    containers.start()
    hosts = [(proc, containers.workdir / f"algo-{h + 1}", env)
             for h, (proc, env) in enumerate(zip(containers.procs, containers.envs))]
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
    return containers.code, outputs


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
                f"backend=gloo provider=None pkg={code}/sdp_jupyter/__init__.py") in out
        ckpt = root / "opt" / "ml" / "checkpoints" / f"rank{rank}.json"
        assert json.loads(ckpt.read_text()) == {"sum": 3.0}
        # report() lines reach stdout (so CloudWatch) in the documented format
        events = [parse_log_line(line) for line in out.splitlines() if "[sdp-metrics]" in line]
        assert [(e["rank"], e["step"], e["loss"]) for e in events] == [(rank, s, 1.0 / (s + 1)) for s in range(3)]
        assert all(e["throughput"] == 32.0 for e in events)
        metrics = root / "opt" / "ml" / "output" / "data" / "sdp_job" / "metrics" / f"rank-{rank}.jsonl"
        records = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [r["step"] for r in records if r["kind"] == "step"] == [0, 1, 2]
        # the hosts say which backend their group ran on (the job view's "backend" truth)
        assert [(r["backend"], r["collectives"] > 0) for r in records if r["kind"] == "backend"] == [("gloo", True)]
    result = outputs[1][2] / "opt" / "ml" / "output" / "data" / "sdp_job" / "result.pkl"
    assert pickle.loads(result.read_bytes()) == {"sum": 3.0, "world": 2}
    assert not (outputs[2][2] / "opt" / "ml" / "output" / "data" / "sdp_job" / "result.pkl").exists()


def test_a_failing_rank_becomes_the_failure_reason(aws, tmp_path):
    _, outputs = run_job_like_sagemaker(aws, tmp_path, "in-container-fail", "boom", first_done=(2,))
    rc, out, root, env = outputs[2]
    assert rc != 0
    assert "ZeroDivisionError: division by zero in rank 1" in out
    failure = Path(env["SM_OUTPUT_FAILURE"])
    assert failure.read_text() == ("rank 1 (algo-2) of job in-container-fail failed: "
                                   "ZeroDivisionError: division by zero in rank 1")


def test_smddp_job_uses_sagemakers_smdistributed(aws, tmp_path):
    path = stand_in_smdistributed(tmp_path / "image-site-packages")
    _, outputs = run_job_like_sagemaker(aws, tmp_path, "in-container-smddp", "ok", backend="smddp",
                                        instance_type="ml.p4d.24xlarge", pythonpath=path)
    for host, (rc, out, _, env) in sorted(outputs.items()):
        assert rc == 0, out
        assert env["SDP_BACKEND"] == "smddp"
        assert "smdistributed stand-in: smddp registered" in out
        assert f"RESULT rank={host - 1} world=2 sum=3.0" in out
        assert "backend=smddp provider=smdistributed" in out


def test_smddp_without_smdistributed_says_which_image(monkeypatch, capsys):
    from sdp_jupyter.launch.targets.sagemaker import entry as sagemaker_entry

    monkeypatch.setitem(sys.modules, "smdistributed", None)  # not in this image
    env = {"SDP_BACKEND": "smddp"}
    assert sagemaker_entry.load_smddp(env) is None
    err = capsys.readouterr().err
    assert "no SageMaker smdistributed.dataparallel" in err and "2.3.0" in err and "--backend nccl" in err
    assert "SDP_SMDDP_PROVIDER" not in env
    assert sagemaker_entry.load_smddp({"SDP_BACKEND": "gloo"}) is None


RESUME_CELL = r'''
import argparse, os
import torch
import torch.distributed as dist
import sdp_jupyter.checkpoint as ckpt

p = argparse.ArgumentParser()
p.add_argument("--interrupt_at", type=int)
a = p.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
state = ckpt.load() or {"step": 0, "total": 0.0}
start = state["step"]
print(f"START rank={rank} step={start} dir={os.environ['SDP_CHECKPOINT_DIR']}", flush=True)
for step in range(start, 6):
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    state["total"] += t.item()
    state["step"] = step + 1
    ckpt.save(state)
    dist.barrier()
    if start == 0 and state["step"] == a.interrupt_at:
        print(f"INTERRUPTED rank={rank} after step {state['step']}", flush=True)
        os._exit(137)  # the spot instance goes away
print(f"DONE rank={rank} total={state['total']}", flush=True)
'''


def test_spot_restart_resumes_from_the_checkpoint_uri(aws, tmp_path):
    """A spot interruption: the hosts die after step 3; SageMaker has synced /opt/ml/checkpoints to
    the job's checkpoint URI and restores it on the new hosts, where the same script resumes."""
    spec = JobSpec(code=RESUME_CELL, name="spot-resume", target="sagemaker", nodes=2, procs_per_node=1,
                   backend="gloo", hyperparameters={"interrupt_at": 3}, jobs_dir=str(tmp_path / "jobs"),
                   sagemaker={"role": ROLE, "bucket": BUCKET, "instance_type": "ml.m5.xlarge", "spot": True,
                              "poll_interval": 0.2})
    job = launch(spec)
    request = MotoAWS.create_requests[-1]
    assert request["CheckpointConfig"]["S3Uri"] == f"s3://{BUCKET}/spot-resume/checkpoints"
    outs = []
    for attempt in ("first", "restart"):
        containers = LocalContainers(aws, request, tmp_path / attempt)
        containers.prepare()
        containers.start()
        try:
            outs.append([p.communicate(timeout=240)[0] for p in containers.procs])
        finally:
            containers.kill()
        containers.sync_checkpoints()
    first, restart = outs
    for rank in (0, 1):
        assert f"START rank={rank} step=0 " in first[rank] and f"INTERRUPTED rank={rank} after step 3" in first[rank]
        assert f"START rank={rank} step=3 " in restart[rank], restart[rank]
        assert f"DONE rank={rank} total=12.0" in restart[rank]  # 6 steps x 2 ranks, none repeated
        assert str(tmp_path / "restart" / request["TrainingJobName"] / f"algo-{rank + 1}" / "opt" / "ml" /
                   "checkpoints") in restart[rank]
    job.stop(wait=False)
    aws.set_status(job.training_job_name, "Stopped")
    assert job.wait(20) == "stopped"
