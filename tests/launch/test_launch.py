"""JobSpec validation and serialisation, the option table, worker environment: no processes started."""
from __future__ import annotations

import importlib.util
import json

import pytest

from sdp_jupyter.launch import JobSpec, SpecError, launch
from sdp_jupyter.launch.spec import all_options
from sdp_jupyter.launch.targets.local.launcher import LocalLauncher, LocalRun
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.rank.worker import script_arguments


@pytest.mark.parametrize("fields, option, fragment", [
    ({"nodes": 0}, "--nodes", "1 or more"),
    ({"nodes": "four"}, "--nodes", "whole number"),
    ({"nodes": 2.5}, "--nodes", "whole number"),
    ({"nodes": True}, "--nodes", "whole number"),
    ({"procs_per_node": 0}, "--procs-per-node", "1 or more"),
    ({"backend": "mpi"}, "--backend", "smddp, gloo, nccl"),
    ({"target": "aws"}, "--target", "local, ssh, ray, slurm, sagemaker"),
    ({"ranks_output": "3"}, "--ranks-output", "0, all"),
    ({"max_restarts": -1}, "--max-restarts", "0 or more"),
    ({"timeout": "soon"}, "--timeout", "seconds"),
    ({"timeout": 0}, "--timeout", "more than 0"),
    ({"name": "has space"}, "--name", "not a valid job name"),
    ({"env": ["NOEQUALS"]}, "--env", "KEY=VALUE"),
    ({"env": ["RANK=3"]}, "--env", "set by the launcher"),
    ({"hp": None, "hyperparameters": ["1x=2"]}, "--hp", "not a valid name"),
    ({"push": "a,2b"}, "--push", "not a variable name"),
    ({"result": "my-var"}, "--result", "not a variable name"),
    ({"args": "'unclosed"}, "--args", "quotes"),
])
def test_bad_values_name_the_option_and_the_fix(fields, option, fragment):
    fields.pop("hp", None)
    with pytest.raises(SpecError) as info:
        JobSpec(code="pass", **fields)
    assert info.value.option == option
    assert str(info.value).startswith(option) and fragment in str(info.value)


def test_code_or_script_exactly_one():
    with pytest.raises(SpecError, match="exactly one"):
        JobSpec()
    with pytest.raises(SpecError, match="exactly one"):
        JobSpec(code="x", script="a.py")
    with pytest.raises(SpecError, match="empty"):
        JobSpec(code="  \n")


def test_coercion_of_option_strings():
    spec = JobSpec(code="x", nodes="4", procs_per_node="2", max_restarts="1", timeout="90",
                   env=["A=1", "B=x=y"], hyperparameters=["lr=0.1", "name=resnet", "layers=[1,2]"],
                   args='--epochs 3 --tag "a b"', push="X, y")
    assert (spec.nodes, spec.procs_per_node, spec.max_restarts, spec.timeout) == (4, 2, 1, 90.0)
    assert spec.env == {"A": "1", "B": "x=y"}
    assert spec.hyperparameters == {"lr": 0.1, "name": "resnet", "layers": [1, 2]}
    assert spec.args == ["--epochs", "3", "--tag", "a b"]
    assert spec.push == ["X", "y"]


def test_json_round_trip_and_unknown_fields():
    spec = JobSpec(code="print(1)", name="a1", nodes=3, backend="gloo", hyperparameters={"lr": 0.5},
                   sagemaker={"instance_type": "ml.p4d.24xlarge"})
    again = JobSpec.from_json(spec.to_json())
    assert again == spec
    json.loads(spec.to_json())  # plain JSON
    with pytest.raises(SpecError, match="unknown JobSpec field"):
        JobSpec.from_dict({"code": "x", "gpus": 2})


def _parse_magic_line(line):
    """Parse a rendered %%sdp_train line with the magic's own parser."""
    from sdp_jupyter.magics import SdpMagics, parse_line

    assert line.startswith("%%sdp_train")
    return vars(parse_line(SdpMagics.sdp_train, line[len("%%sdp_train"):]))


