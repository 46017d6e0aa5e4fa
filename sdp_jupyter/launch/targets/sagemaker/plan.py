"""The plan: everything a SageMaker job will be, decided and checked before any AWS call
(make_plan), and the draft CreateTrainingJob request it implies."""
from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from sdp_jupyter import jobdir
from sdp_jupyter import backends
from sdp_jupyter.launch.options import SpecError
from sdp_jupyter.instances import host_counts
from sdp_jupyter.launch.targets.sagemaker.engine import choose_engine
from sdp_jupyter.launch.targets.sagemaker.options import (CONTAINER_CHECKPOINT_DIR, DEFAULT_INSTANCE_TYPES, DEFAULT_MAX_RUN, MAX_NAME,
                                                  NAME_SUFFIX, SMDDP_FRAMEWORK_VERSION, SageMakerOptions,
                                                  validate_request)
from sdp_jupyter.launch.targets.sagemaker.source import no_sources_error, source_tree
from sdp_jupyter.launch.spec import JobSpec


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


def default_framework_version(backend: str, engine: str | None = None) -> str:
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
        raise no_sources_error()
    counts = host_counts(instance_type, opts.region)
    gpus = counts.get("gpus") or 0
    procs = spec.procs_per_node or gpus or 1
    short = "gpus" in counts and backends.gpu_shortfall(spec.backend, procs, gpus, instance_type,
                                                         "--instance-type ml.g5.2xlarge, or --backend gloo")
    if short:
        raise SpecError(*short)
    if spec.backend == backends.SMDDP and gpus and procs > gpus:
        raise SpecError("--procs-per-node", f"{procs} processes but {instance_type} has {gpus} GPU(s). "
                                            f"Fix: --procs-per-node {gpus}")
    framework_version = None
    if not opts.image_uri:
        framework_version = opts.framework_version or default_framework_version(spec.backend, engine)
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
