"""A local stand-in for AWS and SageMaker: a moto server on 127.0.0.1 plus a thread that plays
SageMaker by running each training job's hosts on this machine (docs/sagemaker.md, "Without AWS").

Needs the optional extra ``sdp_jupyter[rehearse]`` (moto[server], boto3) and, for the launcher
itself, ``sdp_jupyter[sagemaker]``.

- `moto_aws(workdir)`: a `ThreadedMotoServer` on a free 127.0.0.1 port with fake credentials;
  AWS_ENDPOINT_URL points every AWS client (ours and the SDK's) at it. Nothing reaches AWS.
- `SageMakerStandIn(aws, workdir)`: for every CreateTrainingJob the server receives, downloads the
  job's `code` and `sm_drivers` channels from (moto's) S3 as uploaded, computes each host's
  environment with SageMaker's own `sm_drivers/scripts/environment.py` (SM_HOSTS, SM_CURRENT_HOST,
  SM_CHANNEL_*, ...; /opt/ml mapped under `workdir`), starts SageMaker's own `torchrun_driver.py`
  once per host, writes each host's output into moto's CloudWatch Logs, uploads output.tar.gz and
  ends the job Completed or Failed (FailureReason from the failure file), as the service does.
- `start(workdir=None)`: both at once, with the bucket `BUCKET` made (what notebook 04 uses when no
  AWS credentials are found); `close()` undoes it.

moto differs from the service in three ways this module patches (`patch_moto`): it has no
StopTrainingJob, it marks a job Completed at once, and it keeps neither Environment nor
MetricDefinitions (`MotoAWS.create_requests` keeps the bodies as sent).

What the stand-in cannot show: IAM, quotas, capacity, image pulls, the real image's packages, EFA.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

from sdp_jupyter.launch.process import free_port

ACCOUNT = "123456789012"
REGION = "us-west-2"
ROLE = f"arn:aws:iam::{ACCOUNT}:role/SageMakerTestRole"
BUCKET = "sdp-test-bucket"
LOG_GROUP = "/aws/sagemaker/TrainingJobs"
METRIC_NAMESPACE = "/aws/sagemaker/TrainingJobs"


def _telemetry_opt_out_file(directory: str) -> str:
    path = os.path.join(directory, "sagemaker_config.yaml")
    with open(path, "w") as f:
        f.write("SchemaVersion: '1.0'\nSageMaker:\n  PythonSDK:\n    Modules:\n      TelemetryOptOut: true\n")
    return path


def aws_environment(endpoint: str, config_dir: str) -> dict:
    """The variables that point every AWS client (ours and the ones the SDK builds) at moto."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": "testing",
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_MAX_ATTEMPTS": "1",
        "AWS_RETRY_MODE": "standard",
        "AWS_EC2_METADATA_DISABLED": "true",
        "SAGEMAKER_VALIDATE_ROLE": "false",
        "SAGEMAKER_USER_CONFIG_OVERRIDE": _telemetry_opt_out_file(config_dir),
    }


_patch_lock = threading.Lock()
_patched = False


def patch_moto() -> None:
    """Make moto's SageMaker behave like the service where the stand-in needs it: a StopTrainingJob
    (moto answers HTTP 500), jobs that start InProgress/Starting (moto completes them at once), and
    every CreateTrainingJob body recorded as it came over the wire (moto keeps neither Environment
    nor MetricDefinitions). Patches moto's classes in this process, once."""
    global _patched
    with _patch_lock:
        if _patched:
            return
        from moto.core.responses import EmptyResult
        from moto.sagemaker.exceptions import ValidationError
        from moto.sagemaker.models import FakeTrainingJob
        from moto.sagemaker.responses import SageMakerResponse

        def stop_training_job(self):
            name = self._get_param("TrainingJobName")
            jobs = self.sagemaker_backend.training_jobs
            if name not in jobs:
                arn = FakeTrainingJob.arn_formatter(name, self.current_account, self.region)
                raise ValidationError(message=f"Could not find training job '{arn}'.")
            job = jobs[name]
            if job.training_job_status != "InProgress":
                raise ValidationError(
                    message=f"The request was rejected because the training job is in status "
                    f"{job.training_job_status}.")
            job.training_job_status = "Stopping"
            job.secondary_status = "Stopping"
            _transition(job, "Stopping", "Stopping the training job")
            return EmptyResult()

        SageMakerResponse.stop_training_job = stop_training_job

        original_create = SageMakerResponse.create_training_job

        def create_training_job(self):
            MotoAWS.create_requests.append(json.loads(self.body))
            result = original_create(self)
            # moto marks a job Completed at once; the service starts it InProgress / Starting,
            # and the test (playing SageMaker) moves it on from there
            _start(self.sagemaker_backend.training_jobs[self._get_param("TrainingJobName")])
            return result

        SageMakerResponse.create_training_job = create_training_job
        _patched = True


