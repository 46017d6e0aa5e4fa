"""The SageMaker target's options (SAGEMAKER_OPTIONS -> JobSpec.sagemaker, checked into
SageMakerOptions), its constants, and the request check: each CreateTrainingJob field named with the
option that sets it (SageMakerRequestError), against botocore's service model (validate.py)."""
from __future__ import annotations

import dataclasses
import os
from typing import Any

from sdp_jupyter import jobdir
from sdp_jupyter._env import env_float, parse_bool
from sdp_jupyter.launch.options import Option, SpecError
from sdp_jupyter.launch.targets.sagemaker.validate import check as check_request

OPERATION = "CreateTrainingJob"
SOURCE_DIR = jobdir.SAGEMAKER_SOURCE     # in the job directory: what goes up as the code channel
REQUEST_FILE = jobdir.SAGEMAKER_REQUEST  # in the job directory: the CreateTrainingJob request as sent
ENTRY_SCRIPT = "sdp_entry.py"
SECRET_FILE = "job_secret"  # in the source directory with our engine: the entry's SDP_JOB_SECRET
CONTAINER_CHECKPOINT_DIR = "/opt/ml/checkpoints"
RESERVED_CHANNELS = ("code", "sm_drivers")  # the SDK's own channels
NAME_SUFFIX = len("-20261121233324")        # the SDK appends -%Y%m%d%H%M%S to the base name
MAX_NAME = 63

#: Image with SageMaker's smddp library: the PyTorch 2.3.0 training image (smddp 2.3.0).
SMDDP_FRAMEWORK_VERSION = "2.3.0"
DEFAULT_INSTANCE_TYPES = {"smddp": "ml.p4d.24xlarge", "nccl": "ml.g5.2xlarge", "gloo": "ml.m5.xlarge"}
DEFAULT_MAX_RUN = 24 * 3600
DEFAULT_POLL_INTERVAL = 10.0
METRICS_POLL_INTERVAL = 30.0

#: The options only this target reads (spec.OPTION_PROVIDERS adds them to %%sdp_train and sdp-train);
#: field "sagemaker.<key>" fills JobSpec.sagemaker[<key>].
SAGEMAKER_OPTIONS: tuple[Option, ...] = (
    Option("--instance-type", "sagemaker.instance_type",
           "SageMaker instance type (default: ml.p4d.24xlarge for smddp, ml.g5.2xlarge for nccl, "
           "ml.m5.xlarge for gloo)", metavar="TYPE"),
    Option("--role", "sagemaker.role",
           "IAM role ARN the job runs as (default: the role the SageMaker SDK finds for you)", metavar="ARN"),
    Option("--region", "sagemaker.region", "AWS region (default: the session's, e.g. AWS_DEFAULT_REGION)"),
    Option("--bucket", "sagemaker.bucket",
           "S3 bucket for code, output and checkpoints (default: the SDK's sagemaker-<region>-<account>)"),
    Option("--output-path", "sagemaker.output_path",
           "S3 prefix for output and checkpoints (default: s3://<bucket>)", metavar="S3_URI"),
    Option("--image-uri", "sagemaker.image_uri", "training image (default: the PyTorch training image)",
           metavar="URI"),
    Option("--framework-version", "sagemaker.framework_version",
           f"PyTorch version of the default image (default: {SMDDP_FRAMEWORK_VERSION} when SageMaker's smddp "
           "library serves --backend smddp: --engine aws, or auto on a type it runs on; otherwise, --engine sdp "
           "included, the newest the SDK knows)",
           metavar="VERSION"),
    Option("--input", "sagemaker.inputs", "input channel NAME=s3://... (repeatable); the script finds it "
           "at $SM_CHANNEL_<NAME>", kind="append", metavar="NAME=S3_URI"),
    Option("--spot", "sagemaker.spot", "managed spot training: resumes from SDP_CHECKPOINT_DIR after an "
           "interruption", kind="flag"),
    Option("--max-wait", "sagemaker.max_wait", "spot only: seconds to wait for capacity plus run "
           "(default: 2 x --max-run)", metavar="SECONDS"),
    Option("--max-run", "sagemaker.max_run", "stop the job after this many seconds of training "
           "(default: --timeout, else 86400)", metavar="SECONDS"),
    Option("--volume-size", "sagemaker.volume_size", "GB of storage per instance (default 30)", metavar="GB"),
    Option("--keep-alive", "sagemaker.keep_alive", "seconds to keep the instances warm for the next job "
           "(warm pool, 0-21600; not with --spot)", metavar="SECONDS"),
    Option("--engine", "sagemaker.engine", "who provides --backend smddp: auto (default: SageMaker's smdistributed "
           "library on the types it supports, sdp_jupyter's engine elsewhere), sdp (ours, built in the container "
           "at start; needs a C++ compiler in the image) or aws (SageMaker's; refused on types it does not "
           "support)", metavar="auto|sdp|aws"),
    Option("--rehearse", "sagemaker.rehearse", "rehearse the job here instead of on AWS: the same request and "
           "source directory, checked, then run as SageMaker runs it on --nodes local hosts (free; needs "
           "sdp_jupyter[rehearse], which includes [sagemaker])", kind="flag"),
    Option("--rehearse-data", "sagemaker.rehearse_data", "with --rehearse: serve an input channel's s3:// prefix "
           "from a local folder (repeatable)", kind="append", metavar="S3_URI=FOLDER"),
)

