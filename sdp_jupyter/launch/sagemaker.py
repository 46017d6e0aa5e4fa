"""SageMakerLauncher: the same JobSpec as a SageMaker training job (docs/sagemaker.md).

`%%sdp_train --target sagemaker --nodes 2 --instance-type ml.p4d.24xlarge` becomes, through the
SageMaker Python SDK v3 (`sagemaker.train.ModelTrainer`):

- SourceCode: a source directory built in the job directory (``sagemaker_source/``) with the cell
  as script.py, our container entry point (sagemaker_entry.py as sdp_entry.py), spec.json, the
  pushed variables, a requirements file and sdp_jupyter: a copy of its pure-Python package, or,
  when our engine serves --backend smddp (``--engine``, see choose_engine), a source package the
  entry installs, compiling the engine;
- Torchrun distribution with `procs_per_node` processes per host (default: the instance's GPUs);
- Compute (instance type and count, volume, keep-alive, managed spot), StoppingCondition,
  InputData channels (``--input NAME=s3://...`` -> SM_CHANNEL_NAME), MetricDefinitions for the
  ``[sdp-metrics]`` log lines, and a CheckpointConfig whose S3 URI depends only on the job name,
  so a job re-run under the same name (and a spot job after an interruption) finds its
  checkpoints in SDP_CHECKPOINT_DIR=/opt/ml/checkpoints, as a local re-run finds them in
  <job dir>/checkpoints.

Before anything is sent, the options and then the final CreateTrainingJob request are checked
against botocore's service model (sagemaker_validate): neither botocore nor moto check lengths,
patterns or enums, the service does, minutes later.

The returned `SageMakerJob` is a `Job` whose directory mirrors the remote job: status.json follows
DescribeTrainingJob, logs/algo-<N>.log follows host N's CloudWatch stream, metrics/ holds the
step events parsed from the log lines and the hosts' CloudWatch metrics (normalised per GPU), so
the job view, the dashboard and a reopened job read it like a local one. Stop calls StopTrainingJob.

With ``--rehearse`` (sagemaker_rehearse) the same plan, source directory and request go to the local
AWS stand-in (sagemaker_standin) instead, which runs the job's hosts on this machine.
"""
from __future__ import annotations

import dataclasses
import gzip
import io
import json
import math
import os
import secrets
import shutil
import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from sdp_jupyter._env import env_float, parse_bool

import sdp_jupyter
from sdp_jupyter.launch import jobdir
from sdp_jupyter.launch.job import Job, JobError
from sdp_jupyter.launch.sagemaker_validate import check as check_request
from sdp_jupyter.launch.spec import JobSpec, Option, SpecError

OPERATION = "CreateTrainingJob"
SOURCE_DIR = "sagemaker_source"     # in the job directory: what goes up as the code channel
REQUEST_FILE = "sagemaker_request.json"
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
           "PyTorch version of the default image (default: 2.3.0 for smddp, else the newest the SDK knows)",
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
           "sdp_jupyter[rehearse])", kind="flag"),
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


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------
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


# ------------------------------------------------------------------------------------------------
# Instances
# ------------------------------------------------------------------------------------------------
def _catalogue(instance_type: str):
    from sdp_jupyter import instances

    try:
        return instances.get(instance_type)
    except KeyError:
        return None


def smddp_instance_types() -> dict[str, str]:
    """Instance type -> smddp support level, for the types SageMaker's smddp runs on."""
    from sdp_jupyter import instances

    return {name: inst.smddp for name, inst in instances.catalogue().items()
            if inst.smddp in (instances.SMDDP_SUPPORTED, instances.SMDDP_ALLREDUCE_ONLY)}


def check_smddp_instance(instance_type: str) -> str | None:
    """SpecError when SageMaker's smddp does not run on `instance_type`; a warning text for the
    AllReduce-only types; None when supported."""
    from sdp_jupyter import instances

    supported = smddp_instance_types()
    if instance_type not in supported:
        names = ", ".join(f"{n}{' (AllReduce only)' if lvl == instances.SMDDP_ALLREDUCE_ONLY else ''}"
                          for n, lvl in supported.items())
        raise SpecError("--instance-type", f"SageMaker's smddp library does not run on {instance_type}; it "
                                           f"supports {names}. Fix: --instance-type ml.p4d.24xlarge, or "
                                           "--engine sdp (sdp_jupyter's engine, on any type), or --backend "
                                           "nccl for other GPU types")
    if supported[instance_type] == instances.SMDDP_ALLREDUCE_ONLY:
        return (f"{instance_type}: SageMaker's smddp supports AllReduce only on this type and is no longer "
                "developed for it; ml.p4d.24xlarge / ml.p4de.24xlarge are fully supported")
    return None


