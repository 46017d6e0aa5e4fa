"""Worker bootstrap: `python -m sdp_jupyter.launch.rank.worker`, started by LocalLauncher once per rank.

It arms the parent-death signal (the worker dies if the kernel dies), makes the `smddp` backend
available when the job asks for it, loads the variables sent with --push, and runs the job's script
as `__main__` with the job's arguments. Rank 0 pickles the value of the script's last expression
into result.pkl (what `--result` / `job.result()` return). Loading the push, running the script,
saving the result and trimming tracebacks are launch/rank/bootstrap.py's, shared with the SageMaker entry.

Everything it needs comes from the environment set by the launcher and from spec.json. With
`--module M args...` it runs module M instead (after arming the same parent-death signal).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import traceback

from sdp_jupyter.launch.process import arm_parent_death_signal
from sdp_jupyter.launch.rank.bootstrap import (arm_crash_report, finish_distributed, job_backend, load_push, run_script,
                                               save_result, user_frames, watch_backend)

_STACKS: list = []  # the stacks file, open for the process's life (launch/rank/stack_signal.py)


def script_arguments(spec: dict) -> list[str]:
    """The script's argv[1:]: --args, then each hyperparameter as --KEY VALUE (SageMaker's convention)."""
    argv = [str(a) for a in spec.get("args") or []]
    for key, value in (spec.get("hyperparameters") or {}).items():
        argv += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return argv


def _load_backend(backend: str) -> None:
    if backend != "smddp":
        return
    try:
        import sdp_jupyter.torch  # noqa: F401  registers the "smddp" torch.distributed backend
    except ImportError as e:
        print(f"[sdp_jupyter] warning: the smddp backend is not available ({e}); "
              "init_process_group('smddp') will fail. Run with --backend gloo", file=sys.stderr)


def run_module() -> int:
    """`python -m sdp_jupyter.launch.rank.worker --module M ARGS...`: a job's helper process (the per-node
    sampler) that must not outlive the launcher either."""
    import runpy

    arm_parent_death_signal()
    module = sys.argv[2]
    sys.argv = [module] + sys.argv[3:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


def main() -> int:
    # A kernel started with SIGINT ignored (nohup, a background job, some container entrypoints)
    # passes SIG_IGN on to its children, and Python then installs no KeyboardInterrupt handler:
    # Stop's SIGINT would do nothing. A rank always takes SIGINT as Ctrl-C.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.argv[1:2] == ["--module"]:
        return run_module()
    arm_parent_death_signal()
    arm_crash_report()
    job_dir = os.environ["SDP_JOB_DIR"]
    from sdp_jupyter.launch.rank import stack_signal

    _STACKS.append(stack_signal.arm(job_dir, int(os.environ.get("RANK", "0"))))  # its Python stacks on request
    from sdp_jupyter import jobdir

    with open(os.path.join(job_dir, jobdir.SPEC)) as f:
        spec = json.load(f)
    backend = job_backend(spec)
    _load_backend(backend)
    if watch_backend(spec, backend):
        return 1
    push = load_push(os.path.join(job_dir, jobdir.PUSH))
    from sdp_jupyter._env import env_str

    rank = int(os.environ.get("RANK", "0"))
    heal = bool(env_str("SDP_HEAL"))
    if heal:
        from sdp_jupyter.heal import refuse_own_groups

        refuse_own_groups()
    try:
        value = run_script(os.environ["SDP_SCRIPT"], script_arguments(spec), push, want_result=rank == 0 or heal)
    except SystemExit as e:
        finish_distributed()
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # the launcher stops ranks with SIGINT first: say where, briefly
        frames = traceback.extract_tb(user_frames(e.__traceback__, __file__))
        where = f" at {frames[-1].filename}, line {frames[-1].lineno}" if frames else ""
        print(f"[sdp_jupyter] rank {os.environ.get('RANK', '?')} interrupted (SIGINT){where}", file=sys.stderr)
        sys.stderr.flush()
        flight = sys.modules.get("sdp_jupyter.comm.recorder")  # only a rank that made an smddp group has one
        if flight is not None:
            flight.dump_all("stopped")
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)  # exit status: killed by SIGINT, as without us
        return 1
    except BaseException as e:
        traceback.print_exception(type(e), e, user_frames(e.__traceback__, __file__))
        sys.stderr.flush()
        return 1
    code = 0
    if value is not None and rank == _result_rank(job_dir, heal):
        code = save_result(job_dir, value, required=bool(spec.get("result")))
    finish_distributed()
    return code


def _result_rank(job_dir: str, heal: bool) -> int:
    """The rank that saves the script's value: rank 0; in a --heal job the first member of the last
    membership, a rank that lived through every change (rank 0 unless it died, and then also when its
    replacement came after training ended and left without training)."""
    if not heal:
        return 0
    from sdp_jupyter import jobdir

    record = jobdir.newest_heal_record(job_dir)
    return int(record["members"][0]) if record else 0


def fast_exit(code: int) -> None:
    """Exit as a normal interpreter exit would, minus its teardown of every module and object.

    With torch loaded that teardown takes seconds per rank, all of it after the job's work is done.
    Non-daemon threads are joined, atexit handlers run and every open file is flushed first, so
    nothing a script wrote is lost. SDP_FAST_EXIT=0 turns this off.
    """
    from sdp_jupyter._env import env_bool

    if not env_bool("SDP_FAST_EXIT", True):
        sys.exit(code)
    import _io
    import atexit
    import gc
    import threading

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # already exiting: a stop's SIGINT must not interrupt that
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None:
        shutdown()
    atexit._run_exitfuncs()
    for obj in gc.get_objects():
        # type(): never trips a module's deprecation __getattr__. _io._IOBase, the C base every io class
        # derives from, not the ABC io.IOBase: with torch loaded (170,000 objects, 500 types), the ABC's
        # subclass check of each new type cost 0.15 s a rank, this 0.03 s
        if issubclass(type(obj), _io._IOBase):
            try:
                if not obj.closed and obj.writable():
                    obj.flush()
            except Exception:
                pass
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    os._exit(code)


if __name__ == "__main__":
    fast_exit(main())
