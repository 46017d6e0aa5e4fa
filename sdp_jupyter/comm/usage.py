"""What this process's engines did, for the job's end report (launch/rank/backend_check.py: did the ranks
ever run a collective?). Closed communicators leave their count behind; live ones are asked."""
from __future__ import annotations

import threading
import weakref

live: weakref.WeakSet = weakref.WeakSet()  # the open Communicators
_closed = {"communicators": 0, "collectives": 0}
_lock = threading.Lock()


def opened(c) -> None:
    with _lock:
        live.add(c)


def closing(c) -> None:
    with _lock:
        if c not in live:
            return
        live.discard(c)
        _closed["communicators"] += 1
        try:
            _closed["collectives"] += int(c.stats()["collectives"])
        except Exception:  # noqa: BLE001 - a broken engine still closes
            pass


def usage() -> dict:
    """{"communicators", "collectives"}: the engines this process made (every smddp group has one)
    and the collectives they ran, closed ones included."""
    with _lock:
        current, total = list(live), dict(_closed)
    for c in current:
        try:
            total["collectives"] += int(c.stats()["collectives"])
        except Exception:  # noqa: BLE001
            pass
    total["communicators"] += len(current)
    return total
