"""Reading settings from the environment: one parser, one truth table.

Every numeric or boolean setting (SDP_TIMEOUT, SDP_CHUNK_BYTES, SDP_FAST_EXIT, ...) goes through
these functions (`environ=` reads another mapping, e.g. a worker's environment being built), so a bad value fails the same way everywhere: an error that names the variable,
the value and what is allowed. Unset or empty means "use the default".
"""
from __future__ import annotations

import math
import os

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


def _raw(name: str, environ=None) -> str | None:
    v = (os.environ if environ is None else environ).get(name)
    return None if v is None or str(v).strip() == "" else str(v).strip()


def parse_bool(value, name: str = "value") -> bool:
    """True/False from 1/0, true/false, yes/no, on/off (any case) or a bool; else ValueError."""
    if isinstance(value, bool):
        return value
    low = str(value).strip().lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use one of 1/0, true/false, yes/no, on/off")


def env_int(name: str, default: int, *, min: int | None = None, environ=None) -> int:
    v = _raw(name, environ)
    if v is None:
        return default
    try:
        n = int(v, 10)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None
    if min is not None and n < min:
        raise ValueError(f"{name}={v!r} must be at least {min}")
    return n


def env_float(name: str, default: float, *, min: float | None = None, finite: bool = True,
              environ=None) -> float:
    """A float setting; `finite` refuses nan and inf (a deadline of nan would never fire)."""
    v = _raw(name, environ)
    if v is None:
        return default
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not a number") from None
    if finite and not math.isfinite(x):
        raise ValueError(f"{name}={v!r} must be a finite number")
    if min is not None and not x >= min:
        raise ValueError(f"{name}={v!r} must be at least {min:g}")
    return x


def env_bool(name: str, default: bool, *, environ=None) -> bool:
    v = _raw(name, environ)
    return default if v is None else parse_bool(v, name)
