"""The --push variables: pickled once in the notebook, loaded on every rank before its code runs.

Every target sends the same bytes (local: push.pkl in the job directory; SSH and Ray: in the agent's
start frame; SageMaker: in the source directory; a session: in the cell's frame).

Code defined in the notebook goes by value: cloudpickle (the library ipyparallel, Ray and Dask use)
pickles a function, class, lambda or closure whose module is `__main__` with its code and the
notebook globals it reads, so a rank can call it and unpickle instances of it; anything importable
(numpy, torch, a module of the user's) goes by reference, as plain pickle sends it. The rank binds
the pushed code to its own namespace (launch/rank/bootstrap.py: bind_pushed).

What cannot travel (an open file, a lock, a socket, a generator, a CUDA tensor) is refused here,
before anything starts, naming the variable, the part inside it that fails and the fix.
"""
from __future__ import annotations

import ast
import io
import pickle
import sys

import cloudpickle

from sdp_jupyter.launch.options import SpecError

AUTO_PUSH_FLAG = "--no-auto-push"


def pickle_push(names: list, values: dict) -> bytes | None:
    """Pickle the --push variables, or raise SpecError naming the one that is missing or unpicklable."""
    if not names:
        return None
    missing = [n for n in names if n not in values]
    if missing:
        raise SpecError("--push", f"variable {missing[0]!r} is not defined in the notebook; "
                                  "define it first or remove it from --push")
    chosen = {n: values[n] for n in names}
    try:
        return _dumps(chosen)  # once: a 100 MB array is pickled one time, not once to check and once to send
    except Exception:  # noqa: BLE001 - find which variable and which part of it, then say so
        pass
    for n in names:
        try:
            _dumps(values[n])
        except Exception as e:  # noqa: BLE001
            raise SpecError("--push", refusal(n, values[n], e)) from None
    raise SpecError("--push", "the variables pickle one by one but not together; push them in separate jobs "
                              "or cells and report this")


def notebook_code(cell: str, values: dict, pushed: list) -> list[str]:
    """The functions and classes defined in the notebook (module `__main__`) that `cell` reads without
    defining them itself or listing them in --push: what the magics send by value without being asked
    (a rank has no notebook, so without them the cell fails there with a NameError)."""
    try:
        tree = ast.parse(cell)
    except SyntaxError:
        return []
    read, bound = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    out = []
    for name in sorted(read - bound - set(pushed)):
        value = values.get(name)
        if (isinstance(value, type) or callable(value) and hasattr(value, "__code__")) \
                and getattr(value, "__module__", None) == "__main__":
            out.append(name)
    return out


def auto_push_line(names: list) -> str:
    """The job's first line when the magic sent notebook code it was not asked to."""
    return (f"[sdp_jupyter] sending {', '.join(names)} from the notebook by value (the cell uses "
            f"{'it' if len(names) == 1 else 'them'}); {AUTO_PUSH_FLAG} sends only what --push names")


def refusal(name: str, value, error: Exception) -> str:
    """Why `value` (the variable `name`) cannot be sent: the part inside it that fails, and the fix."""
    path, part, why = _find_part(name, value, 0) or (name, value, error)
    inside = "" if path == name else f": {path} is {_a(part)}"
    return (f"variable {name!r} ({type(value).__name__}) cannot be sent to the ranks{inside} "
            f"({type(why).__name__}: {why}). {_fix(part)}")


def _find_part(path: str, value, depth: int):
    """(path, part, error) of the innermost part of `value` that will not pickle, or None if it does."""
    try:
        _dumps(value)
        return None
    except Exception as e:  # noqa: BLE001
        error = e
    if depth < 6:
        for sub, child in _children(path, value):
            found = _find_part(sub, child, depth + 1)
            if found is not None:
                return found
    return path, value, error


def _children(path: str, value):
    if isinstance(value, dict):
        for k, v in list(value.items())[:1000]:
            yield f"{path}[{k!r}]", v
    elif isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(value)[:1000]):
            yield f"{path}[{i}]", v
    elif callable(value) and hasattr(value, "__code__"):  # a function: what it closes over, the globals it reads
        for cell_name, cell in zip(value.__code__.co_freevars, value.__closure__ or ()):
            try:
                yield f"{path} (closure variable {cell_name})", cell.cell_contents
            except ValueError:  # an empty cell
                pass
        names = _code_names(value.__code__)
        for g in sorted(names & set(getattr(value, "__globals__", {}))):
            yield f"{path} (global {g})", value.__globals__[g]
    elif isinstance(value, type):
        for k, v in vars(value).items():
            if callable(v) and hasattr(v, "__code__"):
                yield f"{path}.{k}", v
    elif hasattr(value, "__dict__"):
        for k, v in list(vars(value).items())[:1000]:
            yield f"{path}.{k}", v


def _code_names(code) -> set:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def _a(part) -> str:
    kind = type(part).__name__
    return ("an " if kind[:1].lower() in "aeiou" else "a ") + kind


def _fix(part) -> str:
    """The fix for one kind of thing that cannot travel."""
    kind = type(part)
    names = {c.__name__ for c in kind.__mro__}
    if isinstance(part, io.IOBase) or "IOBase" in names:
        return "Fix: push the file's path and open it on the ranks (in the cell)."
    if kind.__name__ in ("lock", "RLock", "Condition", "Event", "Semaphore", "BoundedSemaphore"):
        return "Fix: make the lock on the ranks (in the cell); a lock is of one process."
    if "socket" in names:
        return "Fix: open the connection on the ranks (in the cell), or push its address."
    if kind.__name__ in ("generator", "coroutine", "async_generator") or hasattr(part, "__next__"):
        return "Fix: push a list of its items, or the function that makes it and call it on the ranks."
    if _is_cuda_tensor(part):
        return "Fix: push tensor.cpu() and move it to the rank's device there (.to(device))."
    return "Fix: make it on the ranks (in the cell), or push the plain data it is made from."


def _is_cuda_tensor(obj) -> bool:
    torch = sys.modules.get("torch")  # the kernel never imports torch: a tensor here means the notebook did
    return torch is not None and isinstance(obj, torch.Tensor) and obj.is_cuda


class _PushPickler(cloudpickle.Pickler):
    """cloudpickle, refusing a CUDA tensor (its pickle names a device the rank may not have or share)
    and an open file."""

    def reducer_override(self, obj):
        if _is_cuda_tensor(obj):
            raise pickle.PicklingError(f"a CUDA tensor on {obj.device} carries its device")
        # cloudpickle would send a file open for reading as a copy of its contents: the rank's file is
        # then not the file (no seek, no reading what is appended); an in-memory buffer is plain data
        if isinstance(obj, io.IOBase) and not isinstance(obj, (io.BytesIO, io.StringIO)):
            raise pickle.PicklingError(f"an open file ({getattr(obj, 'name', type(obj).__name__)}) is of this process")
        return super().reducer_override(obj)


def _dumps(value) -> bytes:
    buffer = io.BytesIO()
    _PushPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()
