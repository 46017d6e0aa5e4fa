"""What every rank runs first, on every target: the pushed variables loaded, the job's script run as
`__main__`, the backend it really uses recorded (and with --init-process-group the default
group made first), rank 0's result saved, tracebacks trimmed to the user's frames, the process group closed.

One implementation for the local worker (launch/rank/worker.py, also what the SSH and Ray agents start)
and the SageMaker container entry (launch/targets/sagemaker/entry.py); each adds only what its place needs
(the worker: the parent-death signal and Ctrl-C; the entry: SageMaker's variables and failure file).
"""
from __future__ import annotations

import ast
import os
import pickle
import sys
import types
from sdp_jupyter import backends


def arm_crash_report() -> None:
    """A rank killed by a signal leaves its story in its log: the crashing thread's name and native
    frames (the engine's handler, sdp/crash.h), then every thread's Python stack (faulthandler), so
    the job's error can say which collective was running (launch/kernel/rank_report.py: crash_summary)."""
    import faulthandler

    faulthandler.enable(file=sys.stderr, all_threads=True)
    try:
        from sdp_jupyter import _engine
    except ImportError:  # no engine built (a gloo-only install): Python stacks only
        return
    _engine.install_crash_report()


def load_push(path: str, checked: bool = True) -> dict:
    """The variables sent with --push (`path`: push.pkl), {} when there is none. `checked`: unpickle
    only a file that is ours and nobody else can write (jobdir.load_pickle); the SageMaker entry
    reads its own download of the job's code channel unchecked."""
    if not os.path.exists(path):
        return {}
    if checked:
        from sdp_jupyter.jobdir import load_pickle

        return load_pickle(path)
    with open(path, "rb") as f:
        return pickle.load(f)


def bind_pushed(values: dict, ns: dict) -> None:
    """Put the pushed variables into the rank's namespace `ns` (its `__main__`). Code that came by value
    (a function, class or closure defined in the notebook: launch/kernel/push.py) is bound to `ns`, so it
    reads the rank's variables as code written in the cell would; the notebook globals it was sent with
    fill only the names `ns` lacks (a rank's own `model` is never replaced by the notebook's)."""
    memo: dict = {}
    for name, value in values.items():
        ns[name] = _bound(value, ns, memo)


def _bound(value, ns: dict, memo: dict):
    """`value` with the notebook code in it bound to `ns` (functions copied, classes changed in place)."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, types.FunctionType) and value.__module__ == "__main__" and value.__globals__ is not ns:
        copy = types.FunctionType(value.__code__, ns, value.__name__, value.__defaults__, value.__closure__)
        memo[id(value)] = copy
        copy.__kwdefaults__, copy.__qualname__, copy.__doc__ = value.__kwdefaults__, value.__qualname__, value.__doc__
        copy.__dict__.update(value.__dict__)
        copy.__annotations__ = value.__annotations__
        for g, v in value.__globals__.items():  # the notebook globals it reads, itself and its helpers among them
            if not g.startswith("__") and g not in ns:
                ns[g] = _bound(v, ns, memo)
        return copy
    if type(value) is tuple:  # sdp_jupyter.run's and Session.apply's (fn, args, kwargs) among them
        memo[id(value)] = value
        memo[id(value)] = bound = tuple(_bound(v, ns, memo) for v in value)
        return bound
    kind = value if isinstance(value, type) else type(value)
    if kind.__module__ == "__main__" and id(kind) not in memo:  # a notebook class, or an instance of one
        memo[id(kind)] = kind
        for attr, member in list(vars(kind).items()):
            inner = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
            if isinstance(inner, types.FunctionType):
                new = _bound(inner, ns, memo)
                setattr(kind, attr, type(member)(new) if inner is not member else new)
            elif isinstance(member, property):
                setattr(kind, attr, property(*(f and _bound(f, ns, memo) for f in (member.fget, member.fset,
                                                                                   member.fdel)), member.__doc__))
    memo[id(value)] = value
    return value


def job_backend(spec: dict) -> str:
    """The backend this rank's job asked for: $SDP_BACKEND (the launcher sets it from --backend; a
    SageMaker request carries it), else the spec's, else smddp."""
    return backends.job_backend(None) or spec.get("backend") or backends.DEFAULT


def watch_backend(spec: dict, backend: str) -> int:
    """Record which backend this rank really uses (launch/rank/backend_check.py); with --init-process-group,
    make the default group with `backend` now. 1 when that failed (the error is printed), else 0."""
    from sdp_jupyter.launch.rank import backend_check

    try:
        backend_check.prepare(spec, backend)
    except Exception as e:  # noqa: BLE001 - named, with the option that asked for it
        print(f"[sdp_jupyter] {backend_check.OPTION}: init_process_group({backend!r}) failed on rank "
              f"{os.environ.get('RANK', '?')}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


def run_script(path: str, argv: list[str], push: dict, want_result: bool):
    """Run `path` as __main__ (like `python path argv...`); return its last expression's value."""
    with open(path, "rb") as f:
        body, last = compile_parts(f.read(), path, want_result)
    main = types.ModuleType("__main__")
    main.__dict__.update({"__file__": path, "__builtins__": __builtins__, "__cached__": None})
    bind_pushed(push, main.__dict__)
    sys.modules["__main__"] = main
    sys.argv = [path] + argv
    script_dir = os.path.dirname(os.path.abspath(path))
    sys.path[:0] = [p for p in (script_dir, os.getcwd()) if p not in sys.path[:2]]
    exec(body, main.__dict__)
    return eval(last, main.__dict__) if last is not None else None


def compile_parts(source, filename: str, want_last: bool):
    """`source` compiled as (body, last): with `want_last` and a final expression, that expression
    apart (its value is the result, as a notebook cell's is), else (everything, None)."""
    tree = ast.parse(source, filename=filename)
    last = None
    if want_last and tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body.pop().value), filename, "eval")
    return compile(tree, filename, "exec"), last


def save_result(job_dir: str, value, required: bool) -> int:
    """Pickle rank 0's result into job_dir/result.pkl; the exit code (1 when it cannot be pickled
    and --result asked for it)."""
    from sdp_jupyter import jobdir

    try:
        jobdir.write_private(os.path.join(job_dir, jobdir.RESULT), _result_bytes(value))
    except Exception as e:
        print(f"[sdp_jupyter] rank 0's result ({type(value).__name__}) could not be pickled: {e}",
              file=sys.stderr)
        return 1 if required else 0
    return 0


class _PlainPickler(pickle.Pickler):
    """Plain pickle, refusing what only this rank could load: a class or function of the script's
    `__main__` (the cell's, or notebook code that came by value), which pickle sends by reference."""

    def reducer_override(self, obj):
        owner = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
        if getattr(owner, "__module__", None) == "__main__":
            raise pickle.PicklingError("defined in __main__")
        return NotImplemented


def _result_bytes(value) -> bytes:
    """The result's pickle: plain data as plain pickle; anything holding the cell's own classes or
    functions by value (cloudpickle, 90 ms to import on a cold rank: only when needed)."""
    import io

    buffer = io.BytesIO()
    try:
        _PlainPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return buffer.getvalue()
    except pickle.PicklingError:
        import cloudpickle

        return cloudpickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def finish_distributed() -> None:
    """Destroy the default process group if the script left one (a clean exit for every backend)."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass


def user_frames(tb, *ours: str):
    """Start the traceback at the script's frames: the bootstrap (this file and the `ours` files
    of the caller) is not the user's problem."""
    skip = {os.path.abspath(p) for p in (__file__, *ours)}
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in skip:
        tb = tb.tb_next
    return tb
