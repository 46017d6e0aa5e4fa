"""Submitting a plan: the SDK's ModelTrainer, the gate that validates the final CreateTrainingJob
request before it is sent, and SageMakerLauncher (the target's entry in the launcher registry)."""
from __future__ import annotations

import json
import time
from pathlib import Path

from sdp_jupyter import jobdir
from sdp_jupyter.launch.kernel.job import JobError
from sdp_jupyter.launch.kernel.preparation import create_job, prepared
from sdp_jupyter.launch.kernel.push import pickle_push
from sdp_jupyter.launch.options import SpecError
from sdp_jupyter.launch.targets.sagemaker.aws import resolve_aws
from sdp_jupyter.launch.targets.sagemaker.training_job import SageMakerJob
from sdp_jupyter.launch.targets.sagemaker.options import CONTAINER_CHECKPOINT_DIR, ENTRY_SCRIPT, REQUEST_FILE, validate_request
from sdp_jupyter.launch.targets.sagemaker.plan import Plan, make_plan, metric_definitions
from sdp_jupyter.launch.targets.sagemaker.source import build_source_dir
from sdp_jupyter.launch.spec import JobSpec


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


class RequestGate:
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


class SageMakerLauncher:
    """Runs a JobSpec as a SageMaker training job. `session`: a sagemaker Session to use (else one
    is made from the default boto3 credentials and --region)."""

    def __init__(self, session=None):
        self.session = session

    def resolve(self, spec: JobSpec) -> Plan:
        return make_plan(prepared(spec))

    def start(self, spec: JobSpec, push: dict | None = None) -> "SageMakerJob":
        plan = self.resolve(spec)
        push_bytes = pickle_push(plan.spec.push, push or {})
        for note in plan.warnings:
            print(f"[sdp_jupyter] note: {note}")
        if plan.opts.rehearse:
            from sdp_jupyter.launch.targets.sagemaker.rehearse import rehearse

            return rehearse(self, plan, push_bytes)
        return self.submit(plan, push_bytes)

    def submit(self, plan: Plan, push_bytes: bytes | None, session=None, *, extra: dict | None = None,
               prepare=None) -> "SageMakerJob":
        """Create the job directory and the training job of a checked plan. `extra`: more facts for
        status.json's `sagemaker`; `prepare(job)`: called once the directory exists, before the request."""
        sm_session = resolve_aws(plan, session if session is not None else self.session)
        job = create_job(plan.spec, push_bytes, SageMakerJob, supervised_here=False,
                         world_size=plan.spec.world_size,
                         sagemaker={"region": plan.region, "instance_type": plan.instance_type,
                               "image_uri": plan.image_uri, "role": plan.role, "output_path": plan.output_path,
                               "checkpoint_uri": plan.checkpoint_uri, "spot": plan.opts.spot,
                               "poll_interval": plan.opts.poll_interval, "engine": plan.engine,
                               **(extra or {})})
        plan.spec = spec = job.spec
        job_dir = job.dir
        try:
            source = build_source_dir(job_dir, plan)
        except Exception as e:  # the job exists (pending): it must not stay pending with nothing behind it
            job.update_status(state="failed", ended=time.time(), error=f"the source directory was not built: {e}")
            raise
        if prepare is not None:
            prepare(job)
        gate = RequestGate(job_dir / REQUEST_FILE).install(sm_session.boto_session)
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
            # the SDK sent it through a client the gate did not reach (see RequestGate._emitters)
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
