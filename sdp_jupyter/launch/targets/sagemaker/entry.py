"""Entry point of an sdp_jupyter job inside a SageMaker training container (uploaded as sdp_entry.py).

The source directory a SageMaker job gets (see SageMakerLauncher) holds this file as
``sdp_entry.py``, the cell as ``script.py``, ``spec.json``, ``push.pkl`` when variables were
pushed, ``requirements.txt`` and sdp_jupyter: a copy of its pure-Python part, or with our engine
(SDP_ENGINE=sdp) the source package ``sdp_jupyter-<version>.tar.gz`` and the job's ``job_secret``.
SageMaker's Torchrun driver starts, on every host,

    torchrun --nnodes=N --nproc_per_node=P [--master_addr=algo-1 --master_port=7777 --node_rank=i] \
        sdp_entry.py --KEY VALUE ...      (the hyperparameters)

and this file then, in each rank:

1. with backend smddp and SDP_ENGINE=aws, imports SageMaker's own `smdistributed.dataparallel`,
   which registers the "smddp" torch.distributed backend; with SDP_ENGINE=sdp (our engine), first
   pip-installs the shipped source package ``sdp_jupyter-<version>.tar.gz`` into the image's Python,
   compiling the engine, once per host (the host's other ranks wait on a lock), then imports
   `sdp_jupyter.torch`; either way it prints which engine serves smddp (ENGINE_LINE);
2. fills the sdp_jupyter variables from SageMaker's (SDP_JOB_DIR under SM_OUTPUT_DATA_DIR, so it
   is uploaded with the job's output; SDP_CHECKPOINT_DIR=/opt/ml/checkpoints, which SageMaker
   syncs with the job's checkpoint S3 URI and restores after a spot interruption; SDP_NUM_NODES),
   after step 1 because only then is sdp_jupyter importable, and the job directory's names are
   sdp_jupyter.jobdir's;
3. records which backend the script's groups really use, and with --init-process-group makes the
   default group with the job's backend first (launch/rank/backend_check.py, as the local worker does);
   then runs script.py as ``__main__`` exactly as the local worker does (both through launch/rank/bootstrap.py) (same argv: --args, then the
   hyperparameters as --KEY VALUE; pushed variables; rank 0's last expression -> result.pkl);
4. echoes every line `sdp_jupyter.report()` writes as a ``[sdp-metrics] {json}`` stdout line,
   which CloudWatch Logs keeps and the notebook parses (sdp_jupyter.monitor.cloudwatch);
5. on an exception, writes its last line to SM_OUTPUT_FAILURE, so the job's FailureReason names
   the rank, its host and the script's error instead of "torchrun exited with 1".
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
#: printed once per host when smddp is loaded; the notebook side reads it (sagemaker.ENGINE_LINE)
ENGINE_LINE = "[sdp_jupyter] smddp engine: "


class EngineInstallError(RuntimeError):
    """Our engine could not be installed in this image; the message names the image and the fix."""


def fill_environment(env=os.environ) -> dict:
    """Set the SDP_* variables a worker reads from the SM_* ones SageMaker provides, make the job
    directory's folders; return the variables. Needs sdp_jupyter importable (main: after the engine)."""
    from sdp_jupyter import jobdir

    out_dir = env.get("SM_OUTPUT_DATA_DIR") or "/opt/ml/output/data"
    try:
        hosts = json.loads(env.get("SM_HOSTS") or "[]")
    except ValueError:
        hosts = []
    values = {
        "SDP_JOB_DIR": os.path.join(out_dir, jobdir.CONTAINER_JOB_DIR),
        "SDP_JOB_NAME": env.get("SDP_JOB_NAME") or env.get("TRAINING_JOB_NAME") or "sagemaker-job",
        "SDP_CHECKPOINT_DIR": env.get("SDP_CHECKPOINT_DIR") or "/opt/ml/checkpoints",
        "SDP_NUM_NODES": str(len(hosts) or 1),
        "SDP_TARGET": "sagemaker",
    }
    env.update(values)
    for sub in (jobdir.METRICS, jobdir.LOGS):
        os.makedirs(os.path.join(values["SDP_JOB_DIR"], sub), exist_ok=True)
    os.makedirs(values["SDP_CHECKPOINT_DIR"], exist_ok=True)
    return values


def _compiler(env=os.environ) -> str | None:
    for name in (env.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name.split()[0]):
            return name
    return None


