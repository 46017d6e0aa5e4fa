"""The registry of targets' launchers: where each target's launcher lives, as "module:attribute"
strings imported when first used. A leaf: launch/__init__
dispatches `launch(target=...)` through it, so no module of the launch package imports a target by
name. (A job that reopens as its own class says so in its status.json: `Job.recorded_class`.)
"""
from __future__ import annotations

import importlib
import importlib.util

LAUNCHERS = {
    "local": "sdp_jupyter.launch.kernel.local:LocalLauncher",
    "ssh": "sdp_jupyter.launch.kernel.ssh:SSHLauncher",
    "ray": "sdp_jupyter.launch.kernel.ray:RayLauncher",
    "slurm": "sdp_jupyter.launch.kernel.slurm:SlurmLauncher",
    "sagemaker": "sdp_jupyter.launch.kernel.sagemaker.submit:SageMakerLauncher",
}


def load(where: str):
    """The attribute named by "module:attribute"; None when the module is not installed."""
    module_name, attribute = where.split(":")
    if importlib.util.find_spec(module_name) is None:
        return None
    return getattr(importlib.import_module(module_name), attribute, None)