def _start(job) -> None:
    job.training_job_status = "InProgress"
    job.secondary_status = "Starting"
    job.training_end_time = None
    job.final_metric_data_list = []


def _transition(job, status: str, message: str) -> None:
    from moto.core.utils import utcnow

    now = utcnow()
    transitions = job.secondary_status_transitions
    if transitions and "EndTime" not in transitions[-1]:
        transitions[-1]["EndTime"] = now
    transitions.append({"Status": status, "StartTime": now, "StatusMessage": message})


@dataclass
class MotoAWS:
    """The running server and what a test does in SageMaker's place."""

    endpoint: str
    env: dict
    server: object = None

    # bodies of every CreateTrainingJob that reached the server, newest last (filled by the patch)
    create_requests: ClassVar[list] = []

    region_name: ClassVar[str] = REGION

    def client(self, service: str):
        """A client of the local server (so a MotoAWS serves where a boto3 Session is expected)."""
        import boto3

        return boto3.client(service, region_name=REGION, endpoint_url=self.endpoint,
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    def make_bucket(self, bucket: str):
        """Create `bucket` unless it exists; return an S3 client."""
        s3 = self.client("s3")
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou, s3.exceptions.BucketAlreadyExists):
            s3.create_bucket(Bucket=bucket, CreateBucketConfiguration={"LocationConstraint": REGION})
        return s3

    def serve_folder(self, uri: str, folder) -> int:
        """Upload every file under the local `folder` to the s3:// prefix `uri` (its bucket made
        when missing); return the number of files."""
        from pathlib import Path

        bucket, _, prefix = uri[len("s3://"):].partition("/")
        s3 = self.make_bucket(bucket)
        root = Path(folder)
        files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in files:
            rel = path.name if path == root else path.relative_to(root).as_posix()
            s3.upload_file(str(path), bucket, f"{prefix.rstrip('/')}/{rel}".lstrip("/"))
        return len(files)

    # ---------------------------------------------------------------- playing SageMaker
    def _job(self, name: str):
        from moto.sagemaker.models import sagemaker_backends

        return sagemaker_backends[ACCOUNT][REGION].training_jobs[name]

    def set_status(self, name: str, status: str, secondary: str | None = None,
                   failure_reason: str | None = None, message: str | None = None) -> None:
        """Move a training job the way the service would (status, secondary status, reason)."""
        from moto.core.utils import utcnow

        job = self._job(name)
        job.training_job_status = status
        secondary = secondary or {"InProgress": "Starting", "Completed": "Completed",
                                  "Failed": "Failed", "Stopped": "Stopped",
                                  "Stopping": "Stopping"}[status]
        if secondary != job.secondary_status:
            job.secondary_status = secondary
            _transition(job, secondary, message or f"{secondary}")
        if failure_reason is not None:
            job.failure_reason = failure_reason
        if status in ("Completed", "Failed", "Stopped"):
            job.training_end_time = utcnow()
            last = job.secondary_status_transitions[-1]
            last.setdefault("EndTime", job.training_end_time)
        job.last_modified_time = utcnow()

    def status(self, name: str) -> str:
        return self._job(name).training_job_status

    def put_log_lines(self, job_name: str, host: int, lines: list[str], t0: float | None = None) -> str:
        """Write lines to the host's stream `<job>/algo-<host>-<epoch>`, as the container would."""
        logs = self.client("logs")
        with contextlib.suppress(logs.exceptions.ResourceAlreadyExistsException):
            logs.create_log_group(logGroupName=LOG_GROUP)
        prefix = f"{job_name}/algo-{host}-"
        found = logs.describe_log_streams(logGroupName=LOG_GROUP, logStreamNamePrefix=prefix)["logStreams"]
        stream = found[0]["logStreamName"] if found else f"{prefix}{int(time.time())}"
        if not found:
            logs.create_log_stream(logGroupName=LOG_GROUP, logStreamName=stream)
        start = int((t0 if t0 is not None else time.time()) * 1000)
        events = [{"timestamp": start + i, "message": line} for i, line in enumerate(lines)]
        if events:
            logs.put_log_events(logGroupName=LOG_GROUP, logStreamName=stream, logEvents=events)
        return stream

    def put_host_metric(self, job_name: str, host: int, metric: str, value: float,
                        t: float | None = None) -> None:
        """A SageMaker instance metric (0-100 x devices) for `<job>/algo-<host>` at 1-minute resolution."""
        import datetime

        ts = datetime.datetime.fromtimestamp(t if t is not None else time.time(), datetime.timezone.utc)
        self.client("cloudwatch").put_metric_data(
            Namespace=METRIC_NAMESPACE,
            MetricData=[{"MetricName": metric, "Value": float(value), "Timestamp": ts, "Unit": "Percent",
                         "Dimensions": [{"Name": "Host", "Value": f"{job_name}/algo-{host}"}]}],
        )