def choose_engine(instance_type: str, backend: str, engine: str = "auto") -> tuple[str | None, str | None]:
    """Who provides `backend` smddp on `instance_type`: ("aws" | "sdp", a note or None); (None, None)
    for the other backends. `engine` "aws" is refused (SpecError) where SageMaker's library does not
    run; "auto" picks it where it runs and our engine elsewhere."""
    from sdp_jupyter import instances

    if backend != "smddp":
        if engine != instances.ENGINE_AUTO:
            raise SpecError("--engine", f"chooses who provides --backend smddp, and this job uses --backend "
                                        f"{backend}. Fix: drop --engine, or --backend smddp")
        return None, None
    supported = instance_type in smddp_instance_types()
    if engine == instances.ENGINE_AWS or (engine == instances.ENGINE_AUTO and supported):
        return instances.ENGINE_AWS, check_smddp_instance(instance_type)
    if engine == instances.ENGINE_AUTO:
        return instances.ENGINE_SDP, (f"{instance_type}: SageMaker's smddp library does not run on this type, so "
                                      "the job uses sdp_jupyter's engine (shipped as a source package and "
                                      "built in the container when the job starts; --engine aws to refuse)")
    return instances.ENGINE_SDP, None


def host_counts(instance_type: str, region: str | None = None) -> dict:
    """GPUs, vCPUs and memory of one instance: the catalogue, else the SDK's GPU table, else {}."""
    from sdp_jupyter.monitor.cloudwatch import instance_counts

    counts = instance_counts(instance_type)
    if not counts:
        try:
            from sagemaker.core import instance_types_gpu_info

            info = instance_types_gpu_info.retrieve(region or "us-east-1").get(instance_type)
        except Exception:
            info = None
        if info:
            counts = {"gpus": info["Count"], "gpu_mem_bytes": info["TotalGpuMemoryInMiB"] * 2**20}
    return counts


# ------------------------------------------------------------------------------------------------
# The plan: everything decided before any request
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Plan:
    """What the job will be, from the spec and options; `draft_request()` is checked up front."""

    spec: JobSpec
    opts: SageMakerOptions
    base_name: str
    instance_type: str
    procs_per_node: int
    framework_version: str | None
    image_uri: str | None
    max_run: int
    max_wait: int | None
    volume_size: int
    environment: dict
    warnings: list
    region: str | None = None
    role: str | None = None
    output_root: str | None = None  # s3://bucket[/prefix]
    engine: str | None = None  # who provides --backend smddp: "aws" | "sdp" (None for gloo/nccl)

    @property
    def output_path(self) -> str | None:
        return f"{self.output_root}/{self.base_name}" if self.output_root else None

    @property
    def checkpoint_uri(self) -> str | None:
        """Stable across jobs of the same name: re-runs and spot restarts resume from it."""
        return f"{self.output_root}/{self.base_name}/checkpoints" if self.output_root else None

    def hyperparameters(self) -> dict:
        return {k: v if isinstance(v, str) else json.dumps(v) for k, v in self.spec.hyperparameters.items()}

    def draft_request(self) -> dict:
        """The CreateTrainingJob request as far as it is known before the SDK completes it."""
        req: dict[str, Any] = {
            "TrainingJobName": f"{self.base_name}-{time.strftime('%Y%m%d%H%M%S')}",
            "AlgorithmSpecification": {"TrainingInputMode": "File",
                                       "MetricDefinitions": [dict(m) for m in metric_definitions()]},
            "ResourceConfig": {"InstanceType": self.instance_type, "InstanceCount": self.spec.nodes,
                               "VolumeSizeInGB": self.volume_size},
            "StoppingCondition": {"MaxRuntimeInSeconds": self.max_run},
            "HyperParameters": self.hyperparameters(),
            "Environment": dict(self.environment),
            "EnableManagedSpotTraining": self.opts.spot,
        }
        if self.image_uri:
            req["AlgorithmSpecification"]["TrainingImage"] = self.image_uri
        if self.opts.keep_alive is not None:
            req["ResourceConfig"]["KeepAlivePeriodInSeconds"] = self.opts.keep_alive
        if self.max_wait is not None:
            req["StoppingCondition"]["MaxWaitTimeInSeconds"] = self.max_wait
        if self.role:
            req["RoleArn"] = self.role
        if self.output_root:
            req["OutputDataConfig"] = {"S3OutputPath": self.output_path}
            req["CheckpointConfig"] = {"S3Uri": self.checkpoint_uri, "LocalPath": CONTAINER_CHECKPOINT_DIR}
        channels = [{"ChannelName": name, "DataSource": {"S3DataSource": {"S3DataType": "S3Prefix", "S3Uri": uri}}}
                    for name, uri in self.opts.inputs.items() if uri.startswith("s3://")]
        if channels:
            req["InputDataConfig"] = channels
        if self.spec.max_restarts:
            req["RetryStrategy"] = {"MaximumRetryAttempts": self.spec.max_restarts}
        return req


def metric_definitions() -> tuple:
    from sdp_jupyter.monitor.cloudwatch import METRIC_DEFINITIONS

    return METRIC_DEFINITIONS


def base_job_name(name: str) -> str:
    """The SDK turns '_' into '-'; we also turn '.' (not allowed in training job names)."""
    return name.replace("_", "-").replace(".", "-")


def _default_framework_version(backend: str, engine: str | None = None) -> str:
    if backend == "smddp" and engine != "sdp":
        return SMDDP_FRAMEWORK_VERSION
    from sagemaker.core import image_uris

    versions = image_uris.config_for_framework("pytorch")["training"]["versions"]
    return max(versions, key=lambda v: tuple(int(p) for p in v.split(".") if p.isdigit()))


