"""The magics through IPython's InteractiveShell (text mode: no widget frontend)."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import pytest
from IPython.core.error import UsageError

from conftest import wait_no_processes, worker_processes
from sdp_jupyter.launch import Job, JobError
from sdp_jupyter.launch.spec import all_options


@pytest.fixture
def ip(jobs_dir):
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "sdp_jupyter")
    yield shell
    for name in ("X", "lk", "out", "res", "later"):
        shell.user_ns.pop(name, None)


def run(ip, cell):
    """Run a cell; return (result, exception raised in it or None)."""
    result = ip.run_cell(cell)
    return result, result.error_in_exec or result.error_before_exec


def test_load_ext_registers_the_setup_magics_too(ip):
    assert "sdp_setup" in ip.magics_manager.magics["line"]
    assert "sdp_cell" in ip.magics_manager.magics["cell"]
    assert "sdp_train" in ip.magics_manager.magics["cell"]


def test_help_lists_every_option(ip):
    doc = ip.find_cell_magic("sdp_train").__doc__
    for opt in all_options():
        assert opt.flag in doc, opt.flag
    assert "one process per rank" in doc and "%%sdp_train [--nodes N|MIN:MAX]" in doc


@pytest.mark.parametrize("cell, fragment", [
    ("%%sdp_train --nodes 0\nx = 1", "--nodes: must be 1 or more, got 0. Fix: --nodes"),
    ("%%sdp_train --nodes two\nx = 1", "--nodes: must be a whole number, got 'two'"),
    ("%%sdp_train --procs-per-node 1.5\nx = 1", "--procs-per-node: must be a whole number"),
    ("%%sdp_train --frobnicate\nx = 1", "unrecognized arguments: --frobnicate"),
    ("%%sdp_train --backend mpi\nx = 1", "--backend: 'mpi' is not one of smddp, gloo, nccl"),
    ("%%sdp_train --backend nccl\nx = 1", "nccl needs a GPU per process and this machine has none"),
    ("%%sdp_train --push undefined_var\nx = 1", "'undefined_var' is not defined in the notebook"),
    ("%%sdp_train --push lk\nx = 1", "'lk' (lock) cannot be sent to the ranks"),
    ("%%sdp_train\n   \n", "the cell is empty"),
    ("%%sdp_train --nodes 2\nx = 1\nfor i in range(3)\n    pass\n", "syntax error on line 3 of the cell"),
    ("%%sdp_train --args '--unclosed\nx = 1", "check the quotes"),
    ("%%sdp_train --env RANK=3\nx = 1", "--env: RANK is set by the launcher"),
    # hybrid-parallel options: the advisor's layout rules, before any process starts
    ("%%sdp_train --nodes 4 --procs-per-node 1 --tp 2\nx = 1",
     "--tp: this job's layout (--nodes 4 x --procs-per-node 1, tp=2, pp=1) cannot run"),
    ("%%sdp_train --nodes 4 --procs-per-node 1 --tp 2\nx = 1", "tensor parallelism must not cross nodes"),
    ("%%sdp_train --procs-per-node 3 --tp 3\nx = 1", "tp=3 is not a power of two"),
    ("%%sdp_train --nodes 3 --procs-per-node 2 --tp 2 --pp 2\nx = 1",
     "world size 6 is not divisible by tp*pp = 4"),
    ("%%sdp_train --nodes 2 --procs-per-node 2 --tp 2 --pp 2 --microbatches 4 --offload-activations\nx = 1",
     "--offload-activations: this job's layout"),
    ("%%sdp_train --nodes 2 --procs-per-node 2 --tp 2 --pp 2 --microbatches 4 --offload-activations\nx = 1",
     "add --checkpoint-activations layer, or drop --offload-activations"),
    ("%%sdp_train --tp two\nx = 1", "--tp: must be a whole number, got 'two'. Fix: --tp 2"),
    ("%%sdp_train --microbatches 0\nx = 1", "--microbatches: must be 1 or more, got 0"),
    ("%%sdp_train --shard-optimizer zero3\nx = 1",
     "--shard-optimizer: 'zero3' is not one of none, optimizer, gradients, full"),
    ("%%sdp_train --checkpoint-activations all\nx = 1",
     "--checkpoint-activations: 'all' is not one of none, selective, layer"),
    ("%%sdp_train --pp 2 --nodes 2 --pipeline-schedule zigzag\nx = 1",
     "--pipeline-schedule: 'zigzag' is not one of 1f1b, gpipe, interleaved"),
    ("%%sdp_train --nodes 2 --pp 2 --virtual-stages 2\nx = 1",
     "--virtual-stages: 2 chunks per rank need the interleaved schedule"),
    ("%%sdp_train --procs-per-node 2 --tp 2 --env SDP_TP=2\nx = 1", "--env: SDP_TP is set by the hybrid-parallel"),
    ("%%sdp_train --tp\nx = 1", "--tp: expected one argument"),
])
def test_bad_input_is_one_clear_error_and_launches_nothing(ip, jobs_dir, cell, fragment):
    import threading

    ip.user_ns["lk"] = threading.Lock()
    _, error = run(ip, cell)
    assert isinstance(error, UsageError), error
    assert fragment in str(error) and "Nothing was launched" in str(error)
    assert list(jobs_dir.iterdir()) == []


def test_target_sagemaker_dispatches_or_says_not_available(ip, monkeypatch):
    import importlib.util

    import sdp_jupyter.launch as launching

    if importlib.util.find_spec("sdp_jupyter.launch.targets.sagemaker") is None:
        _, error = run(ip, "%%sdp_train --target sagemaker\nx = 1")
        assert "sagemaker is not available yet" in str(error)
    seen = {}

    class FakeSageMaker:
        def start(self, spec, push=None):
            seen["spec"] = spec
            raise launching.SpecError("--target", "fake SageMaker launcher reached")

    from sdp_jupyter.launch.kernel import api  # where launch() finds a target's launcher

    real = api.get_launcher
    monkeypatch.setattr(api, "get_launcher", lambda t: FakeSageMaker() if t == "sagemaker" else real(t))
    _, error = run(ip, "%%sdp_train --target sagemaker --nodes 2\nx = 1")
    assert "fake SageMaker launcher reached" in str(error) and seen["spec"].nodes == 2


@pytest.mark.slow
def test_wait_push_result_and_output(ip, capsys):
    ip.user_ns["X"] = [1, 2, 3]
    _, error = run(ip, textwrap.dedent("""\
        %%sdp_train --nodes 2 --backend gloo --wait --push X --result out --name w1 --hp lr=0.5 --args "--tag a"
        import os, sys
        print("rank", os.environ["RANK"], sys.argv[1:], sum(X))
        {"rank": int(os.environ["RANK"]), "total": sum(X) * 10}
    """))
    assert error is None
    shown = capsys.readouterr().out
    assert "rank 0 ['--tag', 'a', '--lr', '0.5'] 6" in shown
    assert "rank 1" not in shown  # --ranks-output 0 (default): only rank 0 is shown...
    assert "rank 1 ['--tag', 'a', '--lr', '0.5'] 6" in Job.open("w1").logs(1)  # ...all are on disk
    assert "Job w1: succeeded" in shown
    assert ip.user_ns["out"] == {"rank": 0, "total": 60}

    _, error = run(ip, "%%sdp_train --nodes 2 --backend gloo --wait --ranks-output all\nimport os\nprint('hi', os.environ['RANK'])")
    shown = capsys.readouterr().out
    assert error is None and "[rank 0] hi 0" in shown and "[rank 1] hi 1" in shown


@pytest.mark.slow
def test_hybrid_parallel_options_reach_every_worker(ip, capsys):
    _, error = run(ip, textwrap.dedent("""\
        %%sdp_train --nodes 2 --procs-per-node 2 --tp 2 --pp 2 --microbatches 4 --shard-optimizer --checkpoint-activations --offload-activations --backend gloo --wait --ranks-output all --result res
        import os
        from sdp_jupyter.parallel_config import ParallelConfig
        cfg = ParallelConfig.from_env()
        print("cfg", os.environ["RANK"], cfg.describe())
        from sdp_jupyter.parallel_config import ENV_NAMES
        {k: os.environ[k] for k in ENV_NAMES if k in os.environ}
    """))
    assert error is None, error
    shown = capsys.readouterr().out
    described = ("tp=2, pp=2, microbatches=4, schedule=1f1b, sharding=optimizer, checkpointing=layer, "
                 "offload_activations")
    for rank in range(4):
        assert f"[rank {rank}] cfg {rank} {described}" in shown
    assert ip.user_ns["res"] == {
        "SDP_TP": "2", "SDP_PP": "2", "SDP_MICROBATCHES": "4", "SDP_PIPELINE_SCHEDULE": "1f1b",
        "SDP_SHARD_OPTIMIZER": "optimizer", "SDP_CHECKPOINT_ACTIVATIONS": "layer",
        "SDP_OFFLOAD_ACTIVATIONS": "1", "SDP_SEQUENCE_PARALLEL": "1"}


@pytest.mark.slow
def test_failure_raises_with_the_rank_and_the_cells_line_numbers(ip, capsys):
    _, error = run(ip, textwrap.dedent("""\
        %%sdp_train --nodes 2 --backend gloo --wait --name broken
        import os, time
        if os.environ["RANK"] == "1":
            raise ValueError("bad shard")
        time.sleep(60)
    """))
    assert isinstance(error, JobError)
    message = str(error)
    assert message.startswith("job broken failed: rank 1 (node 1, local rank 0) exited with code 1")
    assert 'script.py", line 4' in message  # line 4 of the cell, counting the %%sdp_train line
    assert "ValueError: bad shard" in message
    assert "sdp_jupyter/launch/rank/worker.py" not in message  # the bootstrap's frames are not shown
    rendered = "\n".join(error._render_traceback_())
    assert rendered.startswith("JobError: job broken failed")


@pytest.mark.slow
def test_background_job_jobs_logs_wait_stop(ip, capsys, jobs_dir):
    result, error = run(ip, "%%sdp_train --nodes 2 --backend gloo --name bg --result later\nimport os\nprint('line', os.environ['RANK'])\n41 + 1")
    assert error is None and isinstance(result.result, Job) and result.result.name == "bg"
    run(ip, "%sdp_wait bg")
    assert "Job bg: succeeded" in capsys.readouterr().out
    deadline = time.monotonic() + 10
    while "later" not in ip.user_ns and time.monotonic() < deadline:  # set by the job's done-callback
        time.sleep(0.05)
    assert ip.user_ns["later"] == 42
    run(ip, "%sdp_logs bg --rank 1 --tail 1")
    assert capsys.readouterr().out == "line 1\n"
    _, error = run(ip, "%sdp_logs bg --rank 5")
    assert isinstance(error, UsageError) and "ranks 0..1" in str(error)

    run(ip, "%%sdp_train --nodes 2 --backend gloo --name sleeper\nimport time\nprint('up', flush=True)\ntime.sleep(300)")
    job = Job.open("sleeper")
    while "up" not in job.logs(0):
        time.sleep(0.05)
    _, error = run(ip, "%%sdp_train --backend gloo --name sleeper\nx = 1")
    assert isinstance(error, UsageError) and "job sleeper is still running" in str(error)
    run(ip, "%sdp_jobs")
    table = capsys.readouterr().out
    assert "bg" in table and "sleeper" in table and "running" in table and "this kernel" in table
    run(ip, "%sdp_stop sleeper")
    assert "job sleeper: stopped" in capsys.readouterr().out
    assert wait_no_processes(job.dir) == []
    _, error = run(ip, "%sdp_wait nosuchjob")
    assert isinstance(error, UsageError) and "no job 'nosuchjob'" in str(error)


CTRL_C = """
import signal
# A kernel takes SIGINT as KeyboardInterrupt while a cell runs (ipykernel installs the handler even
# when it was started with SIGINT ignored, as by nohup or CI's background shell); this stand-in
# must do the same, or the suite hangs here when run from such a shell.
signal.signal(signal.SIGINT, signal.default_int_handler)
from IPython.testing.globalipapp import start_ipython
ip = start_ipython()
ip.run_line_magic("load_ext", "sdp_jupyter")
r = ip.run_cell('''%%sdp_train --nodes 2 --backend gloo --wait --name ctrlc
import time
print("up", flush=True)
time.sleep(300)
''')
print("ERROR:", type(r.error_in_exec).__name__, r.error_in_exec, flush=True)
"""


@pytest.mark.slow
def test_ctrl_c_with_wait_stops_the_job(jobs_dir):
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C], stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    for line in proc.stdout:
        if line.strip() == "up" or time.monotonic() > deadline:
            break
    assert len(worker_processes(jobs_dir)) == 2
    proc.send_signal(signal.SIGINT)  # what the kernel gets from Ctrl-C / the stop square
    rest = proc.stdout.read()
    proc.wait(60)
    assert "ERROR: JobError job ctrlc was stopped (Ctrl-C)" in rest
    assert Job.open("ctrlc").state == "stopped"
    assert wait_no_processes(jobs_dir) == []


@pytest.mark.slow
def test_job_view_streams_ranks_and_its_stop_button_stops_the_job(jobs_dir):
    from sdp_jupyter.launch import launch
    from sdp_jupyter.ui.jobview import JobView

    job = launch(code="import os, time\nprint('hello from', os.environ['RANK'], flush=True)\ntime.sleep(300)",
                 nodes=2, backend="gloo", name="viewed")
    view = JobView(job)

    def text(rank):
        return "".join(o.get("text", "") for o in view.outputs[rank].outputs)

    deadline = time.monotonic() + 60
    while "hello from 0" not in text(0) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "hello from 0" in text(0) and "running" in view.header.value and "viewed" in view.header.value
    while "hello from 1" not in job.logs(1):
        time.sleep(0.1)
    assert text(1) == ""  # --ranks-output 0: rank 1 is one click away...
    view.ranks.selected_index = 1
    assert "hello from 1" in text(1)  # ...and filled from its log when opened
    view.stop_button.click()
    assert job.wait(30) == "stopped"
    deadline = time.monotonic() + 5
    while "stopped" not in view.header.value and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "stopped" in view.header.value and view.stop_button.disabled


@pytest.mark.slow
def test_stop_endpoint_needs_the_token_and_stops_a_live_job(jobs_dir):
    import urllib.error
    import urllib.request

    from sdp_jupyter.launch import launch
    from sdp_jupyter.ui.jobview import StopServer

    job = launch(code="import time\nprint('up', flush=True)\ntime.sleep(300)", backend="gloo", name="http-stop")
    server = StopServer.get()
    url = server.url(job)

    def post(u):
        try:
            return urllib.request.urlopen(urllib.request.Request(u, method="POST"), timeout=10).status
        except urllib.error.HTTPError as e:
            return e.code

    assert post(url.replace(server.token, "0" * len(server.token))) == 403
    assert post(url.replace("http-stop", "other-job")) == 404
    while "up" not in job.logs(0):
        time.sleep(0.05)
    assert job.state == "running"
    assert post(url) == 202
    assert job.wait(30) == "stopped"
    assert "interrupted (SIGINT) at" in job.logs(0) and "script.py, line 4" in job.logs(0)  # line 1 is the header


def test_push_of_a_notebook_object_holding_a_lock_is_refused_naming_the_part(ip, jobs_dir):
    # a notebook class goes by value now (tests/launch/test_push.py); what it holds must travel too
    ip.run_cell("import threading\nclass Local:\n    def __init__(self):\n        self.guard = threading.Lock()\n"
                "local_obj = Local()")
    _, error = run(ip, "%%sdp_train --push local_obj\nx = 1")
    assert isinstance(error, UsageError) and "local_obj.guard is a lock" in str(error), error
    assert "Nothing was launched" in str(error)
    assert list(jobs_dir.iterdir()) == []
    ip.user_ns.pop("local_obj")
