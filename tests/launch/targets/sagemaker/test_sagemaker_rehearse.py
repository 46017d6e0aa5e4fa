"""`--target sagemaker --rehearse`: the job rehearsed on this machine, nothing sent to AWS.

The rehearsal's AWS is the stand-in of sdp_jupyter.launch.sagemaker_standin (moto on 127.0.0.1, and
a thread that runs the job's hosts here under SageMaker's own Torchrun driver). What is checked:
a 2-host job from the magic, with an s3:// channel served from a local folder, succeeds and brings
its result, logs and metrics back into the job directory; an unknown instance type, a missing
channel and an entry point that does not exist are each one clear error before any host starts
(no CreateTrainingJob reaches the stand-in); a script that fails on host 2 is named in the error.
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("sagemaker.train")
pytest.importorskip("moto.server")

import sdp_jupyter  # noqa: E402
from sdp_jupyter.launch import JobSpec, SpecError, launch  # noqa: E402
from sdp_jupyter.launch.targets.sagemaker.training_job import SageMakerJob  # noqa: E402
from sdp_jupyter.launch.targets.sagemaker.options import SAGEMAKER_OPTIONS  # noqa: E402
from sdp_jupyter.launch.targets.sagemaker.plan import make_plan  # noqa: E402
from sdp_jupyter.launch.targets.sagemaker import rehearse as sagemaker_rehearse  # noqa: E402
from sdp_jupyter.testing import sagemaker_standin  # noqa: E402
from sdp_jupyter.testing.sagemaker_standin import MotoAWS  # noqa: E402

pytestmark = pytest.mark.slow

CELL = r'''
import argparse, os
import torch
import torch.distributed as dist
import sdp_jupyter

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int)
p.add_argument("--fail_on", default="")
a = p.parse_args()
dist.init_process_group(os.environ["SDP_BACKEND"])
rank, world = dist.get_rank(), dist.get_world_size()
files = sorted(os.listdir(os.environ["SM_CHANNEL_TRAIN"]))
data = open(os.path.join(os.environ["SM_CHANNEL_TRAIN"], files[0])).read().strip()
print(f"rank {rank}/{world} on {os.environ['SM_CURRENT_HOST']} of {os.environ['SM_HOSTS']}: {files} {data}",
      flush=True)
if os.environ["SM_CURRENT_HOST"] == a.fail_on:
    raise ValueError(f"bad batch on {a.fail_on}")
t = torch.tensor([float(rank + 1)])
for step in range(a.steps):
    dist.all_reduce(t)
    sdp_jupyter.report(step=step, samples=4, loss=1.0 / (step + 1))
{"sum": t.item(), "world": world, "host": os.environ["SM_CURRENT_HOST"], "data": data}
'''


@pytest.fixture(scope="module", autouse=True)
def stand_in():
    """The rehearsals' shared stand-in, closed at the end (it otherwise lives as long as the process)."""
    yield
    running = sagemaker_standin._running
    if running is not None:
        running.close()  # raises if the stand-in itself failed


@pytest.fixture
def data(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "part-0.txt").write_text("hello from a local folder\n")
    return folder


def spec(tmp_path, name, **kw) -> JobSpec:
    options = {"rehearse": True, "instance_type": "ml.m5.xlarge", "poll_interval": 0.2,
               "inputs": ["train=s3://my-real-bucket/data/train"]}
    options.update(kw.pop("sagemaker", {}))
    return JobSpec(code=kw.pop("code", CELL), name=name, target="sagemaker", nodes=2, procs_per_node=1,
                   backend=kw.pop("backend", "gloo"), jobs_dir=str(tmp_path / "jobs"), sagemaker=options, **kw)


