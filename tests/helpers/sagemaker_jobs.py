"""What the SageMaker tests share: specs, waiting, the request as moto received it, the S3 keys and
channels the SDK writes (tests/launch/targets/sagemaker/)."""
from __future__ import annotations

import json
import time

from helpers.moto import BUCKET, ROLE, MotoAWS

from sdp_jupyter.launch import JobSpec

IMAGE_230_GPU = "763104351884.dkr.ecr.us-west-2.amazonaws.com/pytorch-training:2.3.0-gpu-py311"
SDK_ENTRY = ["/bin/bash"]
SDK_ARGS = ["-c", "chmod +x /opt/ml/input/data/sm_drivers/sm_train.sh && /opt/ml/input/data/sm_drivers/sm_train.sh"]
CELL = "import os\nprint('rank', os.environ.get('RANK'))\n"


def make_spec(tmp_path, name, **kw) -> JobSpec:
    options = {"role": ROLE, "bucket": BUCKET, "poll_interval": 0.1}
    options.update(kw.pop("sagemaker", {}))
    return JobSpec(code=kw.pop("code", CELL), name=name, target="sagemaker", jobs_dir=str(tmp_path / "jobs"),
                   sagemaker=options, **kw)


def wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def wire_request() -> dict:
    """The newest CreateTrainingJob body that reached the server."""
    assert MotoAWS.create_requests, "no CreateTrainingJob reached the server"
    return MotoAWS.create_requests[-1]


def s3_json(aws, uri_prefix: str, name: str) -> dict:
    bucket, _, key = uri_prefix[len("s3://"):].partition("/")
    body = aws.client("s3").get_object(Bucket=bucket, Key=f"{key}/{name}")["Body"].read()
    return json.loads(body)


def s3_keys(aws, uri_prefix: str) -> set:
    bucket, _, key = uri_prefix[len("s3://"):].partition("/")
    pages = aws.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key + "/")
    return {o["Key"][len(key) + 1:] for p in pages for o in p.get("Contents", [])}


def sdk_channels(base: str, job_name: str) -> list:
    prefix = f"s3://{BUCKET}/{base}/{job_name}/input"
    return [{"ChannelName": ch, "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": f"{prefix}/{ch}", "S3DataDistributionType": "FullyReplicated"}},
        "InputMode": "File"} for ch in ("code", "sm_drivers")]


def channel(name: str, uri: str) -> dict:
    return {"ChannelName": name, "DataSource": {"S3DataSource": {
        "S3DataType": "S3Prefix", "S3Uri": uri, "S3DataDistributionType": "FullyReplicated"}}, "InputMode": "File"}


def expected_environment(backend: str, base: str, nodes: int, **extra) -> dict:
    return {**extra, "SDP_BACKEND": backend, "SDP_JOB_NAME": base, "SDP_NUM_NODES": str(nodes),
            "SDP_CHECKPOINT_DIR": "/opt/ml/checkpoints", "PYTHONUNBUFFERED": "1"}