def make_plan(spec: JobSpec) -> Plan:
    """Check the spec and options for SageMaker and fill the defaults that need no AWS call."""
    opts = SageMakerOptions.from_dict(spec.sagemaker)
    warnings = []
    name = spec.name or jobdir.new_job_name()
    base = base_job_name(name)
    if len(base) + NAME_SUFFIX > MAX_NAME:
        raise SpecError("--name", f"{name!r} is {len(base)} characters; SageMaker job names are at most "
                                  f"{MAX_NAME} including the {NAME_SUFFIX}-character '-YYYYmmddHHMMSS' suffix the "
                                  f"SDK adds, so use at most {MAX_NAME - NAME_SUFFIX}")
    instance_type = opts.instance_type or DEFAULT_INSTANCE_TYPES[spec.backend]
    engine, note = choose_engine(instance_type, spec.backend, opts.engine)
    if note:
        warnings.append(note)
    if engine == "sdp" and source_tree() is None:
        raise _no_sources()
    counts = host_counts(instance_type, opts.region)
    gpus = counts.get("gpus") or 0
    if spec.backend == "nccl" and "gpus" in counts and not gpus:
        raise SpecError("--backend", f"nccl needs GPUs and {instance_type} has none. Fix: --instance-type "
                                     "ml.g5.2xlarge, or --backend gloo")
    procs = spec.procs_per_node or gpus or 1
    if spec.backend in ("nccl", "smddp") and gpus and procs > gpus:
        raise SpecError("--procs-per-node", f"{procs} processes but {instance_type} has {gpus} GPU(s). "
                                            f"Fix: --procs-per-node {gpus}")
    framework_version = None
    if not opts.image_uri:
        framework_version = opts.framework_version or _default_framework_version(spec.backend, engine)
        if engine == "aws" and framework_version != SMDDP_FRAMEWORK_VERSION:
            warnings.append(f"--framework-version {framework_version}: SageMaker's smddp library is known to "
                            f"be in the PyTorch {SMDDP_FRAMEWORK_VERSION} training image; if this image lacks it "
                            "the job fails at init_process_group('smddp')")
    elif opts.framework_version:
        raise SpecError("--framework-version", "chooses the default image; it cannot be used with --image-uri")
    max_run = opts.max_run or (math.ceil(spec.timeout) if spec.timeout else DEFAULT_MAX_RUN)
    max_wait = opts.max_wait
    if opts.spot:
        max_wait = max_wait or 2 * max_run
        if max_wait < max_run:
            raise SpecError("--max-wait", f"must be at least --max-run ({max_run} s), got {max_wait}. "
                                          f"Fix: --max-wait {2 * max_run}")
    if spec.checkpoint_dir:
        warnings.append(f"--checkpoint-dir {spec.checkpoint_dir} is a local path; on SageMaker "
                        f"SDP_CHECKPOINT_DIR is {CONTAINER_CHECKPOINT_DIR} (synced to S3)")
    environment = dict(spec.env)
    environment.update(spec.parallel_env())  # --tp, --pp, ...: the workers' SDP_TP, SDP_PP, ... as locally
    if engine:
        environment["SDP_ENGINE"] = engine
    environment.update({
        "SDP_BACKEND": spec.backend,
        "SDP_JOB_NAME": base,
        "SDP_NUM_NODES": str(spec.nodes),
        "SDP_CHECKPOINT_DIR": CONTAINER_CHECKPOINT_DIR,
        "PYTHONUNBUFFERED": "1",
    })
    plan = Plan(spec=spec.replace(name=name, procs_per_node=procs), opts=opts, base_name=base,
                instance_type=instance_type, procs_per_node=procs, framework_version=framework_version,
                image_uri=opts.image_uri, max_run=max_run, max_wait=max_wait,
                volume_size=opts.volume_size or 30, environment=environment, warnings=warnings,
                region=opts.region, role=opts.role, engine=engine,
                output_root=(opts.output_path.rstrip("/") if opts.output_path
                             else f"s3://{opts.bucket}" if opts.bucket else None))
    validate_request(plan.draft_request(), partial=True, when="checked before any AWS call")
    return plan


# ------------------------------------------------------------------------------------------------
# AWS session, role, bucket, image
# ------------------------------------------------------------------------------------------------
def boto_session(region: str | None = None):
    import boto3

    session = boto3.Session(region_name=region) if region else boto3.Session()
    if not session.region_name:
        raise SpecError("--region", "no AWS region is configured. Fix: --region us-west-2 (or set "
                                    "AWS_DEFAULT_REGION / a region in ~/.aws/config)")
    return session


