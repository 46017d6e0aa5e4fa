"""Instance types and who serves --backend smddp there (--engine): SageMaker's smdistributed
library on the types it supports, sdp_jupyter's engine elsewhere. (The hosts' GPU and CPU counts are
instance facts: sdp_jupyter.instances.host_counts.)"""
from __future__ import annotations

from sdp_jupyter.launch.options import SpecError


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