def test_two_host_rehearsal_from_the_magic_brings_the_result_back(tmp_path, data, monkeypatch, capsys):
    from IPython.testing.globalipapp import get_ipython

    monkeypatch.setenv("SDP_JOBS_DIR", str(tmp_path / "jobs"))
    ip = get_ipython()
    ip.run_line_magic("load_ext", "sdp_jupyter")
    result = ip.run_cell(
        "%%sdp_train --target sagemaker --rehearse --name rehearsed --nodes 2 --procs-per-node 1 --backend gloo "
        "--instance-type ml.m5.xlarge --bucket my-real-bucket --input train=s3://my-real-bucket/data/train "
        f"--rehearse-data s3://my-real-bucket/data/train={data} --hp steps=5\n" + CELL)
    assert result.error_in_exec is None and result.error_before_exec is None
    job = result.result
    assert isinstance(job, SageMakerJob) and job.rehearsal["hosts"] == 2
    assert job.wait(180) == "succeeded", (job.error, job.logs(0), job.logs(1))
    # the same request a real submission sends, validated by the gate and kept in the job directory
    request = job.request
    assert request["ResourceConfig"] == {"InstanceType": "ml.m5.xlarge", "InstanceCount": 2, "VolumeSizeInGB": 30}
    channels = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"] for c in request["InputDataConfig"]}
    assert channels["train"] == "s3://my-real-bucket/data/train" and {"code", "sm_drivers"} <= set(channels)
    assert request["HyperParameters"] == {"steps": "5"}
    assert MotoAWS.create_requests[-1]["TrainingJobName"] == job.training_job_name
    # run as SageMaker runs it: each host its own SM_CURRENT_HOST, the channel from the local folder
    for host in (1, 2):
        log = job.logs(host - 1)
        assert (f"rank {host - 1}/2 on algo-{host} of [\"algo-1\", \"algo-2\"]: ['part-0.txt'] "
                "hello from a local folder") in log, log
        assert "torchrun --nnodes=2 --nproc_per_node=1" in log
        opt_ml = job.dir / "rehearsal" / job.training_job_name / f"algo-{host}" / "opt" / "ml"
        assert (opt_ml / "input" / "data" / "train" / "part-0.txt").is_file()
    assert job.result() == {"sum": 3.0 * 2 ** 4, "world": 2, "host": "algo-1", "data": "hello from a local folder"}
    assert len((job.dir / "metrics" / "rank-1.jsonl").read_text().splitlines()) == 5
    out = capsys.readouterr().out
    summary = job.summary()
    for text in (out, summary):
        assert "nothing was sent to AWS" in text
        assert "service quotas and instance capacity" in text and "IAM" in text and "real training image" in text
    assert job.sagemaker["status"] == "Completed"
    view = job.view()  # the same job view as a real job's, saying what it is
    view._redraw()
    assert "Rehearsal on this machine (not AWS) of SageMaker" in view.header.value
    assert "Completed" in view.header.value
    assert [view.ranks.get_title(h) for h in (0, 1)] == ["algo-1 (rank 0)", "algo-2 (rank 1) (opens its log)"]


def refused_before_any_host(tmp_path, s, flag: str, *phrases: str) -> str:
    sent = len(MotoAWS.create_requests)
    with pytest.raises(SpecError) as e:
        launch(s)
    message = str(e.value)
    assert e.value.option == flag, message
    for phrase in phrases:
        assert phrase in message, message
    assert len(MotoAWS.create_requests) == sent, "a CreateTrainingJob was sent"
    assert not (tmp_path / "jobs" / s.name).exists(), "a job directory was made"
    return message


def test_unknown_instance_type_is_refused_before_any_host(tmp_path, data):
    s = spec(tmp_path, "bad-type", sagemaker={"instance_type": "ml.p4d.48xlarge",
                                              "rehearse_data": [f"s3://my-real-bucket/data/train={data}"]})
    refused_before_any_host(tmp_path, s, "--instance-type", "ml.p4d.48xlarge", "closest: ml.p4d.24xlarge")


def test_missing_channel_is_refused_before_any_host(tmp_path, data):
    # the script reads $SM_CHANNEL_TRAIN, and the job has no channel train
    s = spec(tmp_path, "no-channel", sagemaker={"inputs": []})
    refused_before_any_host(tmp_path, s, "--input", "$SM_CHANNEL_TRAIN", "no channel 'train'",
                            "Fix: --input train=s3://")
    # an s3:// channel with no local data to serve it
    s = spec(tmp_path, "no-data")
    refused_before_any_host(tmp_path, s, "--rehearse-data", "channel 'train' reads s3://my-real-bucket/data/train",
                            "Fix: --rehearse-data s3://my-real-bucket/data/train=")
    # local data for a prefix no channel reads (a typo)
    s = spec(tmp_path, "typo", sagemaker={"rehearse_data": [f"s3://my-real-bucket/data/train={data}",
                                                            f"s3://my-real-bucket/data/tarin={data}"]})
    refused_before_any_host(tmp_path, s, "--rehearse-data", "s3://my-real-bucket/data/tarin is not the prefix")


def test_entry_point_that_does_not_exist_is_refused_before_any_host(tmp_path, data):
    s = JobSpec(script=str(tmp_path / "train.py"), name="no-entry", target="sagemaker", nodes=2,
                procs_per_node=1, backend="gloo", jobs_dir=str(tmp_path / "jobs"),
                sagemaker={"rehearse": True, "instance_type": "ml.m5.xlarge"})
    refused_before_any_host(tmp_path, s, "script", f"{tmp_path / 'train.py'} does not exist")
    # and one that exists but cannot run: every host would die at its first line
    s = spec(tmp_path, "broken", code="def f(:\n", sagemaker={"inputs": []})
    refused_before_any_host(tmp_path, s, "script", "does not compile", "line 1")


