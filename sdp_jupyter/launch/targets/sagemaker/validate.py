"""Check a SageMaker API request against botocore's service model before it is sent.

botocore's own parameter validation checks types and required members, but not string length,
patterns, enums or numeric ranges, and moto accepts whatever it is given (a 70-character job
name and ``ml.p4d.48xlarge`` both pass). The real service rejects those, minutes later and far
from the cell that caused them. This module walks the request against the operation's input
shape and reports every violation with the dotted path of the field, e.g.
``ResourceConfig.InstanceType: 'ml.p4d.48xlarge' is not one of ...``; options.validate_request
names the option behind each field (SageMakerRequestError).
"""
from __future__ import annotations

import difflib
import re
from functools import lru_cache
from typing import Any

try:  # AWS patterns are Java regexes; a few use \p{L}-style classes that only `regex` knows.
    import regex as _regex
except ImportError:  # pragma: no cover - `regex` ships with the SDK's dependencies
    _regex = None


@lru_cache(maxsize=4)
def service_model(service: str = "sagemaker"):
    import botocore.session

    return botocore.session.get_session().get_service_model(service)


@lru_cache(maxsize=256)
def _compiled(pattern: str):
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error:
        if _regex is None:
            return None
        try:
            return _regex.compile(pattern, _regex.DOTALL)
        except _regex.error:
            return None


def enum_values(operation: str, path: str, service: str = "sagemaker") -> list[str]:
    """The allowed values of a string member, e.g. enum_values("CreateTrainingJob",
    "ResourceConfig.InstanceType")."""
    shape = service_model(service).operation_model(operation).input_shape
    for part in path.split("."):
        shape = shape.members[part]
    return list(shape.enum or [])


def check(operation: str, params: dict, *, partial: bool = False, service: str = "sagemaker") -> list[tuple[str, str]]:
    """Every (field path, message) where `params` breaks the operation's input shape.

    With `partial=True` required members that are absent are not reported (for a request that
    the SDK completes later); everything that is present is still checked.
    """
    shape = service_model(service).operation_model(operation).input_shape
    problems: list[tuple[str, str]] = []
    _walk(shape, params, "", problems, partial)
    return problems


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _walk(shape, value: Any, path: str, problems: list, partial: bool) -> None:
    kind = shape.type_name
    label = path or shape.name
    if kind == "structure":
        if not isinstance(value, dict):
            problems.append((label, f"expected a structure ({shape.name}), got {type(value).__name__}"))
            return
        if not partial:
            for name in shape.required_members:
                if value.get(name) is None:
                    problems.append((_join(path, name), "is required"))
        for name, member_value in value.items():
            if member_value is None:
                continue
            member = shape.members.get(name)
            if member is None:
                close = difflib.get_close_matches(name, list(shape.members), n=1)
                hint = f" (did you mean {close[0]}?)" if close else ""
                problems.append((_join(path, name), f"is not a member of {shape.name}{hint}"))
                continue
            _walk(member, member_value, _join(path, name), problems, partial)
    elif kind == "list":
        if not isinstance(value, (list, tuple)):
            problems.append((label, f"expected a list, got {type(value).__name__}"))
            return
        _check_size(shape, len(value), label, problems, "items")
        for i, item in enumerate(value):
            _walk(shape.member, item, f"{path}[{i}]", problems, partial)
    elif kind == "map":
        if not isinstance(value, dict):
            problems.append((label, f"expected a map, got {type(value).__name__}"))
            return
        _check_size(shape, len(value), label, problems, "entries")
        for key, item in value.items():
            _walk(shape.key, key, f"{path}[{key!r}] (key)", problems, partial)
            _walk(shape.value, item, f"{path}[{key!r}]", problems, partial)
    elif kind == "string":
        if not isinstance(value, str):
            problems.append((label, f"expected a string, got {type(value).__name__} {value!r}"))
            return
        if shape.enum and value not in shape.enum:
            close = difflib.get_close_matches(value, shape.enum, n=3)
            hint = f"; closest: {', '.join(close)}" if close else ""
            problems.append((label, f"{value!r} is not one of the {len(shape.enum)} allowed values{hint}"))
            return
        _check_size(shape, len(value), label, problems, "characters", value)
        pattern = shape.metadata.get("pattern")
        if pattern:
            compiled = _compiled(pattern)
            if compiled is not None and not compiled.fullmatch(value):
                problems.append((label, f"{value!r} does not match the pattern {pattern}"))
    elif kind in ("integer", "long", "float", "double"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            problems.append((label, f"expected a number, got {type(value).__name__} {value!r}"))
            return
        if kind in ("integer", "long") and not isinstance(value, int):
            problems.append((label, f"expected an integer, got {value!r}"))
            return
        low, high = shape.metadata.get("min"), shape.metadata.get("max")
        if low is not None and value < low:
            problems.append((label, f"{value} is below the minimum {low}"))
        if high is not None and value > high:
            problems.append((label, f"{value} is above the maximum {high}"))
    elif kind == "boolean":
        if not isinstance(value, bool):
            problems.append((label, f"expected true/false, got {value!r}"))
    # timestamp / blob: botocore serialises and checks these itself


def _check_size(shape, size: int, label: str, problems: list, unit: str, value: Any = None) -> None:
    low, high = shape.metadata.get("min"), shape.metadata.get("max")
    shown = f"{value!r} has " if value is not None and size <= 80 else ""
    if low is not None and size < low:
        problems.append((label, f"{shown}{size} {unit}; at least {low} required"))
    if high is not None and size > high:
        problems.append((label, f"{shown}{size} {unit}; at most {high} allowed"))
