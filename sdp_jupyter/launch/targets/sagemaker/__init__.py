"""SageMakerLauncher: the same JobSpec as a SageMaker training job (docs/sagemaker.md).

`%%sdp_train --target sagemaker --nodes 2 --instance-type ml.p4d.24xlarge` becomes, through the
SageMaker Python SDK v3 (`sagemaker.train.ModelTrainer`):

- SourceCode: a source directory built in the job directory (``sagemaker_source/``) with the cell
  as script.py, our container entry point (entry.py as sdp_entry.py), spec.json, the
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
against botocore's service model (validate.py): neither botocore nor moto check lengths,
patterns or enums, the service does, minutes later.

The returned `SageMakerJob` is a `Job` whose directory mirrors the remote job: status.json follows
DescribeTrainingJob, logs/algo-<N>.log follows host N's CloudWatch stream, metrics/ holds the
step events parsed from the log lines and the hosts' CloudWatch metrics (normalised per GPU), so
the job view, the dashboard and a reopened job read it like a local one. Stop calls StopTrainingJob.

With ``--rehearse`` (rehearse.py) the same plan, source directory and request go to the local
AWS stand-in (sdp_jupyter/testing/sagemaker_standin/) instead, which runs the job's hosts on this machine.

The package, one module per concern: options (SAGEMAKER_OPTIONS, SageMakerOptions, the request
check), validate (botocore's service model), engine (instance types; who serves smddp), plan
(make_plan), aws (session, role, bucket, image), source (the code channel, the sdist), submit
(ModelTrainer, the request gate, SageMakerLauncher), job (SageMakerJob, SageMakerRun), entry (the
container entry), rehearse (--rehearse) and standin (the local AWS stand-in). This __init__ is the
target's record only (a leaf the registry reads); import the names from their modules
(``from sdp_jupyter.launch.targets.sagemaker.training_job import SageMakerJob``).
"""
from sdp_jupyter.launch.targets.record import Target

RECORD = Target(
    "sagemaker", ".submit:SageMakerLauncher", "sagemaker", "sdp_jupyter.launch.targets.sagemaker.options:SAGEMAKER_OPTIONS",
    plan_keys=("instance_type", "engine"), hybrid=True, catalogue=True,
    elastic_refusal="a training job's instance count is fixed when it starts (SageMaker restarts a failed job "
                    "whole: --max-restarts)")
