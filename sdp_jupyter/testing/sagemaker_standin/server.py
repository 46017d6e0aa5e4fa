"""The AWS half of the stand-in: a moto server on 127.0.0.1 with fake credentials, moto patched
where it differs from the SageMaker service (`patch_moto`), and `MotoAWS`, what a test or the
SageMaker player does in the service's place (move a job's status, write its hosts' log lines and
instance metrics). Needs moto[server] and boto3 (the extra ``sdp_jupyter[rehearse]``)."""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

from sdp_jupyter._net import free_port

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