#: CreateTrainingJob field -> the option that sets it (named in validation errors).
FIELD_OPTIONS = {
    "TrainingJobName": "--name",
    "RoleArn": "--role",
    "ResourceConfig.InstanceType": "--instance-type",
    "ResourceConfig.InstanceCount": "--nodes",
    "ResourceConfig.VolumeSizeInGB": "--volume-size",
    "ResourceConfig.KeepAlivePeriodInSeconds": "--keep-alive",
    "StoppingCondition.MaxRuntimeInSeconds": "--max-run",
    "StoppingCondition.MaxWaitTimeInSeconds": "--max-wait",
    "AlgorithmSpecification.TrainingImage": "--image-uri",
    "OutputDataConfig.S3OutputPath": "--output-path",
    "CheckpointConfig.S3Uri": "--output-path",
    "Environment": "--env",
    "HyperParameters": "--hp",
    "InputDataConfig": "--input",
    "RetryStrategy": "--max-restarts",
    "EnableManagedSpotTraining": "--spot",
}


def option_for(field_path: str) -> str | None:
    """The option behind a request field path like ``ResourceConfig.InstanceType`` or ``Environment['X']``."""
    base = field_path.split("[")[0]
    while base:
        if base in FIELD_OPTIONS:
            return FIELD_OPTIONS[base]
        base = base.rpartition(".")[0]
    return None


class SageMakerRequestError(SpecError):
    """The request would be rejected by SageMaker. `problems`: (field path, option or None, message)."""

    def __init__(self, problems: list[tuple[str, str]], when: str = "before sending it"):
        self.problems = [(f, option_for(f), m) for f, m in problems]
        first = next((o for _, o, _ in self.problems if o), None) or self.problems[0][0]
        lines = [f"{f}{f' ({o})' if o else ''}: {m}" for f, o, m in self.problems]
        super().__init__(first, f"SageMaker would reject this {OPERATION} request ({when}):\n  "
                         + "\n  ".join(lines))

    @property
    def fields(self) -> list[str]:
        return [f for f, _, _ in self.problems]


def validate_request(params: dict, *, partial: bool = False, when: str = "before sending it") -> None:
    """Raise SageMakerRequestError naming each field (and its option) the service model rejects."""
    problems = check_request(OPERATION, params, partial=partial)
    if problems:
        raise SageMakerRequestError(problems, when)


_OPTION_KEYS = {opt.field.split(".", 1)[1]: opt.flag for opt in SAGEMAKER_OPTIONS}


def _int_option(key: str, value: Any, minimum: int, example: str) -> int | None:
    if value is None:
        return None
    flag = _OPTION_KEYS[key]
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().isdigit())
                                       or (isinstance(value, float) and value.is_integer())):
        raise SpecError(flag, f"must be a whole number, got {value!r}. Fix: {flag} {example}")
    n = int(value)
    if n < minimum:
        raise SpecError(flag, f"must be {minimum} or more, got {n}. Fix: {flag} {example}")
    return n