def test_script_failing_on_host_2_is_named(tmp_path, data):
    s = spec(tmp_path, "fails-on-2", hyperparameters={"steps": 3, "fail_on": "algo-2"},
             sagemaker={"rehearse_data": [f"s3://my-real-bucket/data/train={data}"]})
    job = launch(s)
    assert job.wait(180) == "failed"
    assert job.error == ("AlgorithmError: rank 1 (algo-2) of job fails-on-2 failed: "
                         "ValueError: bad batch on algo-2"), job.error
    assert "ValueError: bad batch on algo-2" in job.logs(1)
    assert job.sagemaker["failure_reason"] == job.error and job.sagemaker["status"] == "Failed"


def test_rehearse_data_needs_rehearse(tmp_path, data):
    with pytest.raises(SpecError, match="--rehearse-data.*serves data to a rehearsal only"):
        make_plan(spec(tmp_path, "x", sagemaker={"rehearse": False,
                                                    "rehearse_data": [f"s3://b/p={data}"]}))
    assert "--rehearse" in {o.flag for o in SAGEMAKER_OPTIONS}
    assert sagemaker_rehearse.NOT_CHECKED


SMDDP_CELL = r'''
import os
import torch
import torch.distributed as dist

dist.init_process_group("smddp")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
{"sum": t.item(), "backend": dist.get_backend(), "provider": os.environ.get("SDP_SMDDP_PROVIDER")}
'''


def test_smddp_job_rehearses_with_smddp_played_by_gloo(tmp_path):
    """A job written for SageMaker's smddp (p4d) rehearses here: the entry finds an smdistributed in
    the rehearsal's image packages, which registers "smddp" on gloo."""
    s = spec(tmp_path, "smddp-rehearsal", code=SMDDP_CELL, backend="smddp",
             sagemaker={"instance_type": "ml.p4d.24xlarge", "inputs": []})
    job = launch(s)
    assert job.wait(180) == "succeeded", (job.error, job.logs(0), job.logs(1))
    assert job.request["ResourceConfig"]["InstanceType"] == "ml.p4d.24xlarge"
    assert job.request["Environment"]["SDP_BACKEND"] == "smddp"
    assert job.result() == {"sum": 3.0, "backend": "smddp", "provider": "smdistributed"}


def test_a_poller_whose_set_up_fails_once_retries_instead_of_leaving_the_job_pending(tmp_path, monkeypatch):
    """The job's poller creates its boto client in its own thread while the rehearsal's submit may
    still be restoring os.environ (boto iterates it: a KeyError once, in a full run). A failure
    there is retried like a failed poll; the job ends (it stayed "pending" for good)."""
    original, failed = SageMakerJob._boto, []

    def flaky(job):
        import threading
        if threading.current_thread().name.startswith("sdp-sagemaker-") and not failed:
            failed.append(True)
            raise KeyError("AWS_ACCESS_KEY_ID")  # what os.environ's iterator raised
        return original(job)

    monkeypatch.setattr(SageMakerJob, "_boto", flaky)
    s = spec(tmp_path, "flaky-poller", code=SMDDP_CELL, backend="smddp",
             sagemaker={"instance_type": "ml.p4d.24xlarge", "inputs": []})
    job = launch(s)
    assert job.wait(120) == "succeeded", (job.state, job.error, job.sagemaker.get("poll_error"))
    assert failed  # the set-up did fail once (the poll error is cleared by the next good poll)
    assert job.result()["sum"] == 3.0


def test_init_process_group_option_reaches_the_sagemaker_hosts(tmp_path):
    """--init-process-group on SageMaker: the container entry makes the default group with the job's
    backend before the script, so a script that never calls init_process_group (as Trainer expects
    a group to exist) trains on it."""
    code = SMDDP_CELL.replace('dist.init_process_group("smddp")\n', "")
    assert "init_process_group" not in code
    s = spec(tmp_path, "init-pg", code=code, backend="smddp", init_process_group=True,
             sagemaker={"instance_type": "ml.p4d.24xlarge", "inputs": []})
    job = launch(s)
    assert job.wait(180) == "succeeded", (job.error, job.logs(0), job.logs(1))
    assert job.result() == {"sum": 3.0, "backend": "smddp", "provider": "smdistributed"}


