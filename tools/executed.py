"""The executed copy of a notebook, fit to publish: `notebooks/executed/<name>.ipynb`.

An executed notebook carries what the machine that ran it said: job secrets and tokens (a rank's
environment printed in a traceback), AWS keys (the local stand-in's fake ones included), paths of
that machine (the checkout, the virtual environment, the home folder, pytest's and other temporary
folders), terminal colour codes in tracebacks, and the state of every widget it displayed. `scrub`
takes all of that out of the outputs, the metadata and the sources (a cell a test added names its
own folders): secrets become `<secret>`, paths become `<checkout>`, `<venv>`,
`<tmp>` and `~`, colour codes go, and widget state is kept only while it is small (`WIDGET_STATE_MAX`).
`write` scrubs a copy and writes it; both the main job (tools/main_job.py) and the notebook tests
write their copies through it.
"""
from __future__ import annotations

import copy
import json
import os
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXECUTED = REPO / "notebooks" / "executed"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_STATE_MAX = 256 * 1024  # bytes of JSON: the job view and a dashboard or two; not a plot's every point

SECRET, CHECKOUT, VENV, TMP, HOME = "<secret>", "<checkout>", "<venv>", "<tmp>", "~"

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")
# name = value, name: value, "name": "value" where the name says it is a secret (SDP_JOB_SECRET=...,
# aws_secret_access_key='...', "token": "...", X-Amz-Security-Token=...)
SECRET_WORDS = r"secret|token|password|passwd|credential|access[_-]?key|hmac[_-]?key|api[_-]?key|session[_-]?key"
NAMED_SECRET = re.compile(rf"(?i)(\b[\w.-]*(?:{SECRET_WORDS})[\w.-]*[\"']?\s*[:=]\s*[\"']?)([^\s\"',;}})\]]+)")
AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA)[0-9A-Z]{16}\b")
# job secrets are secrets.token_hex(32): 64 digits; 48 leaves widget model ids (uuid4().hex, 32) alone
LONG_HEX = re.compile(r"\b[0-9a-fA-F]{48,}\b")
# pytest's folders (a path cut short with "…" in a summary line included) and tempfile's
TMP_DIRS = r"pytest-of-[^/\s\"'…]+(?:/pytest-\d+(?:/[^/\s\"'…]+)?)?|tmp[\w-]{6,}"


def _known_paths() -> list[tuple[str, str]]:
    """(path, placeholder) pairs, longest path first, so a venv inside the checkout stays `<checkout>/.venv`
    only when it is not the running one."""
    pairs = []
    for path, placeholder in ((REPO, CHECKOUT), (Path(sys.prefix), VENV), (Path.home(), HOME)):
        for p in {str(path), os.path.realpath(path)}:
            if len(Path(p).parts) > 2:  # never "/" or "/root"-like one-part paths: they would eat everything
                pairs.append((p, placeholder))
            elif placeholder == HOME and len(Path(p).parts) == 2:
                pairs.append((p + "/", HOME + "/"))
    return sorted(pairs, key=lambda pair: -len(pair[0]))


def _secret_values() -> list[str]:
    """Values of this process's environment whose names say they are secrets (long enough to be one)."""
    found = {v for k, v in os.environ.items() if re.search(SECRET_WORDS, k, re.I) and len(v) >= 12}
    return sorted(found, key=len, reverse=True)


def scrub_text(text: str, paths: list[tuple[str, str]] | None = None, secrets: list[str] | None = None) -> str:
    """One string, scrubbed: see the module docstring."""
    text = ANSI.sub("", text)
    for value in _secret_values() if secrets is None else secrets:
        text = text.replace(value, SECRET)
    text = NAMED_SECRET.sub(lambda m: m.group(1) + SECRET, text)
    text = AWS_KEY_ID.sub(SECRET, text)
    text = LONG_HEX.sub(SECRET, text)
    for path, placeholder in _known_paths() if paths is None else paths:
        text = text.replace(path, placeholder)
    tmp = {tempfile.gettempdir(), os.path.realpath(tempfile.gettempdir()), "/tmp"}
    for root in sorted(tmp, key=len, reverse=True):
        text = re.sub(rf"{re.escape(root)}/(?:{TMP_DIRS})", TMP, text)
    return text


def _walk(value, scrub):
    if isinstance(value, str):
        return scrub(value)
    if isinstance(value, list):
        return [_walk(v, scrub) for v in value]
    if isinstance(value, dict):
        return {k: _walk(v, scrub) for k, v in value.items()}
    return value


def scrub(nb):
    """A scrubbed copy of an nbformat notebook (the one given is left as it is)."""
    import nbformat

    paths, secrets = _known_paths(), _secret_values()

    def one(text: str) -> str:
        return scrub_text(text, paths, secrets)

    out = copy.deepcopy(nb)
    widgets = out.metadata.get("widgets", {})
    if WIDGET_STATE in widgets and len(json.dumps(widgets[WIDGET_STATE])) > WIDGET_STATE_MAX:
        del widgets[WIDGET_STATE]
    if "widgets" in out.metadata and not out.metadata["widgets"]:
        del out.metadata["widgets"]
    out.metadata = nbformat.from_dict(_walk(dict(out.metadata), one))
    for cell in out.cells:
        cell.source = one(cell.source)
        cell.metadata = nbformat.from_dict(_walk(dict(cell.metadata), one))
        if cell.cell_type == "code":
            cell.outputs = [nbformat.from_dict(_walk(dict(o), one)) for o in cell.outputs]
    return out


def write(nb, path: Path) -> Path:
    """Write the scrubbed copy of `nb` to `path` (its folder made first)."""
    import nbformat

    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(scrub(nb), path)
    return path
