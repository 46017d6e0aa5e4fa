"""`sdp_jupyter.run(fn, args, kwargs, nodes=...)`: a job whose code is a function (accelerate's
notebook_launcher, Ray Train's train_func). The function, its arguments and the notebook code they
use go by value (launch/kernel/push.py); every rank calls it once the default process group is up
(launch/rank/function_call.py) and the return values come back in rank order as the job's result.
"""
from __future__ import annotations

from sdp_jupyter.launch.kernel import api
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.options import SpecError
from sdp_jupyter.launch.rank.function_call import CALL, SCRIPT
from sdp_jupyter.launch.spec import JobSpec


def run(fn, args=(), kwargs: dict | None = None, *, wait: bool = True, push: dict | None = None, **fields):
    """Run `fn(*args, **kwargs)` on every rank of a new job and return the ranks' return values as a list
    in rank order.

    fields: every keyword `sdp_jupyter.launch` takes (nodes=2, procs_per_node=2, backend="gloo",
    target="ssh", hosts=[...], env={...}, timeout=..., ...): the job is an ordinary job, with a directory,
    logs and a view. The default process group is made with the job's backend (smddp unless said) before
    `fn` runs, so `fn` calls torch.distributed at once. `fn` may be defined in the notebook, a lambda or
    a closure: it goes by value with the notebook globals it reads; its return value must pickle.

    wait=False returns the Job at once; `job.wait()` then `job.result()` gives the same list.
    A rank's exception fails the job: JobError here, with that rank's traceback (ranks that raised the
    same error are named together). Ctrl-C while waiting stops the job.
    """
    if not callable(fn):
        raise TypeError(f"run: {fn!r} is not callable; pass the function itself, e.g. run(train, args=(cfg,))")
    for own in ("code", "script", "init_process_group"):
        if own in fields:
            raise SpecError(own, "run() makes the job's code from the function and always makes the process "
                                 f"group first. Fix: leave {own}= out (or use sdp_jupyter.launch for a script)")
    fields = api.target_keywords(fields)
    values = {**(push or {}), CALL: (fn, tuple(args), dict(kwargs or {}))}
    spec = JobSpec(code=SCRIPT, init_process_group=True, **fields)
    spec = spec.replace(push=[n for n in spec.push if n != CALL] + [CALL])
    job = api.launch(spec, push=values)
    if not wait:
        return job
    wait_shown(job)
    return job.result()


def wait_shown(job: Job) -> None:
    """Block until `job` ends, showing it as it runs (its live view in a notebook, its output in a
    terminal); Ctrl-C stops it; raise JobError if it failed or was stopped."""
    from sdp_jupyter._display import widgets_enabled
    from sdp_jupyter.launch.kernel.job import JobError

    widget = widgets_enabled()
    if widget:
        from IPython.display import display

        view = job.view()
        view.error_below = True  # the JobError raised below carries the error: the view does not repeat it
        display(view)
    try:
        if widget:
            job.wait()
        else:
            job.follow()
    except KeyboardInterrupt:
        job.stop()
        print(job.summary())
        raise JobError(f"job {job.name} was stopped (Ctrl-C); its logs are in {job.dir / 'logs'}", job) from None
    print(job.summary(error=False))  # raise_for_state's JobError says the error, once
    job.raise_for_state()