def test_magic_line_round_trips_through_the_magic_parser():
    spec = JobSpec(code="x", name="run-1", nodes=4, procs_per_node=2, backend="gloo",
                   env={"A": "1 2"}, args=["--verbose"], hyperparameters={"lr": 0.1, "opt": "adam"},
                   push=["X", "y"], result="w", max_restarts=2, checkpoint_dir="/tmp/c d", timeout=30,
                   ranks_output="all")
    line = spec.to_magic_line(wait=True)
    values = _parse_magic_line(line)
    assert values["wait"] is True
    assert JobSpec.from_options(values, code="x") == spec
    assert JobSpec(code="x").to_magic_line() == "%%sdp_train"
    # an elastic job's wait is --elastic-wait (it was written as --timeout, which kills the copied job)
    elastic = JobSpec(code="x", nodes="2:3", elastic_wait=60, timeout=300)
    assert "--elastic-wait 60 --timeout 300" in elastic.to_magic_line()
    assert JobSpec.from_options(_parse_magic_line(elastic.to_magic_line()), code="x") == elastic


def test_every_option_maps_to_a_field_or_steers_the_magic_only():
    from sdp_jupyter.cli import NOTEBOOK_ONLY

    fields = set(JobSpec.__dataclass_fields__)
    flags = [opt.flag for opt in all_options()]
    assert len(flags) == len(set(flags)), "two providers define the same option"
    for opt in all_options():  # --wait, --no-auto-push: the magic's, never the CLI's (nothing to wait for, no notebook)
        assert (opt.field or "").split(".")[0] in fields or opt.field is None and opt.flag in NOTEBOOK_ONLY, opt


@pytest.mark.skipif(importlib.util.find_spec("sdp_jupyter.launch.targets.sagemaker") is None,
                    reason="no SageMaker options installed")
def test_provider_options_fill_dict_fields_and_round_trip():
    values = _parse_magic_line("%%sdp_train --target sagemaker --instance-type ml.p4d.24xlarge --spot "
                               "--input train=s3://b/train --max-run 600 --engine sdp")
    spec = JobSpec.from_options(values, code="x")
    assert spec.sagemaker["instance_type"] == "ml.p4d.24xlarge" and spec.sagemaker["spot"] is True
    assert spec.sagemaker["engine"] == "sdp"
    assert spec.sagemaker["max_run"] == "600" and spec.sagemaker["inputs"] == ["train=s3://b/train"]
    line = spec.to_magic_line()
    assert "--instance-type ml.p4d.24xlarge" in line and "--spot" in line and "--input train=s3://b/train" in line
    assert "--engine sdp" in line
    assert JobSpec.from_options(_parse_magic_line(line), code="x") == spec


HYBRID = {"tp": 2, "pp": 2, "microbatches": 4, "active_microbatches": 2, "pipeline_schedule": "interleaved",
          "virtual_stages": 2, "shard_optimizer": "gradients", "checkpoint_activations": "selective",
          "offload_activations": False, "sequence_parallel": False}


def test_hybrid_parallel_options_round_trip_through_json_and_the_magic_line():
    spec = JobSpec(code="x", nodes=2, procs_per_node=2, backend="gloo", parallel=HYBRID)
    assert spec.parallel == {k: v for k, v in HYBRID.items() if k != "offload_activations"}  # defaults dropped
    assert JobSpec.from_json(spec.to_json()) == spec
    line = spec.to_magic_line()
    assert line == ("%%sdp_train --nodes 2 --procs-per-node 2 --backend gloo --tp 2 --pp 2 --microbatches 4 "
                    "--active-microbatches 2 --pipeline-schedule interleaved --virtual-stages 2 "
                    "--shard-optimizer gradients --checkpoint-activations selective --no-sequence-parallel")
    assert JobSpec.from_options(_parse_magic_line(line), code="x") == spec
    # the bare flags stand for their default level, and render back bare
    values = _parse_magic_line("%%sdp_train --nodes 2 --procs-per-node 2 --tp 2 --pp 2 --microbatches 4 "
                               "--shard-optimizer --checkpoint-activations --offload-activations")
    spec = JobSpec.from_options(values, code="x")
    assert spec.parallel == {"tp": 2, "pp": 2, "microbatches": 4, "shard_optimizer": "optimizer",
                             "checkpoint_activations": "layer", "offload_activations": True}
    assert spec.to_magic_line().endswith("--microbatches 4 --shard-optimizer --checkpoint-activations "
                                         "--offload-activations")
    assert JobSpec.from_options(_parse_magic_line(spec.to_magic_line()), code="x") == spec
    # an old spec.json (no "parallel") still loads, and options at their defaults are no options
    old = json.loads(JobSpec(code="x").to_json())
    del old["parallel"]
    assert JobSpec.from_dict(old).parallel == {}
    assert JobSpec(code="x", parallel={"tp": 1, "shard_optimizer": "none", "sequence_parallel": True}).parallel == {}


