"""Names that changed, kept working for a while: the old keyword is moved to the new one with a
FutureWarning that names both and when the old one goes (CHANGELOG.md, "Changed")."""
from __future__ import annotations

import warnings

#: old keyword -> (new keyword, the option users see, the version that drops the old name)
RENAMED = {"gpus_per_node": ("procs_per_node", "--procs-per-node", "0.2")}


def renamed(values: dict, where: str) -> dict:
    """`values` with every old keyword moved to its new name, warning once per old name (FutureWarning,
    naming `where`); an old and a new name given together is a TypeError."""
    out = dict(values)
    for old, (new, option, until) in RENAMED.items():
        if old not in out:
            continue
        value = out.pop(old)
        if out.get(new) is not None:
            raise TypeError(f"{where}: give {new} only ({old} is its old name)")
        warnings.warn(f"{where}: {old} is now {new} ({option}), the name %%sdp_train and launch() use; the old "
                      f"name goes in {until}", FutureWarning, stacklevel=3)
        out[new] = value
    return out
