"""The --push variables: pickled once in the notebook, loaded on every rank before its code runs.

Every target sends the same bytes (local: push.pkl in the job directory; SSH and Ray: in the agent's
start frame; SageMaker: in the source directory). Refused here, naming the variable, is what a rank
could not load.
"""
from __future__ import annotations

import io
import pickle

from sdp_jupyter.launch.options import SpecError


def pickle_push(names: list, values: dict) -> bytes | None:
    """Pickle the --push variables, or raise SpecError naming the one that is missing or unpicklable."""
    if not names:
        return None
    missing = [n for n in names if n not in values]
    if missing:
        raise SpecError("--push", f"variable {missing[0]!r} is not defined in the notebook; "
                                  "define it first or remove it from --push")
    for n in names:
        try:
            _dumps(values[n])
        except Exception as e:
            raise SpecError("--push", f"variable {n!r} ({type(values[n]).__name__}) cannot be pickled ({e}); "
                                      "push plain data (arrays, lists, dicts) instead") from None
    return _dumps({n: values[n] for n in names})


class _PushPickler(pickle.Pickler):
    """Refuses what only the notebook can unpickle: classes and functions defined in __main__ are
    pickled by reference, and a worker's __main__ is the script, so they would fail there."""

    def reducer_override(self, obj):
        owner = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
        if getattr(owner, "__module__", None) == "__main__":
            raise pickle.PicklingError(f"{getattr(owner, '__qualname__', owner)} is defined in the notebook, "
                                       "so the workers cannot load it; define it in the cell or a module")
        return NotImplemented


def _dumps(value) -> bytes:
    buffer = io.BytesIO()
    _PushPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()