def resolve_aws(plan: Plan, session=None):
    """Fill region, role, output location and image from the SageMaker session; return it."""
    from sagemaker.core.helper.session_helper import Session

    boto = session.boto_session if session is not None else boto_session(plan.region)
    plan.region = boto.region_name
    sm_session = session or Session(boto_session=boto, default_bucket=plan.opts.bucket)
    if not plan.role:
        try:
            from sagemaker.train.defaults import TrainDefaults

            plan.role = TrainDefaults.get_role(role=None, sagemaker_session=sm_session)
        except Exception as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SpecError("--role", f"no IAM role was given and the SageMaker SDK could not find one ({reason}). "
                                      "Fix: --role arn:aws:iam::<account>:role/<a role SageMaker can assume>"
                            ) from None
    if not plan.output_root:
        try:
            plan.output_root = f"s3://{sm_session.default_bucket()}"
        except Exception as e:
            raise SpecError("--bucket", f"the SDK's default bucket is not usable ({e}). "
                                        "Fix: --bucket my-bucket or --output-path s3://my-bucket/prefix") from None
    if not plan.image_uri:
        from sagemaker.core import image_uris

        try:
            plan.image_uri = image_uris.retrieve(framework="pytorch", region=plan.region,
                                                 version=plan.framework_version, instance_type=plan.instance_type,
                                                 image_scope="training")
        except ValueError as e:
            raise SpecError("--framework-version", f"no PyTorch training image for {plan.framework_version} on "
                                                   f"{plan.instance_type} in {plan.region}: {e}") from None
    if plan.engine == "sdp":  # named by the entry when the image cannot build the engine
        plan.environment["SDP_IMAGE_URI"] = plan.image_uri
    validate_request(plan.draft_request(), partial=True, when="checked before any AWS call")
    return sm_session


# ------------------------------------------------------------------------------------------------
# Source directory
# ------------------------------------------------------------------------------------------------
_PACKAGE_FILES = (".py", ".json", ".txt", ".md")
_NATIVE_FILES = (".h", ".hpp", ".cpp", ".cc")
#: what a source package of sdp_jupyter holds besides sdp_jupyter/ and native/ (pyproject names README.md)
_SDIST_TOP = ("pyproject.toml", "setup.py", "README.md")


def source_tree() -> Path | None:
    """The checkout this sdp_jupyter runs from (pyproject.toml, setup.py, native/ next to the
    package), or None for an installed wheel, which carries no C++ sources."""
    root = Path(sdp_jupyter.__file__).resolve().parent.parent
    if all((root / name).is_file() for name in _SDIST_TOP[:2]) and (root / "native").is_dir():
        return root
    return None


def _no_sources() -> SpecError:
    return SpecError("--engine", f"sdp ships sdp_jupyter's C++ sources with the job, and this sdp_jupyter "
                                 f"({Path(sdp_jupyter.__file__).parent}) is installed without them. Fix: install "
                                 "it from a checkout (pip install -e .), or --engine aws on ml.p4d.24xlarge / "
                                 "ml.p4de.24xlarge")


def _package_files(package: Path):
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package)
        if path.is_file() and path.suffix in _PACKAGE_FILES and "__pycache__" not in rel.parts:
            yield path, rel


