"""Which backend the ranks really used, and whether they ever talked (docs/integrations.md, docs/jobs.md).

A job asks for a backend (`--backend`, default smddp), but the script decides: an unchanged Hugging
Face Trainer script builds a gloo group itself, and one without `use_cpu=True` builds none and every
rank trains alone. So each rank reports what it did, and the launcher compares.

Worker side (`prepare`, called by the worker before the script):
- torch.distributed is watched, not changed: before any group is destroyed (by the script or by the
  worker at the end) and at exit, each group's backend and the collectives run on it are noted, and
  at exit one `{"kind": "backend", ...}` line goes to metrics/rank-R.jsonl (the file every target
  already brings back to the notebook). Collectives are counted by the engine for smddp (its stats,
  every group and `sdp_jupyter.comm` included) and by torch's per-group sequence number for gloo and
  nccl, which counts the collectives DDP's C++ reducer runs too; other backends are not counted.
- with `--init-process-group` the default group is created with the job's backend before the script
  runs. A later `init_process_group` of the script then returns at once with a one-line note when
  it asks for that backend or none; asking for another backend raises ValueError naming the option.

Launcher side (launch/kernel/backend_verdict.py): `verdict(job_dir, asked, world_size)` reads those
lines when the job ends and gives the status fields `backend_used`, `collectives` and `warnings`.

Torch is never imported here for a job that does not import it: when the worker starts before torch
is loaded, the watch is installed by an import hook that fires when torch.distributed loads.
"""
from __future__ import annotations

import atexit
import functools
import importlib.abc
import os
import sys
import threading

from sdp_jupyter._env import env_int

C10D = "torch.distributed.distributed_c10d"
KIND = "backend"  # the metrics lines' kind (docs/jobs.md)
OPTION = "--init-process-group"

_lock = threading.Lock()
_defaults: list[str] = []          # backends of the default groups this rank created, in order
_groups: dict[str, int] = {}       # backend -> groups seen (default and subgroups)
_seq: dict[str, int] = {}          # backend -> collectives counted by torch's sequence numbers
_uncounted: set[str] = set()       # backends with a group whose collectives could not be counted
_launcher: dict = {}               # {"backend": ...} once --init-process-group made the default group
_default_sizes: list[int] = []     # ranks in each default group this rank created, in order


# ---------------------------------------------------------------------------------------------- worker side
def prepare(spec: dict, backend: str) -> None:
    """Before the script: watch torch.distributed for the end report; with --init-process-group
    (spec["init_process_group"]) create the default group with `backend` now."""
    c10d = sys.modules.get(C10D)
    if c10d is not None:
        _patch(c10d)
    else:
        sys.meta_path.insert(0, _PatchOnImport())
    atexit.register(report)
    if spec.get("init_process_group"):
        init_default_group(backend)


def init_default_group(backend: str) -> None:
    """`init_process_group(backend)` from the environment (env://), as the script would."""
    import torch
    import torch.distributed as dist

    if backend == "smddp" and "smddp" not in dist.Backend.backend_list:
        import sdp_jupyter.torch  # noqa: F401  registers ours (on SageMaker the entry has registered one)
    if backend == "nccl" and torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    _patch(sys.modules[C10D])
    dist.init_process_group(backend)
    _launcher["backend"] = dist.get_backend()


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Installs the watch when torch.distributed's c10d module has loaded (first `import torch`)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != C10D:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        real = loader.exec_module

        def exec_module(module):
            real(module)
            if module.__name__ == C10D:
                _patch(module)

        loader.exec_module = exec_module
        return spec


def _replace(c10d, name: str, new) -> None:
    """Put `new` in place of c10d.<name>, and of torch.distributed.<name> when that is the same function."""
    old = getattr(c10d, name)
    setattr(c10d, name, new)
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, name, None) is old:
        setattr(dist, name, new)


def _patch(c10d) -> None:
    if getattr(c10d.destroy_process_group, "_sdp_watch", False):
        return
    real_destroy, real_init = c10d.destroy_process_group, c10d.init_process_group

    @functools.wraps(real_destroy)
    def destroy_process_group(group=None):
        seen = _snapshot(c10d, group)
        real_destroy(group)
        _commit(seen)

    @functools.wraps(real_init)
    def init_process_group(*args, **kwargs):
        if _launcher and c10d.is_initialized():
            return _already_initialized(c10d, args[0] if args else kwargs.get("backend"))
        return real_init(*args, **kwargs)

    destroy_process_group._sdp_watch = True
    _replace(c10d, "destroy_process_group", destroy_process_group)
    _replace(c10d, "init_process_group", init_process_group)