def _pip_install(sdist: str, env=os.environ) -> str:
    import importlib.util

    image = env.get("SDP_IMAGE_URI") or "this training image"
    if _compiler(env) is None:
        raise EngineInstallError(
            f"the training image {image} has no C++ compiler (looked for $CXX, c++, g++, clang++), and "
            "--engine sdp builds sdp_jupyter's engine in the container when the job starts. Fix: --image-uri "
            "an image with g++ (the AWS PyTorch training images have one; in your own Dockerfile: apt-get "
            "install -y g++), or --engine aws on an instance type SageMaker's smddp library supports "
            "(ml.p4d.24xlarge, ml.p4de.24xlarge)")
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-input", "--disable-pip-version-check"]
    if all(importlib.util.find_spec(m) is not None for m in ("setuptools", "pybind11")):
        cmd.append("--no-build-isolation")  # the image's own build tools: no download needed
    t0 = time.monotonic()
    done = subprocess.run(cmd + [sdist], capture_output=True, text=True)
    if done.returncode != 0:
        output = (done.stdout + done.stderr).strip()
        print(output, file=sys.stderr, flush=True)
        last = output.splitlines()[-1] if output else "no output"
        raise EngineInstallError(
            f"installing sdp_jupyter from {os.path.basename(sdist)} in the training image {image} failed (pip "
            f"exit {done.returncode}: {last}). Fix: an image with pip, a C++17 compiler and Python headers, or "
            "network access for pip's build tools (setuptools, pybind11); or --engine aws")
    return f"built from {os.path.basename(sdist)} in {time.monotonic() - t0:.0f} s"