def build_sdist(dest_dir: Path) -> Path:
    """sdp_jupyter as a source package (``sdp_jupyter-<version>.tar.gz`` in `dest_dir`): pyproject.toml,
    setup.py, native/ and the package's Python and data files, what `pip install` needs to build the
    engine. Written here rather than by `python -m build`: no build tool, no egg-info left in the
    checkout, and it takes a fraction of a second."""
    root = source_tree()
    if root is None:
        raise _no_sources()
    version = getattr(sdp_jupyter, "__version__", None) or "0.1.0"
    base = f"sdp_jupyter-{version}"
    target = Path(dest_dir) / f"{base}.tar.gz"
    files = [(root / name, name) for name in _SDIST_TOP if (root / name).is_file()]
    files += [(p, p.relative_to(root).as_posix()) for p in sorted((root / "native").rglob("*"))
              if p.is_file() and p.suffix in _NATIVE_FILES]
    package = Path(sdp_jupyter.__file__).resolve().parent
    files += [(p, f"sdp_jupyter/{rel.as_posix()}") for p, rel in _package_files(package)]
    pkg_info = f"Metadata-Version: 2.1\nName: sdp_jupyter\nVersion: {version}\n".encode()
    # the same sources give the same bytes (no time stamps but the files'), so a host that installed
    # this package already (a rehearsal's reused image) knows it by its digest
    with open(target, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size, info.mode = len(pkg_info), 0o644
        info.mtime = max(int(p.stat().st_mtime) for p, _ in files)
        tar.addfile(info, io.BytesIO(pkg_info))
        for path, arcname in files:
            tar.add(str(path), arcname=f"{base}/{arcname}", recursive=False, filter=_plain_member)
    return target


def _plain_member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def build_source_dir(job_dir: Path, plan: Plan) -> Path:
    """The code channel: script.py, sdp_entry.py, spec.json, push.pkl, requirements.txt, and
    sdp_jupyter: its pure-Python files as sdp_jupyter/ (SageMaker's smddp, gloo, nccl), or with our
    engine (plan.engine "sdp") a source package the entry installs, compiling the engine."""
    src = job_dir / SOURCE_DIR
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    shutil.copy2(job_dir / jobdir.SCRIPT, src / "script.py")
    shutil.copy2(Path(__file__).with_name("sagemaker_entry.py"), src / ENTRY_SCRIPT)
    (src / "spec.json").write_text(plan.spec.to_json())
    if (job_dir / jobdir.PUSH).is_file():
        shutil.copy2(job_dir / jobdir.PUSH, src / jobdir.PUSH)
    (src / "requirements.txt").write_text(
        "# Installed by SageMaker before the job starts (pip install -r requirements.txt).\n"
        "# sdp_jupyter's worker side needs nothing beyond the PyTorch training image.\n")
    if plan.engine == "sdp":
        build_sdist(src)
        # our engine authenticates the job's ranks with a secret: one per job, in the code channel
        # (the bucket's readers could read the code too), never in the request's Environment, which
        # DescribeTrainingJob shows (docs/security.md)
        jobdir.write_private(src / SECRET_FILE, secrets.token_hex(32).encode())
        return src
    for path, rel in _package_files(Path(sdp_jupyter.__file__).resolve().parent):
        dest = src / "sdp_jupyter" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    return src


# ------------------------------------------------------------------------------------------------
# The trainer
# ------------------------------------------------------------------------------------------------
def build_trainer(plan: Plan, source_dir: Path, sm_session):
    """The ModelTrainer for `plan` (SageMaker Python SDK v3)."""
    from sagemaker.core.shapes import RetryStrategy
    from sagemaker.core.training.configs import (CheckpointConfig, Compute, InputData, MetricDefinition,
                                                 OutputDataConfig, SourceCode, StoppingCondition)
    from sagemaker.train import ModelTrainer
    from sagemaker.train.distributed import Torchrun

    compute = Compute(instance_type=plan.instance_type, instance_count=plan.spec.nodes,
                      volume_size_in_gb=plan.volume_size,
                      enable_managed_spot_training=True if plan.opts.spot else None,
                      keep_alive_period_in_seconds=plan.opts.keep_alive)
    stopping = StoppingCondition(max_runtime_in_seconds=plan.max_run, max_wait_time_in_seconds=plan.max_wait)
    trainer = ModelTrainer(
        sagemaker_session=sm_session,
        role=plan.role,
        base_job_name=plan.base_name,
        training_image=plan.image_uri,
        source_code=SourceCode(source_dir=str(source_dir), entry_script=ENTRY_SCRIPT,
                               requirements="requirements.txt"),
        distributed=Torchrun(process_count_per_node=plan.procs_per_node),
        compute=compute,
        stopping_condition=stopping,
        output_data_config=OutputDataConfig(s3_output_path=plan.output_path),
        checkpoint_config=CheckpointConfig(s3_uri=plan.checkpoint_uri, local_path=CONTAINER_CHECKPOINT_DIR),
        input_data_config=[InputData(channel_name=n, data_source=u) for n, u in plan.opts.inputs.items()] or None,
        environment=dict(plan.environment),
        hyperparameters=dict(plan.spec.hyperparameters),
    )
    trainer.with_metric_definitions([MetricDefinition(name=m["Name"], regex=m["Regex"])
                                     for m in metric_definitions()])
    if plan.spec.max_restarts:
        trainer.with_retry_strategy(RetryStrategy(maximum_retry_attempts=plan.spec.max_restarts))
    return trainer


class _RequestGate:
    """botocore hook on CreateTrainingJob: validates the final request against the service model
    before it is sent, and keeps a copy (the job directory's sagemaker_request.json)."""

    EVENT = "provide-client-params.sagemaker.CreateTrainingJob"

    def __init__(self, path: Path | None = None):
        self.path = path
        self.request: dict | None = None

    def __call__(self, params, **_):
        validate_request(params, when="the final request, not sent")
        self.request = json.loads(json.dumps(params, default=str))
        if self.path is not None:
            jobdir.write_json_atomic(self.path, self.request)
        return None

    def _emitters(self, boto):
        """The session's hooks, and those of the client the SDK will use: botocore clients copy the
        session's hooks when they are made, and the SDK caches its client per session."""
        from sagemaker.core.resources import Base

        client = Base.get_sagemaker_client(session=boto, region_name=None, service_name="sagemaker")
        return (boto.events, client.meta.events)

    def install(self, boto):
        for events in self._emitters(boto):
            events.register(self.EVENT, self, unique_id=f"sdp-gate-{id(self)}")
        return self

    def remove(self, boto):
        for events in self._emitters(boto):
            events.unregister(self.EVENT, unique_id=f"sdp-gate-{id(self)}")


# ------------------------------------------------------------------------------------------------
# Launcher
# ------------------------------------------------------------------------------------------------
class SageMakerLauncher:
    """Runs a JobSpec as a SageMaker training job. `session`: a sagemaker Session to use (else one
    is made from the default boto3 credentials and --region)."""

    def __init__(self, session=None):
        self.session = session

    def resolve(self, spec: JobSpec) -> Plan:
        if spec.script is not None and not Path(spec.script).is_file():
            raise SpecError("script", f"{spec.script} does not exist; give the path of a .py file")
        return make_plan(spec)

    def start(self, spec: JobSpec, push: dict | None = None) -> "SageMakerJob":
        from sdp_jupyter.launch.push import pickle_push

        plan = self.resolve(spec)
        push_bytes = pickle_push(plan.spec.push, push or {})
        for note in plan.warnings:
            print(f"[sdp_jupyter] note: {note}")
        if plan.opts.rehearse:
            from sdp_jupyter.launch.sagemaker_rehearse import rehearse

            return rehearse(self, plan, push_bytes)
        return self.submit(plan, push_bytes)

    def submit(self, plan: Plan, push_bytes: bytes | None, session=None, *, extra: dict | None = None,
               prepare=None) -> "SageMakerJob":
        """Create the job directory and the training job of a checked plan. `extra`: more facts for
        status.json's `sagemaker`; `prepare(job)`: called once the directory exists, before the request."""
        sm_session = resolve_aws(plan, session if session is not None else self.session)
        job_dir, spec = SageMakerJob.create_dir(plan.spec, push_bytes)
        plan.spec = spec
        source = build_source_dir(job_dir, plan)
        job = SageMakerJob(spec, job_dir)
        job.update_status(state="pending", created=time.time(), started=None, ended=None, exit_codes=[], restarts=0,
                    error=None, target="sagemaker", world_size=spec.nodes * plan.procs_per_node,
                    sagemaker={"region": plan.region, "instance_type": plan.instance_type,
                               "image_uri": plan.image_uri, "role": plan.role, "output_path": plan.output_path,
                               "checkpoint_uri": plan.checkpoint_uri, "spot": plan.opts.spot,
                               "poll_interval": plan.opts.poll_interval, "engine": plan.engine,
                               **(extra or {})})
        if prepare is not None:
            prepare(job)
        gate = _RequestGate(job_dir / REQUEST_FILE).install(sm_session.boto_session)
        try:
            trainer = build_trainer(plan, source, sm_session)
            trainer.train(wait=False, logs=False)
        except SpecError as e:
            job.update_status(state="failed", ended=time.time(), error=str(e))
            raise
        except Exception as e:
            job.update_status(state="failed", ended=time.time(), error=f"CreateTrainingJob failed: {e}")
            raise JobError(f"job {spec.name}: SageMaker did not start the training job: {e}", job) from e
        finally:
            gate.remove(sm_session.boto_session)
        name = (gate.request or {}).get("TrainingJobName")
        if name is None:
            # the SDK sent it through a client the gate did not reach (see _RequestGate._emitters)
            name = trainer._latest_training_job.training_job_name
            print(f"[sdp_jupyter] note: the final CreateTrainingJob request of {name} was not checked here; "
                  "the options and the draft request were")
        job.update_status(sagemaker=dict(job.status.get("sagemaker") or {}, training_job_name=name))
        print(f"[sdp_jupyter] SageMaker training job {name} created in {plan.region} "
              f"({spec.nodes} x {plan.instance_type}, {plan.procs_per_node} process(es) per host)")
        job.mirror()
        return job


def launch(spec: JobSpec, push: dict | None = None, session=None) -> "SageMakerJob":
    """Start `spec` as a SageMaker training job (what `launch(..., target="sagemaker")` does)."""
    return SageMakerLauncher(session).start(spec, push=push)


# ------------------------------------------------------------------------------------------------
# The job
# ------------------------------------------------------------------------------------------------
_FINAL_STATES = {"Completed": "succeeded", "Failed": "failed", "Stopped": "stopped"}
_STARTING = {"Starting", "Pending", "Downloading", "LaunchingMLInstances", "PreparingTrainingStack",
             "DownloadingTrainingImage"}


def job_state(status: str | None, secondary: str | None) -> str:
    """Our state for a (TrainingJobStatus, SecondaryStatus) pair."""
    if status in _FINAL_STATES:
        return _FINAL_STATES[status]
    if status == "InProgress" and (secondary is None or secondary in _STARTING):
        return "pending"
    return "running"


def host_log_path(job_dir: Path, host: int) -> Path:
    return Path(job_dir) / jobdir.LOGS / f"algo-{host + 1}.log"


#: the line the container entry prints once the smddp backend is loaded (sagemaker_entry.load_smddp)
ENGINE_LINE = "[sdp_jupyter] smddp engine: "


def engine_line(sm: dict) -> str | None:
    """'smddp engine: ...' for a job's status.json `sagemaker` facts: the engine the hosts reported
    (their log line), else the one planned; None for gloo/nccl jobs."""
    from sdp_jupyter.instances import ENGINE_NAMES

    planned = sm.get("engine")
    if not planned:
        return None
    ran = sm.get("engine_ran")
    if ran:
        return f"smddp engine: {ran} (reported by the hosts)"
    return f"smddp engine: {ENGINE_NAMES.get(planned, planned)} (planned; the hosts have not reported yet)"


class SageMakerJob(Job):
    """A SageMaker training job seen through its job directory. Output is per host: `logs(i)` is
    host algo-(i+1)'s CloudWatch stream (all of its ranks)."""

    @classmethod
    def open(cls, name_or_dir, root=None, mirror: bool = False) -> "SageMakerJob":
        """Reopen from the job directory; with mirror, keep following the remote job if it still runs."""
        job = super().open(name_or_dir, root)  # Job.open builds a cls (it dispatches only for Job itself)
        if mirror:
            job.mirror()
        return job

    # ---------------------------------------------------------------- facts
    @property
    def sagemaker(self) -> dict:
        return dict(self.status.get("sagemaker") or {})

    @property
    def training_job_name(self) -> str | None:
        return self.sagemaker.get("training_job_name")

    @property
    def hosts(self) -> int:
        return self.spec.nodes

    @property
    def request(self) -> dict | None:
        """The CreateTrainingJob request as it was sent."""
        return jobdir.read_json(self.dir / REQUEST_FILE)

    @property
    def rehearsal(self) -> dict | None:
        """What a rehearsal (--rehearse) checked and ran; None for a job on AWS."""
        return self.sagemaker.get("rehearsal")

    def _boto(self):
        if self.rehearsal:  # the local stand-in that played AWS, never AWS itself
            from sdp_jupyter.launch.sagemaker_standin import MotoAWS

            return MotoAWS(endpoint=self.rehearsal["endpoint"], env={})
        return boto_session(self.sagemaker.get("region"))

    # ---------------------------------------------------------------- following the remote job
    def mirror(self) -> None:
        """Mirror the remote job into the job directory from a background thread until it ends."""
        if self.supervisor is None and not self.done and self.training_job_name:
            self.supervisor = SageMakerRun(self)
            self.supervisor.start()

    def describe(self) -> dict:
        return self._boto().client("sagemaker").describe_training_job(TrainingJobName=self.training_job_name)

    # ---------------------------------------------------------------- control
    def stop(self, wait: bool = True) -> str:
        """StopTrainingJob; with wait, block until SageMaker reports the job Stopped."""
        if self.done:
            return self.state
        if not self.training_job_name:
            raise JobError(f"job {self.name} has no SageMaker training job to stop")
        client = self._boto().client("sagemaker")
        try:
            client.stop_training_job(TrainingJobName=self.training_job_name)
        except client.exceptions.ClientError as e:
            # already stopping or ended between our last poll and now: the poller will see it
            if "status" not in str(e).lower():
                raise JobError(f"job {self.name}: StopTrainingJob failed: {e}", self) from e
        self.update_status(stop_requested=time.time())
        if self.supervisor is None:
            self.mirror()
        if wait:
            self.wait()
        return self.state

    # ---------------------------------------------------------------- outputs
    def logs(self, rank: int = 0, tail: int | None = None) -> str:
        """Host `rank`'s log (host algo-(rank+1), all its ranks); the last `tail` lines if given."""
        host = int(rank)
        if not 0 <= host < self.hosts:
            raise JobError(f"host {host} does not exist: job {self.name} has hosts 0..{self.hosts - 1} "
                           f"(algo-1..algo-{self.hosts})")
        try:
            text = host_log_path(self.dir, host).read_text(errors="replace")
        except FileNotFoundError:
            return ""
        if tail is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(tail):]) if int(tail) > 0 else ""
        return text

    def subscribe(self, listener) -> dict[int, list[str]]:
        with self._lock:
            self._listeners.append(listener)
            snapshot = {host: list(lines) for host, lines in self._tails.items()}
        if not snapshot:
            snapshot = {h: self.logs(h, tail=2000).splitlines(keepends=True) for h in range(self.hosts)}
        return snapshot

    def result(self):
        """Rank 0's result: fetched from the job's output.tar.gz (sdp_job/result.pkl) when needed."""
        if not (self.dir / jobdir.RESULT).is_file() and self.state == "succeeded":
            self.fetch_output()
        return super().result()

    def fetch_output(self) -> Path:
        """Download output.tar.gz and unpack its sdp_job/ into the job directory (result, metrics)."""
        desc = self.describe()
        root = desc["OutputDataConfig"]["S3OutputPath"].rstrip("/")
        uri = f"{root}/{self.training_job_name}/output/output.tar.gz"
        bucket, _, key = uri[len("s3://"):].partition("/")
        target = self.dir / "output" / "output.tar.gz"
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._boto().client("s3").download_file(bucket, key, str(target))
        except Exception as e:
            raise JobError(f"job {self.name}: cannot fetch {uri}: {e}", self) from e
        with tarfile.open(target) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if not member.isfile() or len(parts) < 2 or parts[0] != "sdp_job" or ".." in parts:
                    continue
                dest = self.dir.joinpath(*parts[1:])
                if dest.parent.name == jobdir.METRICS and dest.exists():
                    continue  # the mirror from the log lines is already there
                dest.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out)
        return target

    def view(self):
        from sdp_jupyter.launch.sagemaker_view import SageMakerJobView

        return SageMakerJobView(self)

    def summary(self) -> str:
        sm = self.sagemaker
        line = super().summary()
        extra = (f"\nSageMaker: {sm.get('training_job_name')} in {sm.get('region')}, "
                 f"{self.spec.nodes} x {sm.get('instance_type')}, status {sm.get('status', '?')}"
                 f"/{sm.get('secondary_status', '?')}")
        engine = engine_line(sm)
        if engine:
            extra += f"\n{engine}"
        if self.rehearsal:
            from sdp_jupyter.launch.sagemaker_rehearse import describe

            extra += "\n" + describe(self.rehearsal)
        return line + extra