def _already_initialized(c10d, asked) -> None:
    """The script's own init_process_group after --init-process-group made the default group."""
    have = _backend_name(c10d, c10d.GroupMember.WORLD)
    if asked in (None, "") or str(asked).lower() == have.lower():
        call = f"init_process_group({repr(str(asked)) if asked else ''})"
        print(f"[sdp_jupyter] {call} returned at once: {OPTION} already made the default group ({have})",
              file=sys.stderr, flush=True)
        return None
    raise ValueError(f"init_process_group({str(asked)!r}): {OPTION} already initialized the default process "
                     f"group with {have} (the job's --backend). Fix: run with --backend {asked}, or without "
                     f"{OPTION} so that the script chooses, or call init_process_group() without a backend")


def _snapshot(c10d, group) -> list[tuple[str, int | None, bool, int | None]]:
    """(backend, collectives or None, is the default group, its size or None) of the groups
    `destroy_process_group(group)` is about to destroy (every group when `group` is None or the default group)."""
    try:
        if not c10d.is_initialized():
            return []
        world = c10d.GroupMember.WORLD
        if group is None or group is world:
            # torch's registry of live groups (no public list exists); the default group alone without it
            pgs = list(getattr(getattr(c10d, "_world", None), "pg_map", None) or [world])
        else:
            pgs = [group]
        out = []
        for pg in pgs:
            name = _backend_name(c10d, pg)
            try:
                count = int(pg._get_sequence_number_for_group())
            except Exception:  # noqa: BLE001 - this backend keeps no sequence number (smddp: the engine counts)
                count = None
            try:
                size = int(pg.size())
            except Exception:  # noqa: BLE001
                size = None
            out.append((name, count, pg is world, size))
        return out
    except Exception:  # noqa: BLE001 - the watch never breaks a job
        return []


def _backend_name(c10d, pg) -> str:
    """"gloo", "smddp", ...; for a group made without a backend (torch says "undefined") the one its
    devices use ("cpu:gloo" -> "gloo"), or the whole "cpu:gloo,cuda:nccl" when they differ."""
    name = str(c10d.get_backend(pg))
    if name == "undefined":
        try:
            config = str(c10d.get_backend_config(pg))
        except Exception:  # noqa: BLE001
            return name
        names = {part.split(":")[-1] for part in config.split(",")}
        name = names.pop() if len(names) == 1 else config
    return name


def _commit(seen) -> None:
    with _lock:
        for name, count, default, size in seen:
            if default and (not _defaults or _defaults[-1] != name):
                _defaults.append(name)
            if default and size is not None:
                _default_sizes.append(size)
            _groups[name] = _groups.get(name, 0) + 1
            if count is None:
                _uncounted.add(name)
            else:
                _seq[name] = _seq.get(name, 0) + count


def summary() -> dict:
    """This rank's record: the default group's backend (None: none was made), the groups per backend,
    and the collectives run after set-up (None when a group's backend cannot count them)."""
    c10d = sys.modules.get(C10D)
    if c10d is not None:
        _commit(_snapshot(c10d, None))  # groups still alive at exit (they are not destroyed twice: this is the end)
    comm = sys.modules.get("sdp_jupyter.comm")
    engine = comm.usage() if comm is not None and hasattr(comm, "usage") else {"communicators": 0, "collectives": 0}
    with _lock:
        total, unknown = engine["collectives"], False
        for name, n in _groups.items():
            if name == "smddp" and engine["communicators"]:
                continue  # the engine's count has it
            if name in _uncounted:
                unknown = True
            else:
                total += _seq.get(name, 0)
        record = {"backend": _defaults[-1] if _defaults else None, "groups": dict(_groups),
                  "collectives": None if unknown and not total else total,
                  "attempt": env_int("SDP_RESTART", 0)}
        if len(_defaults) > 1:
            record["backends"] = list(_defaults)
        if _default_sizes:
            record["group_size"] = max(_default_sizes)  # 1: this rank's default group held it alone
        if engine["communicators"] and "smddp" not in _groups:
            record["engine"] = engine["communicators"]  # sdp_jupyter.comm used directly
        if _launcher:
            record["init_by"] = "launcher"
    return record


_reported = False


def report() -> None:
    """At exit: this rank's record as a metrics line (kind "backend")."""
    global _reported
    if _reported:
        return
    _reported = True
    try:
        from sdp_jupyter.monitor.reporter import emit

        emit(KIND, **summary())
    except Exception as e:  # noqa: BLE001 - never turn a finished job into a failed one
        print(f"[sdp_jupyter] could not record this rank's backend: {e!r}", file=sys.stderr)


__all__ = ["prepare", "init_default_group", "summary", "report", "KIND", "OPTION"]