def test_script_arguments_follow_sagemaker_hyperparameter_convention():
    spec = JobSpec(code="x", args=["--a", "1"], hyperparameters={"lr": 0.1, "name": "x", "flag": True})
    assert script_arguments(spec.to_dict()) == ["--a", "1", "--lr", "0.1", "--name", "x", "--flag", "true"]


def local_env(run, rank: int, attempt: int, port: int, gpus: int = 0) -> dict:
    """What a local node's agent gives `rank` (launch/host/agent.py) from the run's start frame."""
    from sdp_jupyter.launch.host.agent import rank_environment

    frame = {"secret": run.secret, "master_addr": "127.0.0.1", "master_port": port, "attempt": attempt,
             **run.start_fields()}
    return rank_environment(run.spec, frame, rank, run.job.dir, "127.0.0.1", gpus)


def local_run(spec, job_dir):
    run = LocalRun(spec, LocalLauncher())
    run.attach(Job(spec, job_dir), None)
    return run


def test_worker_environment(tmp_path):
    spec = LocalLauncher().resolve(JobSpec(code="x", name="envjob", nodes=2, procs_per_node=2, backend="gloo",
                                           env={"FOO": "bar"}, hyperparameters={"lr": 0.1},
                                           jobs_dir=str(tmp_path)))
    run = local_run(spec, tmp_path / "envjob")
    env = local_env(run, rank=3, attempt=1, port=12345)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == \
        ("3", "1", "4", "2", "1")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", "12345")
    assert json.loads(env["SM_HOSTS"]) == ["algo-1", "algo-2"] and env["SM_CURRENT_HOST"] == "algo-2"
    assert json.loads(env["SM_HPS"]) == {"lr": 0.1} and env["SM_HP_LR"] == "0.1"
    assert env["SM_NUM_GPUS"] == "0"
    assert env["SDP_JOB_DIR"] == str(tmp_path / "envjob") and env["SDP_JOB_NAME"] == "envjob"
    assert len(env["SDP_JOB_SECRET"]) == 64 and env["SDP_BACKEND"] == "gloo" and env["SDP_RESTART"] == "1"
    assert env["SDP_CHECKPOINT_DIR"] == str(tmp_path / "envjob" / "checkpoints")
    assert env["FOO"] == "bar" and env["SDP_NUM_NODES"] == "2"
    other = local_run(spec, tmp_path / "envjob")
    assert local_env(other, 0, 0, 1)["SDP_JOB_SECRET"] != env["SDP_JOB_SECRET"]  # fresh per job
    assert not any(k in env for k in ("SDP_TP", "SDP_PP", "SDP_MICROBATCHES", "SDP_SHARD_OPTIMIZER"))


def test_worker_environment_carries_the_hybrid_parallel_options(tmp_path):
    from sdp_jupyter.parallel_config import ParallelConfig

    spec = LocalLauncher().resolve(JobSpec(code="x", name="hyb", nodes=2, procs_per_node=2, backend="gloo",
                                           jobs_dir=str(tmp_path), parallel=HYBRID))
    run = local_run(spec, tmp_path / "hyb")
    envs = [local_env(run, rank, 0, 1) for rank in range(4)]
    expected = {"SDP_TP": "2", "SDP_PP": "2", "SDP_MICROBATCHES": "4", "SDP_ACTIVE_MICROBATCHES": "2",
                "SDP_PIPELINE_SCHEDULE": "interleaved", "SDP_VIRTUAL_STAGES": "2", "SDP_SHARD_OPTIMIZER": "gradients",
                "SDP_CHECKPOINT_ACTIVATIONS": "selective", "SDP_OFFLOAD_ACTIVATIONS": "0",
                "SDP_SEQUENCE_PARALLEL": "0"}
    for env in envs:
        assert {k: env.get(k) for k in expected} == expected
    # what sdp_jupyter.parallel.setup() reads back is the configuration asked for
    assert ParallelConfig.from_env(envs[3]) == ParallelConfig(
        tp=2, pp=2, microbatches=4, active_microbatches=2, schedule="interleaved", virtual_stages=2,
        sharding="gradients", checkpointing="selective", sequence_parallel=False)