class SageMakerRun:
    """Background poller of one SageMaker job: DescribeTrainingJob, CloudWatch Logs and metrics,
    mirrored into the job directory and the job's views."""

    def __init__(self, job: SageMakerJob):
        self.job = job
        self.world_size = job.world_size
        self.interval = float(job.sagemaker.get("poll_interval") or DEFAULT_POLL_INTERVAL)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"sdp-sagemaker-{job.name}", daemon=True)
        self._files: dict[str, Any] = {}
        self._last_t: dict = {}
        self.errors = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.job.stop(wait=False)

    def close(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- loop
    def _loop(self) -> None:
        from sdp_jupyter.monitor.cloudwatch import LINE_PREFIX, HostMetrics, LogFollower, parse_log_line

        job = self.job
        sm = job.sagemaker
        self._parse, self._prefix = parse_log_line, LINE_PREFIX.strip()
        boto = job._boto()
        client = boto.client("sagemaker")
        logs = LogFollower(job.training_job_name, session=boto)
        metrics = HostMetrics(job.training_job_name, job.hosts, sm.get("instance_type"), session=boto,
                              start=job.status.get("created"))
        metrics.counts = host_counts(sm.get("instance_type") or "", sm.get("region")) or metrics.counts
        next_metrics = 0.0
        try:
            while not self._stop.is_set():
                try:
                    desc = client.describe_training_job(TrainingJobName=job.training_job_name)
                    final = desc.get("TrainingJobStatus") in _FINAL_STATES
                    self._lines(logs.poll())
                    if final or time.monotonic() >= next_metrics:
                        self._system(metrics.poll(final=final))
                        next_metrics = time.monotonic() + max(self.interval, METRICS_POLL_INTERVAL)
                    if final:
                        time.sleep(min(self.interval, 5.0))  # CloudWatch lags the status a little
                        self._lines(logs.poll())
                    self._status(desc)
                    self.errors = 0
                    if final:
                        return
                except Exception as e:  # throttling, network: the remote job is not affected
                    self.errors += 1
                    job.update_status(sagemaker=dict(job.sagemaker, poll_error=f"{type(e).__name__}: {e}"))
                self._stop.wait(self.interval * min(2 ** self.errors, 30))
        finally:
            for f in self._files.values():
                f.close()
            if job.supervisor is self:
                job.supervisor = None

    def _file(self, path: Path):
        f = self._files.get(str(path))
        if f is None:
            path.parent.mkdir(parents=True, exist_ok=True)
            f = self._files[str(path)] = open(path, "a", encoding="utf-8")
        return f

    def _lines(self, lines) -> None:
        touched = set()
        for host, text, t in lines:
            text = text.rstrip("\n")
            f = self._file(host_log_path(self.job.dir, host))
            f.write(text + "\n")
            touched.add(f)
            self.job.emit_output(host, text + "\n")
            if ENGINE_LINE in text and not self.job.sagemaker.get("engine_ran"):
                ran = text.split(ENGINE_LINE, 1)[1].strip()
                self.job.update_status(sagemaker=dict(self.job.sagemaker, engine_ran=ran))
            if self._prefix in text:
                ev = self._parse(text, host, t)
                if ev is not None:
                    rank = ev.get("rank", host)
                    m = self._file(self.job.dir / jobdir.METRICS / f"rank-{rank}.jsonl")
                    m.write(json.dumps(ev, separators=(",", ":")) + "\n")
                    touched.add(m)
        for f in touched:
            f.flush()

    def _system(self, events) -> None:
        touched = set()
        for ev in events:
            f = self._file(self.job.dir / jobdir.METRICS / f"system-node-{ev['node']}.jsonl")
            f.write(json.dumps(ev, separators=(",", ":")) + "\n")
            touched.add(f)
        for f in touched:
            f.flush()

    def _status(self, desc: dict) -> None:
        job = self.job
        status, secondary = desc.get("TrainingJobStatus"), desc.get("SecondaryStatus")
        sm = job.sagemaker
        transitions = [{"status": t.get("Status"), "message": t.get("StatusMessage"),
                        "start": _ts(t.get("StartTime")), "end": _ts(t.get("EndTime"))}
                       for t in desc.get("SecondaryStatusTransitions") or []]
        seen = len(sm.get("transitions") or [])
        for t in transitions[seen:]:
            job.emit_output(0, f"[sagemaker] {t['status']}: {t['message'] or ''}\n")
        changes = {"status": status, "secondary_status": secondary, "transitions": transitions,
                   "failure_reason": desc.get("FailureReason"), "arn": desc.get("TrainingJobArn"),
                   "billable_seconds": desc.get("BillableTimeInSeconds"), "poll_error": None}
        if sm.get("status") == status and sm.get("secondary_status") == secondary \
                and len(transitions) == seen and not sm.get("poll_error"):
            return
        fields: dict[str, Any] = {"sagemaker": dict(sm, **changes)}
        state = job_state(status, secondary)
        fields["state"] = state
        if state != "pending" and not job.status.get("started"):
            fields["started"] = _ts(desc.get("TrainingStartTime")) or time.time()
        if state in jobdir.FINAL_STATES:
            fields["ended"] = _ts(desc.get("TrainingEndTime")) or time.time()
            if state == "failed":
                fields["error"] = desc.get("FailureReason") or "the training job failed (no reason given)"
            elif state == "stopped":
                fields["error"] = "stopped (StopTrainingJob)"
        job.update_status(**fields)


def _ts(value) -> float | None:
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return value.timestamp()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