# ------------------------------------------------------------------------------------------------
# The training container, run here: SageMaker's own driver on the job's uploaded channels
# ------------------------------------------------------------------------------------------------
def download_channel(aws: MotoAWS, uri: str, dest) -> None:
    """Copy every object under an s3:// prefix (from moto) into the folder `dest`."""
    from pathlib import Path

    bucket, _, prefix = uri[len("s3://"):].partition("/")
    s3 = aws.client("s3")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        for obj in page.get("Contents", []):
            target = Path(dest) / obj["Key"][len(prefix) + 1:]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(target))


_SET_ENV = r"""
import json, os, sys
drivers, out, config = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
sys.path.insert(0, os.path.join(drivers, "scripts"))
import environment  # SageMaker's own: sm_drivers/scripts/environment.py
# it reads these two from /opt/ml/input/data/sm_drivers; ours are under the test's tmp dir
environment.read_source_code_json = lambda: json.load(open(os.path.join(drivers, "sourcecode.json")))
environment.read_distributed_json = lambda: json.load(open(os.path.join(drivers, "distributed.json")))
environment.set_env(config["resource"], config["channels"], config["hyperparameters"], output_file=out)
"""


def container_env(drivers, host: int, hosts: int, request: dict, root, port: int, python: str | None = None) -> dict:
    """The environment of host `host` (1-based) as SageMaker's environment.py computes it; /opt/ml is
    `root`/opt/ml and algo-1 (SM_MASTER_ADDR) is 127.0.0.1:`port` (the only differences). `python`:
    the image's interpreter (its folder goes first on PATH, for torchrun), default this one."""
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    root = Path(root)
    resource = {"current_host": f"algo-{host}", "current_instance_type": request["ResourceConfig"]["InstanceType"],
                "hosts": [f"algo-{h}" for h in range(1, hosts + 1)], "network_interface_name": "lo"}
    channels = {c["ChannelName"]: {"TrainingInputMode": "File"} for c in request.get("InputDataConfig", [])}
    root.mkdir(parents=True, exist_ok=True)
    out = root / "sm_training.env"
    config = {"resource": resource, "channels": channels, "hyperparameters": request.get("HyperParameters", {})}
    done = subprocess.run([sys.executable, "-c", _SET_ENV, str(drivers), str(out), json.dumps(config)],
                          env={**os.environ, "TRAINING_JOB_NAME": request["TrainingJobName"]},
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "SDP_", "SM_", "JPY_"))}
    env.pop("PYTHONPATH", None)  # the job must find sdp_jupyter in its own source directory
    env.update(request.get("Environment", {}))
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
        "PATH": f"{Path(python or sys.executable).parent}:{env.get('PATH', '')}",  # the image's torchrun
    })
    for sub in ("model", "output/data", "checkpoints"):
        (opt_ml / sub).mkdir(parents=True, exist_ok=True)
    for name in channels:
        (opt_ml / "input" / "data" / name).mkdir(parents=True, exist_ok=True)
    return env


