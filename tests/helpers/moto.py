"""Test glue on the AWS stand-in (sdp_jupyter.testing.sagemaker_standin): the module-scoped `aws`
fixture, and the stand-in's names re-exported for the tests that import them from here.

The server runs in the pytest process, so a test plays the part of SageMaker itself: it moves a
job through InProgress -> Training -> Completed/Failed (`MotoAWS.set_status`), writes the log
events the containers would print (`put_log_lines`) and the instance metrics the hosts would
publish (`put_host_metric`), or leaves that to `SageMakerStandIn`.
"""
from __future__ import annotations

import pytest

pytest.importorskip("moto.server")

from sdp_jupyter.testing.sagemaker_standin import (  # noqa: E402  (re-exported for the tests)
    ACCOUNT, BUCKET, LOG_GROUP, METRIC_NAMESPACE, REGION, ROLE, LocalContainers, MotoAWS, SageMakerStandIn,
    aws_environment, container_env, download_channel, moto_aws)

__all__ = ["ACCOUNT", "BUCKET", "LOG_GROUP", "METRIC_NAMESPACE", "REGION", "ROLE", "LocalContainers", "MotoAWS",
           "SageMakerStandIn", "aws_environment", "container_env", "download_channel", "moto_aws", "aws"]


@pytest.fixture(scope="module")
def aws(tmp_path_factory):
    with moto_aws(str(tmp_path_factory.mktemp("aws"))) as a:
        yield a
