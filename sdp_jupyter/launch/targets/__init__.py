"""The registry of targets: where a job can run. A target is one folder below this one; its
``__init__`` holds its record (a ``Target``: name, option rows, JobSpec field, form fields, what it
supports, its launcher as "module:attribute" inside the folder), and the rest of the folder is its
launcher, its link and whatever else only it needs. ``FOLDERS`` is the list of them, in the order the
help texts and the setup form show them; ``register`` adds one more (a target of your own, or the
throwaway one the test suite adds).

Every list of targets in the package (the magic's and the CLI's --target, JobSpec's option table and
its checks, the setup form, the session check, the scaling table, the reference pages) is derived
from ``TARGETS`` here, so no module outside a target's folder tests for a target's name.

A folder's ``__init__`` is a leaf (it imports ``record`` and ``launch.options`` only): the spec reads
the records, and the launchers import the spec, so a record names its launcher and option rows as
strings loaded when first used.
"""
from __future__ import annotations

import importlib
import importlib.util

from sdp_jupyter.launch.targets.record import FormField, Target  # noqa: F401  (the record's types, for folders)

#: the targets' folders (packages), in the order lists show them; each one's __init__ defines RECORD
FOLDERS = [
    "sdp_jupyter.launch.targets.local",
    "sdp_jupyter.launch.targets.ssh",
    "sdp_jupyter.launch.targets.ray",
    "sdp_jupyter.launch.targets.slurm",
    "sdp_jupyter.launch.targets.sagemaker",
]

#: name -> record, every registered target
TARGETS: dict[str, Target] = {}
#: name -> the folder (package) it came from
_FOLDER_OF: dict[str, str] = {}


def _add(folder: str) -> Target:
    record = importlib.import_module(folder).RECORD
    if record.name in TARGETS:
        raise ValueError(f"a target named {record.name!r} is registered already (by {_FOLDER_OF[record.name]})")
    TARGETS[record.name] = record
    _FOLDER_OF[record.name] = folder
    return record


def register(folder: str) -> Target:
    """Add the target whose folder (a package with a RECORD) is `folder`, e.g. "my_targets.k8s". Call it
    before the spec, the magics, the CLI or the form are imported: they build their tables once."""
    record = _add(folder)
    FOLDERS.append(folder)
    return record


def load(where: str):
    """The attribute named by "module:attribute"; None when the module is not installed."""
    module_name, attribute = where.split(":")
    if importlib.util.find_spec(module_name) is None:
        return None
    return getattr(importlib.import_module(module_name), attribute, None)


def resolve(name: str, where: str) -> str:
    """A record's "module:attribute" made whole: a module written ".launcher" is inside the target's folder."""
    return f"{_FOLDER_OF[name]}{where}" if where.startswith(".") else where


def launcher_path(name: str) -> str:
    """Where target `name`'s launcher class is, "module:Class" (KeyError for an unknown target)."""
    return resolve(name, TARGETS[name].launcher)


def having(flag: str) -> tuple[str, ...]:
    """The targets whose record sets `flag` ("sessions", "hybrid", "warm", ...), in registry order."""
    return tuple(name for name, t in TARGETS.items() if getattr(t, flag))


def the_one(flag: str) -> str:
    """The one target whose record sets `flag` (a default such as "this_machine"); ValueError if not one."""
    found = having(flag)
    if len(found) != 1:
        raise ValueError(f"exactly one target must set {flag}, found {found or 'none'}")
    return found[0]


def form_fields() -> list[tuple[str, FormField]]:
    """(target, field) for every field a target adds to the setup form, in registry order."""
    return [(name, f) for name, t in TARGETS.items() for f in t.form]


def listed() -> str:
    """The targets as a sentence says them ("local, ssh, ray, slurm or sagemaker"), for the help texts
    that name them (--target, sdp-train --help): a new target is named there with no edit."""
    return sentence(tuple(TARGETS), "or")


def sentence(names: tuple[str, ...], last: str = "and") -> str:
    """Names as a sentence lists them: "ssh, ray and slurm"."""
    names = list(names)
    return f"{', '.join(names[:-1])} {last} {names[-1]}" if len(names) > 1 else "".join(names)


def nodes_default() -> str:
    """What --nodes left out means, as its help says it: 1, except on the targets whose nodes are their
    hosts (nodes_from_hosts), where it is one node per host given."""
    per_host = [f"--target {name}" for name, t in TARGETS.items() if t.nodes_from_hosts]
    return "default 1" + (f"; with {' or '.join(per_host)}: one per host given" if per_host else "")


for _folder in FOLDERS:
    _add(_folder)

#: the target a job runs on when none is named: the one whose nodes are this machine
DEFAULT_TARGET = the_one("this_machine")