def test_hybrid_layout_is_checked_once_the_launcher_knows_the_processes_per_node(monkeypatch):
    from sdp_jupyter.launch.targets.local import launcher as local

    monkeypatch.setattr(local, "gpu_count", lambda: 0)  # a CPU-only machine: 1 process per node
    spec = JobSpec(code="x", nodes=4, parallel={"tp": 2})  # procs per node not known yet: not refused
    with pytest.raises(SpecError) as info:
        LocalLauncher().resolve(spec)
    assert info.value.option == "--tp" and "must not cross nodes" in str(info.value)


def test_compat_path_only_without_the_real_library(tmp_path, monkeypatch):
    from sdp_jupyter.launch import process  # where the rank's PYTHONPATH is made, for every target

    spec = LocalLauncher().resolve(JobSpec(code="x", name="c", backend="gloo", jobs_dir=str(tmp_path)))
    run = local_run(spec, tmp_path / "c")
    monkeypatch.setattr(process, "smdistributed_installed", lambda: False)
    assert process.COMPAT_DIR in local_env(run, 0, 0, 1)["PYTHONPATH"].split(":")
    monkeypatch.setattr(process, "smdistributed_installed", lambda: True)
    assert process.COMPAT_DIR not in local_env(run, 0, 0, 1)["PYTHONPATH"].split(":")


def test_bad_input_launches_nothing(tmp_path):
    root = tmp_path / "jobs"
    with pytest.raises(SpecError, match="nccl needs a GPU per process"):
        launch(code="x", backend="nccl", jobs_dir=str(root))
    with pytest.raises(SpecError, match="not defined"):
        LocalLauncher().start(JobSpec(code="x", push=["b"], jobs_dir=str(root)), push={})
    if importlib.util.find_spec("sdp_jupyter.launch.targets.sagemaker") is None:
        with pytest.raises(SpecError, match="sagemaker is not available"):
            launch(code="x", target="sagemaker", jobs_dir=str(root))
    with pytest.raises(SpecError, match="does not exist"):
        launch(str(tmp_path / "missing.py"), jobs_dir=str(root))
    assert not root.exists() or not any(root.iterdir())


def test_launch_is_both_the_package_and_the_function():
    import sdp_jupyter
    import sdp_jupyter.launch as package
    from sdp_jupyter.launch import launch as function

    assert sdp_jupyter.launch is package is function
    assert callable(package) and callable(package.get_job) and "JobSpec" in package.__call__.__doc__


def test_each_local_node_sees_its_own_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    spec = LocalLauncher().resolve(JobSpec(code="x", name="g", nodes=2, procs_per_node=2, backend="gloo",
                                           jobs_dir=str(tmp_path)))
    run = local_run(spec, tmp_path / "g")
    # gpus=4: as NVML would report on a 4-GPU machine
    assert [local_env(run, r, 0, 1, gpus=4)["CUDA_VISIBLE_DEVICES"] for r in range(4)] == ["4,5", "4,5", "6,7", "6,7"]
    assert local_env(run, 0, 0, 1, gpus=4)["SM_NUM_GPUS"] == "2"
    assert local_env(run, 3, 0, 1)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # no GPU found: left alone


def test_a_folder_that_is_not_a_job_is_never_cleared(tmp_path):
    precious = tmp_path / "Documents"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(SpecError, match="not a job directory"):
        launch(code="x", name="Documents", jobs_dir=str(tmp_path), backend="gloo")
    assert (precious / "thesis.tex").read_text() == "years of work"


