"""What every target's launcher does the same way before its ranks start, written once:

    spec = prepared(spec, nodes=<the target's default>)   # script checked, name chosen, --nodes settled
    push_bytes = pickle_push(spec.push, push)             # kernel/push.py: --push refused, naming the variable
    job = create_job(spec, push_bytes, **target_facts)    # the job directory, status "pending"

Between those steps a target does its own checks (the SSH and Ray targets reach every host first),
and after them it starts its ranks. `--nodes` left out means "the target decides": the SSH target's
number of hosts, else 1; it is read here and nowhere else.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from sdp_jupyter import jobdir
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.options import SpecError
from sdp_jupyter.launch.spec import JobSpec


def prepared(spec: JobSpec, nodes: int = 1, **changes) -> JobSpec:
    """The spec with its script checked, its name chosen and its nodes settled (`nodes`: the
    target's default when --nodes was left out); `changes`: more fields the target settled."""
    if spec.script is not None and not Path(spec.script).is_file():
        raise SpecError("script", f"{spec.script} does not exist; give the path of a .py file")
    return spec.replace(name=spec.name or jobdir.new_job_name(), nodes=spec.nodes or nodes, **changes)


def create_job(spec: JobSpec, push_bytes: bytes | None, job_class: type[Job] = Job, *,
               supervised_here: bool = True, world_size: int | None = None, **status) -> Job:
    """The job directory of a prepared spec and its "pending" status. `supervised_here`: this process
    runs the ranks' supervisor (its pid goes in the status: a reader that finds the job running with
    that process gone reports it failed); a SageMaker job lives on without us. `status`: the target's
    own facts (hosts, the Ray address, the SageMaker request...)."""
    job_dir, spec = job_class.create_dir(spec, push_bytes)
    job = job_class(spec, job_dir)
    own = {"job_class": job_class.class_record()} if job_class is not Job else {}
    here = {"launcher_pid": os.getpid()} if supervised_here else {}
    job.update_status(state="pending", created=time.time(), started=None, ended=None, exit_codes=[], restarts=0,
                      error=None, target=spec.target, world_size=world_size or spec.world_size,
                      **own, **here, **status)
    return job