class LocalContainers:
    """Runs one training job's hosts here, the way SageMaker runs them: the `code` and `sm_drivers`
    channels downloaded from (moto's) S3 as uploaded, every other S3 channel downloaded too, and
    SageMaker's own torchrun_driver.py per host with cwd /opt/ml/input/data/code."""

    def __init__(self, aws: MotoAWS, request: dict, workdir, python: str | None = None):
        import sys
        from pathlib import Path

        self.aws = aws
        self.python = python or sys.executable  # the image's Python
        self.request = request
        self.name = request["TrainingJobName"]
        self.hosts = int(request["ResourceConfig"]["InstanceCount"])
        self.workdir = Path(workdir) / self.name
        self.procs = []

    def prepare(self) -> None:
        uris = {c["ChannelName"]: c["DataSource"]["S3DataSource"]["S3Uri"]
                for c in self.request.get("InputDataConfig", [])}
        self.code, self.drivers = self.workdir / "image" / "code", self.workdir / "image" / "sm_drivers"
        download_channel(self.aws, uris.pop("code"), self.code)
        download_channel(self.aws, uris.pop("sm_drivers"), self.drivers)
        port = free_port()
        self.envs = []
        for host in range(1, self.hosts + 1):
            root = self.workdir / f"algo-{host}"
            env = container_env(self.drivers, host, self.hosts, self.request, root, port, self.python)
            for channel, uri in uris.items():
                download_channel(self.aws, uri, env[f"SM_CHANNEL_{channel.upper()}"])
            if self.checkpoint_uri:  # SageMaker restores the checkpoint URI into every host's LocalPath
                download_channel(self.aws, self.checkpoint_uri, self.checkpoint_dir(env))
            self.envs.append(env)

    @property
    def checkpoint_uri(self) -> str | None:
        return (self.request.get("CheckpointConfig") or {}).get("S3Uri")

    def checkpoint_dir(self, env: dict) -> str:
        local = (self.request.get("CheckpointConfig") or {}).get("LocalPath", "/opt/ml/checkpoints")
        return env["SM_MODEL_DIR"][:-len("/model")] + local[len("/opt/ml"):]

    def sync_checkpoints(self) -> None:
        """What SageMaker does during training: every host's LocalPath is uploaded to the URI."""
        from pathlib import Path

        bucket, _, prefix = self.checkpoint_uri[len("s3://"):].partition("/")
        for env in self.envs:
            root = Path(self.checkpoint_dir(env))
            for path in sorted(p for p in root.rglob("*") if p.is_file()):
                self.aws.client("s3").upload_file(str(path), bucket, f"{prefix}/{path.relative_to(root)}")

    def start(self) -> None:
        import subprocess

        for env in self.envs:
            self.procs.append(subprocess.Popen(
                [self.python, str(self.drivers / "distributed_drivers" / "torchrun_driver.py")],
                cwd=self.code, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True))

    def kill(self) -> None:
        import signal

        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


