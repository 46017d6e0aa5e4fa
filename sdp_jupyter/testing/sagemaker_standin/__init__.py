"""A local stand-in for AWS and SageMaker: a moto server on 127.0.0.1 plus a thread that plays
SageMaker by running each training job's hosts on this machine (docs/sagemaker.md, "Without AWS").

Needs the optional extra ``sdp_jupyter[rehearse]``: moto[server], boto3 and, for the launcher
itself, the SageMaker SDK (it includes ``sdp_jupyter[sagemaker]``).

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

The package: server (the moto server, its patches, `MotoAWS`, `moto_aws`, `pointed_at`), containers
(the SageMaker player: `LocalContainers`, `SageMakerStandIn`, `container_env`, `image_without`) and,
here, the one stand-in of this process (`start`, `shared`, `LocalSageMaker`). Every name is
re-exported here.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import threading
from dataclasses import dataclass

from sdp_jupyter.testing.sagemaker_standin.containers import (LocalContainers, SageMakerStandIn, container_env,
                                                                    download_channel, image_without)
from sdp_jupyter.testing.sagemaker_standin.server import (ACCOUNT, BUCKET, LOG_GROUP, METRIC_NAMESPACE, REGION,
                                                                ROLE, MotoAWS, aws_environment, moto_aws, patch_moto,
                                                                pointed_at)

__all__ = ["ACCOUNT", "BUCKET", "LOG_GROUP", "METRIC_NAMESPACE", "REGION", "ROLE", "LocalContainers", "LocalSageMaker",
           "MotoAWS", "SageMakerStandIn", "aws_credentials_found", "aws_environment", "container_env",
           "download_channel", "image_without", "moto_aws", "patch_moto", "pointed_at", "shared", "start"]


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


@atexit.register
def _close_at_exit() -> None:
    """Stop a stand-in still running as the process ends (a rehearsal's lives that long), while its server's
    thread still runs: left to the garbage collector, moto's shutdown waited forever for a thread the
    interpreter had already frozen, and `sdp-train --rehearse` never exited."""
    with _running_lock:
        running = _running
    if running is not None:
        with contextlib.suppress(Exception):
            running.close()


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