def test_warm_cold_and_preload_options_parse_round_trip_and_refuse_bad_values():
    from sdp_jupyter.cli import build_parser

    assert JobSpec(code="x").start == "auto" and JobSpec(code="x").preload == []
    for line, start, preload in [("%%sdp_train --warm --preload numpy,sklearn", "warm", ["numpy", "sklearn"]),
                                 ("%%sdp_train --cold", "cold", []),
                                 ("%%sdp_train --preload os.path", "auto", ["os.path"])]:
        spec = JobSpec.from_options(_parse_magic_line(line), code="x")
        assert (spec.start, spec.preload) == (start, preload)
        assert spec.to_magic_line() == line
        assert JobSpec.from_json(spec.to_json()) == spec
    # sdp-train: the same rows
    ns = build_parser().parse_args(["--cold", "--preload", "numpy", "train.py"])
    assert JobSpec.from_options(vars(ns), script=ns.script).start == "cold"
    with pytest.raises(SpecError, match=r"^--cold: cannot be given together with --warm\. Fix: keep one"):
        JobSpec.from_options(_parse_magic_line("%%sdp_train --warm --cold"), code="x")
    with pytest.raises(SpecError, match=r"^--warm/--cold: 'hot' is not one of auto, warm, cold\. Fix: --warm"):
        JobSpec(code="x", start="hot")
    with pytest.raises(SpecError, match=r"^--preload: 'numpy-1' is not a module name\. Fix: --preload numpy"):
        JobSpec.from_options(_parse_magic_line("%%sdp_train --preload numpy-1"), code="x")
    with pytest.raises(SpecError, match=r"^--warm: warm starts are for the local, ssh and ray targets so far, and "
                                        r"the target is sagemaker\. Fix: remove --warm"):
        JobSpec(code="x", start="warm", target="sagemaker")
    with pytest.raises(SpecError, match=r"^--preload: .* target is sagemaker\. Fix: remove --preload"):
        JobSpec(code="x", preload=["numpy"], target="sagemaker")
    assert JobSpec(code="x", start="warm", preload=["numpy"], target="ssh", ssh={"hosts": ["a"]}).start == "warm"
    assert JobSpec(code="x", start="warm", target="ray").start == "warm"
    assert JobSpec(code="x", start="cold", target="sagemaker").start == "cold"  # what it does anyway


def test_launcher_takes_warm_or_cold_from_the_spec_unless_its_own_argument_says():
    assert LocalLauncher().start_choice(JobSpec(code="x", start="warm")) is True
    assert LocalLauncher().start_choice(JobSpec(code="x", start="cold")) is False
    assert LocalLauncher().start_choice(JobSpec(code="x")) is None
    assert LocalLauncher(warm=False).start_choice(JobSpec(code="x", start="warm")) is False
    assert LocalLauncher(warm=True).start_choice(JobSpec(code="x", start="cold")) is True


def test_summary_and_job_view_say_warm_or_cold_start(jobs_dir):
    from sdp_jupyter.ui.jobview import JobView

    job_dir, spec = Job.create_dir(JobSpec(code="x", name="label", nodes=2))
    job = Job(spec, job_dir)
    job.update_status(state="succeeded", created=1.0, started=1.0, ended=2.0)
    assert job.start_label is None and " start" not in job.summary()
    job.update_status(start="warm")
    assert "backend smddp, warm start, restarts 0)" in job.summary()
    assert "warm start" in JobView(job).header.value
    job.update_status(start="cold", start_reason="warm start not possible: the pool runs 2 Python threads")
    reopened = Job.open(job_dir)  # read back from status.json
    assert "cold start (warm start not possible: the pool runs 2 Python threads)" in reopened.summary()
    header = JobView(reopened).header.value
    assert "cold start (warm start not possible: the pool runs 2 Python threads)" in header


def test_summary_and_job_view_say_where_a_remote_job_runs(jobs_dir):
    from sdp_jupyter.ui.jobview import JobView

    job_dir, spec = Job.create_dir(JobSpec(code="x", name="where", nodes=2, target="ssh", ssh={"hosts": ["a", "b"]}))
    job = Job(spec, job_dir)
    job.update_status(state="running", target="ssh", hosts=["a", "b"], host_names=["gpu-a", "<b>"])
    assert "2 node(s) x 1 proc(s) on ssh: gpu-a, <b>, backend" in job.summary()
    assert "on ssh: gpu-a, &lt;b&gt;" in JobView(Job.open(job_dir)).header.value  # escaped: hosts name themselves
    local_dir, local_spec = Job.create_dir(JobSpec(code="x", name="here"))
    local = Job(local_spec, local_dir)
    local.update_status(state="running", target="local")
    assert local.where_label is None and " on " not in local.summary().split(" in ")[0]


