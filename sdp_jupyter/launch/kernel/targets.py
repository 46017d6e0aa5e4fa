"""The registry of targets' launchers: where each target's launcher lives, as "module:attribute"
strings imported when first used; the rest of each target's record is launch/target_options.py's
TARGETS, under the same name (the launchers import the spec, which reads those records: naming the
launchers there would close an import cycle). launch/__init__ dispatches `launch(target=...)` through
it, so no module of the launch package imports a target by name. `register` adds a target to both.
(A job that reopens as its own class says so in its status.json: `Job.recorded_class`.)
"""
from __future__ import annotations

import importlib
import importlib.util

from sdp_jupyter.launch import target_options

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


def register(name: str, record: target_options.Target, launcher: str) -> None:
    """A new target: its record (target_options.Target) and its launcher ("module:Class"). Call it before
    the spec, the magics, the CLI or the form are imported: they derive their lists from the registry once."""
    if name in LAUNCHERS:
        raise ValueError(f"a target named {name!r} is registered already")
    target_options.register(name, record)
    LAUNCHERS[name] = launcher