def install_engine(here: str = HERE, env=os.environ) -> str | None:
    """With SDP_ENGINE=sdp: install the shipped source package into this Python (compiling the
    engine) unless this host did already; return what was done, None when not our engine."""
    if env.get("SDP_BACKEND") != "smddp" or env.get("SDP_ENGINE") != "sdp":
        return None
    secret = os.path.join(here, "job_secret")  # the launcher's per-job secret (sagemaker.SECRET_FILE)
    if not env.get("SDP_JOB_SECRET") and os.path.isfile(secret):
        with open(secret) as f:
            env["SDP_JOB_SECRET"] = f.read().strip()
    sdists = sorted(glob.glob(os.path.join(here, "sdp_jupyter-*.tar.gz")))
    if not sdists:
        raise EngineInstallError(f"--engine sdp: the source directory {here} holds no sdp_jupyter-*.tar.gz "
                                 "(the launcher ships one); resubmit the job")
    with open(sdists[-1], "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:16]
    # One install per Python environment: the ranks of a host (and a rehearsal's hosts, which share
    # one image) take turns on a lock; the first installs, the others find the mark it leaves.
    state = sys.prefix if os.access(sys.prefix, os.W_OK) else tempfile.gettempdir()
    mark = os.path.join(state, f".sdp_jupyter-{digest}")
    failed = f"{mark}-{env.get('TRAINING_JOB_NAME', 'job')}.failed"
    import fcntl

    with open(mark + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if os.path.exists(mark + ".ok"):
            with open(mark + ".ok") as f:
                return f.read().strip() + " (already installed on this host)"
        if os.path.exists(failed):
            with open(failed) as f:
                raise EngineInstallError(f.read().strip())
        try:
            done = _pip_install(sdists[-1], env)
        except EngineInstallError as e:
            with open(failed, "w") as f:
                f.write(str(e))
            raise
        with open(mark + ".ok", "w") as f:
            f.write(done)
    return done


def load_smddp(env=os.environ, installed: str | None = None) -> str | None:
    """Make init_process_group("smddp") work in this image; return who provides it and print it
    (ENGINE_LINE, once per host). `installed`: what install_engine did, for that line."""
    if env.get("SDP_BACKEND") != "smddp":
        return None
    if env.get("SDP_ENGINE") == "sdp":
        import importlib

        importlib.invalidate_caches()  # the package was installed after this interpreter started
        import sdp_jupyter
        import sdp_jupyter.torch  # noqa: F401  registers "smddp" on our engine

        env["SDP_SMDDP_PROVIDER"] = "sdp_jupyter"
        _say_engine(env, f"sdp_jupyter's engine (sdp_jupyter {sdp_jupyter.__version__}, {installed})")
        return "sdp_jupyter"
    try:
        import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  registers "smddp"
    except ImportError as e:
        print("[sdp_jupyter] backend smddp: this image has no SageMaker smdistributed.dataparallel "
              f"library ({e}). Use an image with smddp (the default for --backend smddp is the PyTorch "
              "2.3.0 training image) or run with --backend nccl.", file=sys.stderr, flush=True)
        return None
    env["SDP_SMDDP_PROVIDER"] = "smdistributed"
    _say_engine(env, "SageMaker's smdistributed library")
    return "smdistributed"


def _say_engine(env, what: str) -> None:
    if env.get("LOCAL_RANK", "0") == "0":
        print(ENGINE_LINE + what, flush=True)


class MetricsEcho:
    """Prints each new line of this rank's metrics file as a ``[sdp-metrics]`` stdout line (read
    through jobdir's bounded tailer: an over-long or bad line is skipped, never printed)."""

    def __init__(self, job_dir: str, rank: int, interval: float = 0.5):
        from sdp_jupyter import jobdir
        from sdp_jupyter.monitor.cloudwatch import format_log_line

        # imported here, on the caller's thread: imported first by the echo thread, the package's
        # import of the reporter could be half done when stop() looks the reporter up (a fresh-clone
        # run's "partially initialized module ... has no attribute 'flush'", 1 run in 8 here)
        self._format = format_log_line
        self.tail = jobdir.JsonLinesTail(jobdir.rank_metrics_path(job_dir, rank))
        self.interval = interval
        self.last_t = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="sdp-metrics-echo", daemon=True)

    def start(self) -> "MetricsEcho":
        # the script's lines reach the descriptor whole, a line at a time (see _write_line); also
        # under PYTHONUNBUFFERED, which the training images set and which writes each piece of a
        # print through at once
        reconfigure = getattr(sys.stdout, "reconfigure", None)
        if reconfigure is not None:
            reconfigure(line_buffering=True, write_through=False)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.drain()

    def drain(self) -> None:
        with self._lock:
            for record in self.tail.records():
                _write_line(self._format(record, self.last_t))
                if record.get("kind") == "step" and isinstance(record.get("t"), (int, float)):
                    self.last_t = record["t"]

    def stop(self) -> None:
        self._stop.set()
        reporter = sys.modules.get("sdp_jupyter.monitor.reporter")
        if reporter is not None:
            reporter.flush()  # held automatic step fields
        self.drain()


def _write_line(line: str) -> None:
    """Writes one whole line to stdout with a single write to its descriptor. The echo thread runs
    beside the script, whose `print` writes its text and its newline separately; printing through
    the shared `sys.stdout` could put a metrics line between the two, and CloudWatch's parser would
    then miss it. The script's stdout is line-buffered while the echo runs (`MetricsEcho.start`), so
    its unfinished line waits in its buffer and reaches the descriptor whole, after or before ours."""
    data = (line + "\n").encode()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stdout: no descriptor to share
        print(line, flush=True)
        return
    while data:
        data = data[os.write(fd, data):]


def _write_failure(exc: BaseException, env=os.environ) -> None:
    path = env.get("SM_OUTPUT_FAILURE")
    if not path or not os.path.isdir(os.path.dirname(path)) or os.path.exists(path):
        return
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    rank = env.get("RANK", "?")
    host = f" ({env['SM_CURRENT_HOST']})" if env.get("SM_CURRENT_HOST") else ""
    try:
        with open(path, "w") as f:
            f.write(f"rank {rank}{host} of job {env.get('SDP_JOB_NAME', '?')} failed: {last}")
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    if HERE not in sys.path:
        sys.path.insert(0, HERE)  # the uploaded copy of sdp_jupyter sits next to this file
    try:
        load_smddp(installed=install_engine())  # with our engine, sdp_jupyter is importable from here on
    except EngineInstallError as e:
        print(f"[sdp_jupyter] {e}", file=sys.stderr, flush=True)
        _write_failure(e)
        return 1
    values = fill_environment()
    from sdp_jupyter import jobdir
    from sdp_jupyter.launch.rank import bootstrap
    bootstrap.arm_crash_report()
    # the code channel holds the job directory's script, spec and pushed variables under their names
    with open(os.path.join(HERE, jobdir.SPEC)) as f:
        spec = json.load(f)
    push = bootstrap.load_push(os.path.join(HERE, jobdir.PUSH), checked=False)
    rank = int(os.environ.get("RANK", "0"))
    args = [str(a) for a in spec.get("args") or []]
    args += list(sys.argv[1:] if argv is None else argv)  # the hyperparameters, from the driver
    echo = MetricsEcho(values["SDP_JOB_DIR"], rank).start()
    if bootstrap.watch_backend(spec, bootstrap.job_backend(spec)):
        echo.stop()
        _write_failure(RuntimeError("--init-process-group: init_process_group failed (see the rank's log)"))
        return 1
    try:
        value = bootstrap.run_script(os.path.join(HERE, jobdir.SCRIPT), args, push, want_result=rank == 0)
    except SystemExit as e:
        echo.stop()
        bootstrap.finish_distributed()
        if e.code not in (None, 0):
            _write_failure(e)
        raise
    except BaseException as e:
        echo.stop()
        traceback.print_exception(type(e), e, bootstrap.user_frames(e.__traceback__, __file__))
        sys.stderr.flush()
        _write_failure(e)
        return 1
    echo.stop()
    code = 0
    if rank == 0 and value is not None:
        code = bootstrap.save_result(values["SDP_JOB_DIR"], value, required=bool(spec.get("result")))
    bootstrap.finish_distributed()
    return code


if __name__ == "__main__":
    sys.exit(main())
