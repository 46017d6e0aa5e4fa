"""Launch distributed jobs: JobSpec -> launcher -> Job. See docs/launcher.md and docs/jobs.md.

    job = sdp_jupyter.launch("train.py", nodes=4, backend="gloo")
    job.wait(); job.logs(0); job.result()

`launch` accepts a JobSpec, a path to a .py file, or `code="..."`, plus JobSpec fields as keywords.
`target=` names where it runs: this machine by default, SSH hosts, a Ray cluster, a Slurm cluster or
SageMaker, each one a folder of sdp_jupyter/launch/targets/ (TARGETS is the registry of them).
"""
from __future__ import annotations

import importlib
import sys
import types

# Loaded on first use, so that importing a rank's or a host agent's module (which runs this package's
# __init__ first) loads none of the kernel's code; `from sdp_jupyter.launch import Job` works as before.
_LAZY = {
    "Job": "sdp_jupyter.launch.kernel.job:Job",
    "JobError": "sdp_jupyter.launch.kernel.job:JobError",
    "LocalLauncher": "sdp_jupyter.launch.targets.local.launcher:LocalLauncher",
    "get_launcher": "sdp_jupyter.launch.kernel.api:get_launcher",
    "jobs": "sdp_jupyter.launch.kernel.api:jobs",
    "get_job": "sdp_jupyter.launch.kernel.api:get_job",
    "list_jobs": "sdp_jupyter.launch.kernel.api:list_jobs",
    "TARGETS": "sdp_jupyter.launch.targets:TARGETS",
    "JobSpec": "sdp_jupyter.launch.spec:JobSpec",
    "OPTIONS": "sdp_jupyter.launch.spec:OPTIONS",
    "Option": "sdp_jupyter.launch.options:Option",
    "SpecError": "sdp_jupyter.launch.options:SpecError",
}
__all__ = ["launch"] + sorted(_LAZY)


def __getattr__(name: str):
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'sdp_jupyter.launch' has no attribute {name!r}")
    module, attr = where.split(":")
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


class _LaunchModule(types.ModuleType):
    """This package is callable: `sdp_jupyter.launch(...)` starts a job (kernel/api.py's `launch`)
    and `sdp_jupyter.launch.get_job` is the package's function, whichever was imported first."""

    def __call__(self, spec_or_script: JobSpec | str | os.PathLike | None = None, *, push: dict | None = None,
                 **fields) -> Job:
        """Start a distributed job and return its Job handle at once (``job.wait()`` blocks).

        spec_or_script: a JobSpec, or the path of a .py file; or leave it out and pass code="...".
        fields: JobSpec fields (nodes=4, procs_per_node=2, backend="gloo", hyperparameters={...}, ...),
        overriding the spec's. A target's own options may be given by their key too:
        `launch(..., target="ray", address="h:6379")` is `ray={"address": "h:6379"}`, `hosts=[...]` is
        `ssh={"hosts": [...]}`.
        push: notebook values to send to every rank, by name ({"X": X}); the code sees them as globals.

        Example, two ranks on this machine:

            import sdp_jupyter
            job = sdp_jupyter.launch(code="import os\\nrank = int(os.environ['RANK'])\\n"
                                          "print('hello from rank', rank)\\nrank * 10",
                                     procs_per_node=2, backend="gloo")
            job.wait()      # 'succeeded'
            job.logs(1)     # 'hello from rank 1\\n'
            job.result()    # 0: rank 0's last expression

        Things to know:

        - It returns before the ranks start: `job.state` is "pending", then "running". `job.wait()`
          returns the final state (succeeded, failed or stopped) and raises only with
          raise_on_failure=True; `job.raise_for_state()` raises JobError for a failed or stopped job.
        - The ranks are separate processes (forked from the warm pool when one runs, else fresh
          interpreters): they see none of the notebook's variables unless they are pushed, and the
          kernel itself never imports torch.
        - Bad values raise SpecError (a ValueError naming the option and the fix) before anything starts.
        - Defaults: target "local", one node, one process per GPU of this machine (1 without a GPU),
          backend smddp.
        - Every job has a directory, named as the job, under jobs_dir= (else $SDP_JOBS_DIR, else
          ./sdp_jobs): its spec, status, every rank's log and metrics. `sdp_jupyter.get_job(name)`
          reopens it later.
        - A local job's ranks die with the process that launched them: restarting the kernel stops it.
        """
        api = importlib.import_module("sdp_jupyter.launch.kernel.api")
        return api.launch(spec_or_script, push=push, **fields)


sys.modules[__name__].__class__ = _LaunchModule
launch = sys.modules[__name__]  # `from sdp_jupyter.launch import launch` is this same callable
