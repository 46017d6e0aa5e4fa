"""sdp_jupyter: distributed data-parallel training from a Jupyter notebook.

Importing the package is cheap: it imports neither torch nor ipywidgets. The public names below
are loaded on first use.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"  # the only place the version is written: pyproject.toml reads it; CHANGELOG.md

# public name -> "module:attribute" ("module:" for the module itself)
_LAZY = {
    "launch": "sdp_jupyter.launch:launch",
    "run": "sdp_jupyter.launch.kernel.run_function:run",
    "session": "sdp_jupyter.launch.kernel.session:session",
    "Session": "sdp_jupyter.launch.kernel.session:Session",
    "Job": "sdp_jupyter.launch:Job",
    "JobSpec": "sdp_jupyter.launch:JobSpec",
    "get_job": "sdp_jupyter.launch:get_job",
    "list_jobs": "sdp_jupyter.launch:list_jobs",
    "report": "sdp_jupyter.monitor.reporter:report",
    "timed": "sdp_jupyter.monitor.reporter:timed",
    "checkpoint": "sdp_jupyter.checkpoint:",
    "dashboard": "sdp_jupyter.ui.dashboard:dashboard",
    "JobSetup": "sdp_jupyter.jobsetup:JobSetup",
    "AdvisorView": "sdp_jupyter.ui.advisor:AdvisorView",
}

__all__ = sorted(_LAZY) + ["load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str):
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'sdp_jupyter' has no attribute {name!r}")
    module_name, attr = target.split(":")
    module = importlib.import_module(module_name)
    value = getattr(module, attr) if attr else module
    globals()[name] = value
    return value


def load_ipython_extension(ipython):
    """`%load_ext sdp_jupyter` registers %%sdp_train and friends."""
    from sdp_jupyter.magics import load_ipython_extension as _load

    _load(ipython)


def unload_ipython_extension(ipython):
    """`%unload_ext sdp_jupyter`: nothing to undo (the magics stay registered, jobs keep running)."""
    from sdp_jupyter.magics import unload_ipython_extension as _unload

    _unload(ipython)
