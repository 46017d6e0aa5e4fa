"""The AWS side of a submission: the boto3 session, and the role, output bucket and training image
the SageMaker session resolves for a plan."""
from __future__ import annotations

from typing import TYPE_CHECKING

from sdp_jupyter.launch.options import SpecError
from sdp_jupyter.launch.targets.sagemaker.options import validate_request

if TYPE_CHECKING:
    from sdp_jupyter.launch.targets.sagemaker.plan import Plan


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