def test_stand_in_started_twice_is_the_same_one(tmp_path, monkeypatch):
    """Notebook 04's first cell run twice gets the running stand-in back; its environment is undone
    on close()."""
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    running = sagemaker_standin._running
    if running is not None:
        running.close()
    first = sagemaker_standin.start(str(tmp_path))
    try:
        assert sagemaker_standin.start() is first and sagemaker_standin.shared() is first
        assert os.environ["AWS_ENDPOINT_URL"] == first.endpoint
        with pytest.raises(RuntimeError, match="already runs"):
            sagemaker_standin.start(set_environ=False)
    finally:
        first.close()
    assert "AWS_ENDPOINT_URL" not in os.environ and sagemaker_standin._running is None


OURS_CELL = r'''
import os, sys
import torch
import torch.distributed as dist
import sdp_jupyter

dist.init_process_group("smddp")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((1000,), float(rank + 1))
for step in range(3):
    dist.all_reduce(t)
    sdp_jupyter.report(step=step, samples=4)
{"sum": t[0].item(), "world": world, "backend": dist.get_backend(), "provider": os.environ.get("SDP_SMDDP_PROVIDER"),
 "package": sdp_jupyter.__file__, "prefix": sys.prefix}
'''


def test_engine_auto_on_a_type_aws_refuses_installs_ours_in_a_fresh_image(tmp_path):
    """ml.g5.12xlarge with --backend smddp --engine auto: SageMaker's library refuses the type, so the
    job ships sdp_jupyter as a source package; each host's entry runs in an "image" (a virtual
    environment) without sdp_jupyter, installs it from the package (compiling the engine), and the
    2 hosts train on our engine."""
    s = spec(tmp_path, "g5-ours", code=OURS_CELL, backend="smddp",
             sagemaker={"instance_type": "ml.g5.12xlarge", "inputs": [], "engine": "auto"})
    job = launch(s)
    assert job.sagemaker["engine"] == "sdp"
    assert job.wait(240) == "succeeded", (job.error, job.logs(0), job.logs(1))
    result = job.result()
    assert result["sum"] == 3.0 * 2 ** 2 and result["world"] == 2
    assert (result["backend"], result["provider"]) == ("smddp", "sdp_jupyter")
    # the hosts ran another Python environment than this one, and imported the sdp_jupyter
    # installed into it from the shipped package, not this checkout
    assert result["prefix"] != sys.prefix and not result["package"].startswith(os.path.dirname(sdp_jupyter.__file__))
    assert result["package"].startswith(os.path.join(result["prefix"], "lib")), result
    assert "site-packages" in result["package"], result
    logs = job.logs(0) + job.logs(1)
    assert "smddp engine: sdp_jupyter's engine (sdp_jupyter" in logs and "built from sdp_jupyter-" in logs, logs
    assert job.sagemaker["engine_ran"].startswith("sdp_jupyter's engine"), job.sagemaker
    summary = job.summary()
    assert "smddp engine: sdp_jupyter's engine" in summary and "(reported by the hosts)" in summary
    assert "its engine builds" in summary
    view = job.view()  # the job view says it too
    view._redraw()
    assert "smddp engine: sdp_jupyter&#x27;s engine (sdp_jupyter" in view.header.value, view.header.value


def test_run_a_function_in_a_rehearsal(tmp_path):
    """sdp_jupyter.run on the SageMaker target: the function goes by value in the job's source, every host
    calls it after the process group is up, the values come back from the job's output."""
    import sdp_jupyter

    scale = 10

    def where(k):  # a closure (it reads `scale` from this test): by value, as a notebook's function goes
        import torch.distributed as dist
        return [os.environ["SM_CURRENT_HOST"], dist.get_rank() * k * scale]

    options = {"rehearse": True, "instance_type": "ml.m5.xlarge", "poll_interval": 0.2}
    values = sdp_jupyter.run(where, args=(2,), target="sagemaker", nodes=2, procs_per_node=1, backend="gloo",
                             name="rehearsed-run", jobs_dir=str(tmp_path / "jobs"), sagemaker=options)
    assert values == [["algo-1", 0], ["algo-2", 20]]


def test_sdp_train_exits_once_its_rehearsal_has_ended(tmp_path):
    """The command line's rehearsal keeps its SageMaker stand-in for the life of the process; at exit the
    stand-in is stopped while its server's thread still runs (left to the garbage collector, the process
    waited for a thread the interpreter had frozen and never exited)."""
    import subprocess
    import time

    (tmp_path / "t.py").write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n"
                                   "print('rank', dist.get_rank())\n")
    env = dict(os.environ, SDP_JOBS_DIR=str(tmp_path / "jobs"))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sdp_jupyter.cli", "--target", "sagemaker", "--rehearse",
                           "--nodes", "2", "--instance-type", "ml.m5.xlarge", "--backend", "gloo", "t.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ": succeeded after " in proc.stderr, proc.stderr[-3000:]
    print(f"sdp-train --rehearse: {time.monotonic() - t0:.1f} s from start to exit")