class SageMakerStandIn:
    """Plays SageMaker for every training job created on the moto server: runs its hosts here
    (LocalContainers), streams each host's output into its CloudWatch log stream as it comes,
    publishes the hosts' CPU utilisation, uploads output.tar.gz from algo-1's /opt/ml/output/data,
    and ends the job Completed, or Failed with the failure file as FailureReason. One job at a
    time."""

    def __init__(self, aws: MotoAWS, workdir):
        self.aws = aws
        self.workdir = workdir
        # per job (Environment SDP_JOB_NAME): {"workdir": where its /opt/ml trees go,
        # "pythonpath": prepended on every host (the image's packages), "python": the image's
        # interpreter, "env": the image's own variables}; see `expect`
        self.jobs: dict[str, dict] = {}
        self.seen = len(MotoAWS.create_requests)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sagemaker-stand-in", daemon=True)
        self.errors: list[str] = []

    def start(self) -> "SageMakerStandIn":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def expect(self, job_name: str, workdir=None, pythonpath: str | None = None, python: str | None = None,
               env: dict | None = None) -> None:
        """Where the hosts of the next job named `job_name` (its SDP_JOB_NAME) run, what they import,
        which Python runs them (default: this process's; see `image_without`) and what the image's
        environment adds (`env`)."""
        self.jobs[job_name] = {"workdir": workdir, "pythonpath": pythonpath, "python": python, "env": env}

    def _loop(self) -> None:
        while not self._stop.wait(0.2):
            while self.seen < len(MotoAWS.create_requests):
                request = MotoAWS.create_requests[self.seen]
                self.seen += 1
                try:
                    self.run(request)
                except Exception as e:  # shown by whoever owns the stand-in (`errors`)
                    self.errors.append(f"{request.get('TrainingJobName')}: {type(e).__name__}: {e}")

    def run(self, request: dict) -> None:
        import io
        import tarfile

        name = request["TrainingJobName"]
        options = self.jobs.pop((request.get("Environment") or {}).get("SDP_JOB_NAME"), None) or {}
        self.aws.set_status(name, "InProgress", "Downloading", message="Downloading the training image")
        containers = LocalContainers(self.aws, request, options.get("workdir") or self.workdir,
                                     python=options.get("python"))
        containers.prepare()
        for env in containers.envs:
            env.update(options.get("env") or {})
            if options.get("pythonpath"):
                env["PYTHONPATH"] = options["pythonpath"]
        self.aws.set_status(name, "InProgress", "Training",
                            message="Training image download completed. Training in progress.")
        containers.start()
        readers = [threading.Thread(target=self._pipe, args=(name, h + 1, p), daemon=True)
                   for h, p in enumerate(containers.procs)]
        for r in readers:
            r.start()
        codes, failed = [], []  # failed: hosts (0-based) in the order their algorithm failed
        try:
            while True:
                failed += [h for h, p in enumerate(containers.procs) if p.poll() not in (None, 0) and h not in failed]
                if failed or all(p.poll() is not None for p in containers.procs):
                    break  # SageMaker ends the job when one host's algorithm fails
                if self._stop.is_set() or self.aws.status(name) in ("Stopping", "Stopped"):
                    break
                time.sleep(0.2)
        finally:
            containers.kill()
            for r in readers:
                r.join(timeout=10)
            codes = [p.returncode for p in containers.procs]
        for host in range(1, containers.hosts + 1):
            self.aws.put_host_metric(name, host, "CPUUtilization", 100.0)
        if self.aws.status(name) in ("Stopping", "Stopped"):
            self.aws.set_status(name, "Stopped")
            return
        self.aws.set_status(name, "InProgress", "Uploading", message="Uploading generated training model")
        data = containers.workdir / "algo-1" / "opt" / "ml" / "output" / "data"
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(str(data), arcname=".")
        root = request["OutputDataConfig"]["S3OutputPath"][len("s3://"):].rstrip("/")
        bucket, _, prefix = root.partition("/")
        key = f"{prefix}/{name}/output/output.tar.gz".lstrip("/")
        self.aws.client("s3").put_object(Bucket=bucket, Key=key, Body=buf.getvalue())
        if all(c == 0 for c in codes):
            self.aws.set_status(name, "Completed")
            return
        reason = "AlgorithmError: the training script failed"
        # the first failure: the earliest failure file (a host's peers fail after it, e.g. gloo's
        # "connection closed"), else the host whose algorithm was seen failing first
        order = failed + [h for h in range(containers.hosts) if h not in failed]
        written = [(os.path.getmtime(f), order.index(h), f) for h, f in
                   ((h, env.get("SM_OUTPUT_FAILURE")) for h, env in enumerate(containers.envs))
                   if f and os.path.exists(f)]
        if written:
            with open(min(written)[2]) as f:
                reason = f"AlgorithmError: {f.read().strip()}"
        self.aws.set_status(name, "Failed", failure_reason=reason)

    def _pipe(self, name: str, host: int, proc) -> None:
        for line in proc.stdout:
            if line.strip():  # CloudWatch Logs takes no empty events
                self.aws.put_log_lines(name, host, [line.rstrip("\n")])


def image_without(package: str, root) -> str:
    """A training "image" for the rehearsal's hosts: a virtual environment at `root` that sees every
    package of this Python except `package` (each linked from one folder a .pth file names), with
    a `torchrun`; return its interpreter. Made once per `root`: what is installed into it stays, as
    in an image reused for the next job. This is how a rehearsal with --engine sdp checks that the
    shipped source package installs and its engine builds, without downloading torch."""
    import site
    import subprocess
    import sys
    from pathlib import Path

    root = Path(root)
    python = root / "bin" / "python"
    if python.exists():
        return str(python)
    base = getattr(sys, "_base_executable", None) or sys.executable
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True, capture_output=True)
    own = root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    linked = root / "image-packages"
    linked.mkdir(exist_ok=True)
    name = package.replace("-", "_").lower()
    for folder in site.getsitepackages():
        if not os.path.isdir(folder) or Path(folder).resolve() == own.resolve():
            continue
        for entry in Path(folder).iterdir():
            lower = entry.name.lower()
            if name in lower or lower.endswith(".pth") or lower == "__pycache__" or (linked / entry.name).exists():
                continue  # the package itself, its editable finder and .pth hooks
            (linked / entry.name).symlink_to(entry)
    (own / "image-packages.pth").write_text(f"{linked}\n")
    torchrun = root / "bin" / "torchrun"
    torchrun.write_text(f"#!{python}\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n")
    torchrun.chmod(0o755)
    return str(python)


