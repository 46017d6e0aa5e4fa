"""The one registry of targets: where each target's launcher (and, where a target has its own, its
Job class) lives, as "module:attribute" strings imported when first used. A leaf: launch/__init__
dispatches `launch(target=...)` through it and `Job.open` reopens a target's job through it, so no
module of the launch package imports a target by name.
"""
from __future__ import annotations

import importlib
import importlib.util

LAUNCHERS = {
    "local": "sdp_jupyter.launch.kernel.local:LocalLauncher",
    "ssh": "sdp_jupyter.launch.kernel.ssh:SSHLauncher",
    "ray": "sdp_jupyter.launch.kernel.ray:RayLauncher",
    "sagemaker": "sdp_jupyter.launch.kernel.sagemaker.submit:SageMakerLauncher",
}
# Targets whose jobs need their own class when reopened (remote state, one log per host).
JOB_CLASSES = {
    "sagemaker": "sdp_jupyter.launch.kernel.sagemaker.job:SageMakerJob",
}


def load(where: str):
    """The attribute named by "module:attribute"; None when the module is not installed."""
    module_name, attribute = where.split(":")
    if importlib.util.find_spec(module_name) is None:
        return None
    return getattr(importlib.import_module(module_name), attribute, None)