@dataclasses.dataclass
class SageMakerOptions:
    """JobSpec.sagemaker, checked. Values not given stay None and get defaults in `resolve`."""

    instance_type: str | None = None
    role: str | None = None
    region: str | None = None
    bucket: str | None = None
    output_path: str | None = None
    image_uri: str | None = None
    framework_version: str | None = None
    inputs: dict = dataclasses.field(default_factory=dict)
    spot: bool = False
    max_wait: int | None = None
    max_run: int | None = None
    volume_size: int | None = None
    keep_alive: int | None = None
    engine: str = "auto"
    rehearse: bool = False
    rehearse_data: dict = dataclasses.field(default_factory=dict)  # s3:// prefix -> local folder
    poll_interval: float = dataclasses.field(
        default_factory=lambda: env_float("SDP_SAGEMAKER_POLL_INTERVAL", DEFAULT_POLL_INTERVAL, min=0.01))

    @classmethod
    def from_dict(cls, data: dict | None) -> "SageMakerOptions":
        data = dict(data or {})
        unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise SpecError("sagemaker", f"unknown SageMaker option(s) {', '.join(unknown)}; known: "
                                         f"{', '.join(sorted(_OPTION_KEYS))}")
        opts = cls(**data)
        opts.max_wait = _int_option("max_wait", opts.max_wait, 1, "7200")
        opts.max_run = _int_option("max_run", opts.max_run, 1, "3600")
        opts.volume_size = _int_option("volume_size", opts.volume_size, 1, "100")
        opts.keep_alive = _int_option("keep_alive", opts.keep_alive, 0, "1800")
        for key in ("spot", "rehearse"):
            value = getattr(opts, key)
            if not isinstance(value, bool):
                try:
                    setattr(opts, key, parse_bool(value, _OPTION_KEYS[key]))
                except ValueError:
                    raise SpecError(_OPTION_KEYS[key], f"is a flag (true/false), got {value!r}") from None
        for key in ("instance_type", "role", "region", "bucket", "output_path", "image_uri", "framework_version"):
            value = getattr(opts, key)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise SpecError(_OPTION_KEYS[key], f"must be a non-empty string, got {value!r}")
        if opts.bucket is not None and opts.bucket.startswith("s3://"):
            raise SpecError("--bucket", f"give the bucket name only, not a URI ({opts.bucket!r}); "
                                        "for a prefix use --output-path s3://bucket/prefix")
        if opts.output_path is not None and not opts.output_path.startswith("s3://"):
            raise SpecError("--output-path", f"must be an S3 URI like s3://my-bucket/prefix, got {opts.output_path!r}")
        from sdp_jupyter.instances import ENGINES

        if opts.engine is None:
            opts.engine = "auto"
        if opts.engine not in ENGINES:
            raise SpecError("--engine", f"must be one of {', '.join(ENGINES)}, got {opts.engine!r}")
        opts.inputs = _parse_inputs(opts.inputs)
        opts.rehearse_data = _parse_rehearse_data(opts.rehearse_data)
        if opts.rehearse_data and not opts.rehearse:
            raise SpecError("--rehearse-data", "serves data to a rehearsal only. Fix: add --rehearse, or drop "
                                               "--rehearse-data")
        if opts.max_wait is not None and not opts.spot:
            raise SpecError("--max-wait", "applies to managed spot training only. Fix: add --spot, or drop --max-wait")
        if opts.spot and opts.keep_alive:
            raise SpecError("--keep-alive", "SageMaker warm pools cannot be used with managed spot training. "
                                            "Fix: drop --keep-alive or --spot")
        try:
            opts.poll_interval = float(opts.poll_interval)
        except (TypeError, ValueError):
            raise SpecError("sagemaker", f"poll_interval must be seconds, got {opts.poll_interval!r}") from None
        return opts


def _parse_inputs(items) -> dict:
    if not items:
        return {}
    if isinstance(items, dict):
        pairs = list(items.items())
    else:
        pairs = []
        for item in items if isinstance(items, (list, tuple)) else [items]:
            if not isinstance(item, str) or "=" not in item:
                raise SpecError("--input", f"expected NAME=s3://bucket/prefix, got {item!r}. "
                                           "Fix: --input train=s3://my-bucket/data/train")
            name, _, uri = item.partition("=")
            pairs.append((name.strip(), uri.strip()))
    out = {}
    for name, uri in pairs:
        if name in RESERVED_CHANNELS:
            raise SpecError("--input", f"channel name {name!r} is used by the SageMaker SDK itself "
                                       f"({', '.join(RESERVED_CHANNELS)}); choose another, e.g. --input train=...")
        if not isinstance(uri, str) or not (uri.startswith("s3://") or os.path.exists(uri)):
            raise SpecError("--input", f"channel {name!r}: {uri!r} is neither an s3:// URI nor a local path "
                                       "that exists. Fix: --input train=s3://my-bucket/data/train")
        out[name] = uri
    return out


def _parse_rehearse_data(items) -> dict:
    if not items:
        return {}
    pairs = list(items.items()) if isinstance(items, dict) else [
        str(item).partition("=")[::2] for item in (items if isinstance(items, (list, tuple)) else [items])]
    out = {}
    for uri, folder in pairs:
        uri, folder = str(uri).strip().rstrip("/"), str(folder).strip()
        if not uri.startswith("s3://") or len(uri) <= len("s3://") or not folder:
            raise SpecError("--rehearse-data", f"expected S3_URI=FOLDER, got {uri}={folder}. "
                                               "Fix: --rehearse-data s3://my-bucket/data/train=./data")
        if not os.path.exists(folder):
            raise SpecError("--rehearse-data", f"{uri}: the local folder {folder!r} does not exist "
                                               f"(working directory {os.getcwd()})")
        out[uri] = os.path.abspath(folder)
    return out