@contextlib.contextmanager
def pointed_at(env: dict):
    """Point this process's environment at the stand-in (`MotoAWS.env`) for the block, then restore it."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def moto_aws(tmp_dir: str, set_environ: bool = True):
    """Start moto on a free 127.0.0.1 port, create the bucket and, with `set_environ`, point this
    process's environment at it (fake credentials, AWS_ENDPOINT_URL); undo all of it on exit."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.CRITICAL)  # moto's request log and 501 tracebacks
    patch_moto()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        aws = MotoAWS(endpoint=endpoint, env=aws_environment(endpoint, tmp_dir), server=server)
        MotoAWS.create_requests.clear()
        aws.client("s3").create_bucket(Bucket=BUCKET,
                                       CreateBucketConfiguration={"LocationConstraint": REGION})
        with pointed_at(aws.env) if set_environ else contextlib.nullcontext():
            yield aws
    finally:
        server.stop()
        from moto.backends import get_backend

        for service in ("sagemaker", "logs", "cloudwatch", "s3"):
            with contextlib.suppress(Exception):
                get_backend(service).reset()


@dataclass
class LocalSageMaker:
    """A running stand-in (`start`): `aws` (the moto server), `stand_in` (the SageMaker player),
    `bucket` and `role` to pass as --bucket and --role."""

    aws: MotoAWS
    stand_in: "SageMakerStandIn"
    workdir: str
    _context: object
    bucket: str = BUCKET
    role: str = ROLE

    @property
    def endpoint(self) -> str:
        return self.aws.endpoint

    def close(self) -> None:
        """Stop the stand-in and the server, restore the environment; raise if the stand-in failed."""
        global _running
        with _running_lock:
            if _running is self:
                _running = None
        self.stand_in.stop()
        self._context.__exit__(None, None, None)
        if self.stand_in.errors:
            raise RuntimeError("the SageMaker stand-in failed: " + "; ".join(self.stand_in.errors))


# moto's backends are per process, so one stand-in per process plays SageMaker for every server
_running: LocalSageMaker | None = None
_running_lock = threading.RLock()


def start(workdir: str | None = None, set_environ: bool = True) -> LocalSageMaker:
    """Start moto and the SageMaker stand-in in this process; with `set_environ` (default) the
    process's environment then points at it. One at a time: the one already running is returned
    when it serves the same way (a notebook cell run twice), else close() it first."""
    import tempfile

    global _running
    with _running_lock:
        if _running is not None and _running.stand_in.alive and \
                (os.environ.get("AWS_ENDPOINT_URL") == _running.endpoint) == set_environ:
            return _running
        if _running is not None:
            raise RuntimeError(f"a SageMaker stand-in already runs in this process at {_running.endpoint}; "
                               "close() it first")
        workdir = workdir or tempfile.mkdtemp(prefix="sdp-sagemaker-standin-")
        context = moto_aws(workdir, set_environ=set_environ)
        aws = context.__enter__()
        try:
            stand_in = SageMakerStandIn(aws, workdir).start()
        except BaseException:
            context.__exit__(None, None, None)
            raise
        _running = LocalSageMaker(aws=aws, stand_in=stand_in, workdir=workdir, _context=context)
        return _running


def shared() -> LocalSageMaker:
    """The stand-in running in this process, else a new one that leaves the environment alone
    (what a rehearsal uses; it lives as long as the process)."""
    with _running_lock:
        if _running is not None and _running.stand_in.alive:
            return _running
        return start(set_environ=False)


def aws_credentials_found() -> bool:
    """Whether boto3 finds AWS credentials (environment, ~/.aws, instance role...)."""
    import boto3

    return boto3.Session().get_credentials() is not None
