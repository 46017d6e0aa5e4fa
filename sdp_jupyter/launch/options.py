"""The option table's building blocks: `Option` (one command-line option), `SpecError` (a bad
option: names it and the fix) and the shared value parsers. A leaf: it imports nothing of ours, so
the option providers (parallel_options, ssh, ray, sagemaker) and spec.py can all use it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any


class SpecError(ValueError):
    """A bad job option. The message names the option and the fix; nothing was launched."""

    def __init__(self, option: str, message: str):
        self.option = option
        super().__init__(f"{option}: {message}")


@dataclass(frozen=True)
class Option:
    """One command-line option of %%sdp_train / sdp-train.

    `field` is the JobSpec field it fills (None for options that only steer the magic, like --wait).
    `kind`: "value" (one string), "flag" (no value: the field gets `const`, True unless said, e.g.
    --no-sequence-parallel stores False), "optional" (a value that may be left out: the bare flag
    stands for `const`, e.g. --shard-optimizer = --shard-optimizer optimizer), "append" (repeatable),
    "csv" (a,b,c).
    """

    flag: str
    field: str | None
    help: str
    kind: str = "value"
    metavar: str | None = None
    const: Any = True

    def argparse_kwargs(self) -> dict:
        kw: dict[str, Any] = {"help": self.help.replace("%", "%%")}  # argparse %-formats help: %sdp_warm
        if self.kind == "flag":
            kw["action"] = "store_true"
        else:
            kw["metavar"] = self.metavar or self.flag.lstrip("-").upper().replace("-", "_")
            kw["default"] = None
            if self.kind == "append":
                kw["action"] = "append"
            elif self.kind == "optional":
                kw["nargs"] = "?"
                kw["const"] = self.const
        kw["dest"] = self.flag.lstrip("-").replace("-", "_")
        return kw


def parse_whole(flag: str, value: Any, minimum: int, example: str) -> int:
    """A whole number >= minimum from an int, an integral float or a digit string; else SpecError
    naming `flag` with the fix `flag example`."""
    if isinstance(value, bool):
        raise SpecError(flag, f"must be a whole number, got {value!r}. Fix: {flag} {example}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        n = int(value)
    else:
        raise SpecError(flag, f"must be a whole number, got {value!r}. Fix: {flag} {example}")
    if n < minimum:
        raise SpecError(flag, f"must be {minimum} or more, got {n}. Fix: {flag} {example}")
    return n