def test_a_crash_inside_the_numpy_face_is_named_whichever_comm_module_it_is_in():
    from sdp_jupyter.launch.kernel.rank_report import crash_summary

    for module in ("communicator.py", "routing.py"):
        log = ("[sdp_jupyter] fatal signal 11 (SIGSEGV) in thread 'MainThread'\n\n"
               'Current thread 0x1 (most recent call first):\n'
               '  File "/site/sdp_jupyter/comm/work.py", line 64 in wait\n'
               f'  File "/site/sdp_jupyter/comm/{module}", line 7 in gather\n'
               '  File "/job/script.py", line 3 in <module>\n\n'
               'Thread 0x2 (most recent call first):\n'
               '  File "/site/sdp_jupyter/comm/work.py", line 9 in wait\n')
        assert crash_summary(log).endswith("during sdp_jupyter.comm gather"), (module, crash_summary(log))
    # through torch, the torch.distributed call is named, not the adapter's wait in comm below it
    log = ('Current thread 0x1 (most recent call first):\n'
           '  File "/site/sdp_jupyter/comm/work.py", line 64 in wait\n'
           '  File "/site/sdp_jupyter/torch/work.py", line 75 in wait\n'
           '  File "/site/torch/distributed/distributed_c10d.py", line 3252 in all_reduce\n'
           '  File "/job/script.py", line 3 in <module>\n')
    assert crash_summary(log) == " during torch.distributed.all_reduce", crash_summary(log)


def test_every_registered_target_names_a_launcher_that_loads():
    """A target's record names its launcher as a string (the launchers import the spec, which reads the
    records); a name that does not load would pass JobSpec's checks and fail only at launch."""
    from sdp_jupyter.launch import targets

    for name in targets.TARGETS:
        cls = targets.load(targets.launcher_path(name))
        assert isinstance(cls, type) and callable(getattr(cls, "start", None)), (name, targets.launcher_path(name))


def test_the_help_names_every_target_of_the_registry():
    """sdp-train --help and the --target option name the targets from the registry, not a list written
    by hand (which named local, ssh and sagemaker only)."""
    from sdp_jupyter.cli import build_parser
    from sdp_jupyter.launch import targets

    names = list(targets.TARGETS)
    spoken = ", ".join(names[:-1]) + " or " + names[-1]
    assert spoken == "local, ssh, ray, slurm or sagemaker"
    parser = build_parser()
    assert spoken in parser.description
    assert f"where to run: {spoken}" in " ".join(parser.format_help().split())  # --target's own help


def test_the_help_shows_every_option_s_text_as_written():
    """argparse %-formats each option's help: an unescaped "%sdp_warm" in --warm's text came out as the
    whole argparse action spliced in ("{'option_strings': ...}dp_warm"). Every option's text appears
    in sdp-train --help as written (whitespace aside), and no action's repr leaks in."""
    from sdp_jupyter.cli import NOTEBOOK_ONLY, build_parser
    from sdp_jupyter.launch.spec import all_options

    shown = "".join(build_parser().format_help().split())  # argparse wraps lines, even after a "--"
    assert "option_strings" not in shown
    assert any("%" in opt.help for opt in all_options())  # the case this guards is still there
    for opt in all_options():
        if opt.flag not in NOTEBOOK_ONLY:
            assert "".join(opt.help.split()) in shown, opt.flag


def test_the_cause_of_a_failure_is_the_rank_whose_error_is_its_own():
    from sdp_jupyter.launch.kernel.supervise import first_cause, others_failed

    lost_2 = "Traceback ...\nsdp_jupyter.torch.work.SmddpBackendError: rank 2 (node 2 at 10.0.0.3) shut down its process group"
    gloo = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.3]:4000."
    own = "ValueError: bad batch"
    # the peers' exits came first: the rank whose error is not a lost peer is the cause
    assert first_cause([0, 1, 2], {0: lost_2, 1: gloo, 2: own}) == 2
    # every error is a lost peer (the cause was killed, its log ends mid-output): the failed rank they name
    assert first_cause([0, 2], {0: lost_2, 2: "step 4 loss 0.1\n" + lost_2.replace("rank 2", "rank 0")}) == 2
    # the rank they name did not fail (it hangs): the first to end
    assert first_cause([1, 0], {0: lost_2, 1: lost_2}) == 1
    assert first_cause([3], {}) == 3
    assert others_failed([], [0, 1]).startswith("\n(ranks 0-1 failed too, after it") and others_failed([], []) == ""
