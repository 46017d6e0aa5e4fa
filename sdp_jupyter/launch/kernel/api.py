"""What `sdp_jupyter.launch(...)`, `get_job` and `list_jobs` do (the package `sdp_jupyter.launch` is a
lazy, callable face for these; see its docstring): dispatch a JobSpec to its target's launcher and
keep this process's jobs by name.
"""
from __future__ import annotations

import os
import threading

from sdp_jupyter import jobdir
from sdp_jupyter.launch import targets
from sdp_jupyter.launch.kernel.job import Job, JobError
from sdp_jupyter.launch.spec import JobSpec, SpecError


_JOBS: dict[str, Job] = {}  # jobs launched by this process, by name (latest last)
_JOBS_LOCK = threading.Lock()


def get_launcher(target: str):
    """The launcher object for `target` (a registered target: launch/targets/)."""
    if target not in targets.TARGETS:
        raise SpecError("--target", f"{target!r} is not one of {', '.join(targets.TARGETS)}")
    where = targets.launcher_path(target)
    cls = targets.load(where)
    if cls is None:
        raise SpecError("--target", f"{target} is not available in this installation "
                                    f"({where} is missing). Fix: --target {targets.DEFAULT_TARGET}")
    return cls()


def launch(spec_or_script: JobSpec | str | os.PathLike | None = None, *, push: dict | None = None,
           **fields) -> Job:
    """`sdp_jupyter.launch(...)`: what it takes is in that callable's docstring (launch/__init__.py)."""
    fields = target_keywords(fields)
    if isinstance(spec_or_script, JobSpec):
        spec = spec_or_script.replace(**fields) if fields else spec_or_script
    elif spec_or_script is not None:
        spec = JobSpec(script=str(spec_or_script), **fields)
    else:
        spec = JobSpec(**fields)
    if push and not spec.push:
        spec = spec.replace(push=list(push))
    job = get_launcher(spec.target).start(spec, push=push)
    with _JOBS_LOCK:
        _JOBS.pop(job.name, None)
        _JOBS[job.name] = job
    return job


def target_keywords(fields: dict) -> dict:
    """Move keywords that name a key of a dict field (`address` -> ray["address"], `hosts` ->
    ssh["hosts"], `instance_type` -> sagemaker["instance_type"]) into that field; a key two fields
    share is left alone (JobSpec then names it as unknown)."""
    from dataclasses import fields as dc_fields

    from sdp_jupyter.launch.spec import all_options

    known = {f.name for f in dc_fields(JobSpec)}
    owners: dict[str, set[str]] = {}
    for opt in all_options():
        if opt.field and "." in opt.field:
            top, key = opt.field.split(".", 1)
            owners.setdefault(key, set()).add(top)
    out = dict(fields)
    for key in [k for k in fields if k not in known and len(owners.get(k, ())) == 1]:
        top = next(iter(owners[key]))
        JobSpec.put_target_options(out, top, {key: out.pop(key)})
    return out


def jobs() -> list[Job]:
    """Jobs launched by this process, oldest first."""
    with _JOBS_LOCK:
        return list(_JOBS.values())


def get_job(name: str | None = None, root: str | os.PathLike | None = None) -> Job:
    """A job of this process by name (the latest if name is None), else reopened from disk."""
    with _JOBS_LOCK:
        if name is None:
            if not _JOBS:
                raise JobError("no job has been launched in this kernel yet")
            return list(_JOBS.values())[-1]
        if name in _JOBS:
            return _JOBS[name]
    return Job.open(name, root)


def list_jobs(root: str | os.PathLike | None = None) -> list[Job]:
    """This process's jobs plus every job found under the jobs root, oldest first."""
    mine = {job.dir: job for job in jobs()}
    found = [mine.pop(d, None) or Job.open(d) for d in jobdir.list_job_dirs(root)]
    return found + [j for j in mine.values() if j.dir.exists()]
