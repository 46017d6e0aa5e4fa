"""The executed copy of a notebook, fit to publish: `notebooks/executed/<name>.ipynb` (a run's, ignored by
git) and `notebooks/outputs/<name>.ipynb` (stored in the repository, so a reader on GitHub sees outputs).

An executed notebook carries what the machine that ran it said: job secrets and tokens (a rank's
environment printed in a traceback), AWS keys (the local stand-in's fake ones included), paths of
that machine (the checkout, the virtual environment, the home folder, anything under the temporary
folder), its host name and network addresses, terminal colour codes in tracebacks, and the state of
every widget it displayed. `scrub` takes all of that out of the outputs, the metadata and the sources
(a cell a test added names its own folders): secrets become `<secret>`, paths become `<checkout>`,
`<venv>`, `<tmp>` and `~`, the host name `<host>`, an address `<address>`, colour codes go, and
widget state is kept only while it is small (`WIDGET_STATE_MAX`).
`write` scrubs a copy and writes it; both the main job (tools/main_job.py) and the notebook tests
write their copies through it, to notebooks/executed/.

The stored copies: `python tools/executed.py refresh [NAME ...]` runs the notebooks of `PUBLISHED` (or
the ones named), each in a fresh kernel with a private jobs folder and never AWS (04 runs against the
local moto server), and writes their scrubbed copies to notebooks/outputs/. Each copy's metadata
(`STAMP`) records a digest of the notebook's cells (their kinds and sources) and the sdp_jupyter
version that ran it; `python tools/executed.py check` (and tests/notebook/test_notebooks.py) says which
stored copy no longer matches its notebook or the current version, so it must be refreshed. When only
markdown changed, `python tools/executed.py prose NAME ...` copies it into the stored copy and re-stamps it
(its outputs came from the same code); a changed code cell is refused.
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
EXECUTED = NOTEBOOKS / "executed"
OUTPUTS = NOTEBOOKS / "outputs"
# The notebooks whose executed copies are stored in OUTPUTS: those that run on any Linux machine without
# root, in a few minutes each. Left out: 07_slurm, 09_ssh and 11_elastic start their test hosts in network
# namespaces (root; the notebook tests run them and leave their copies in EXECUTED).
PUBLISHED = ("01_quickstart.ipynb", "02_job_setup.ipynb", "03_monitoring.ipynb", "04_sagemaker.ipynb",
             "05_model_parallel.ipynb", "06_ray.ipynb", "08_interactive_session.ipynb",
             "10_headline_benchmark.ipynb", "12_notebook_is_the_program.ipynb")
STAMP = "sdp_outputs"  # the stored copy's metadata key: {"cells": digest of the cells, "sdp_jupyter": version}
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
WIDGET_STATE_MAX = 256 * 1024  # bytes of JSON: the job view and a dashboard or two; not a plot's every point

SECRET, CHECKOUT, VENV, TMP, HOME = "<secret>", "<checkout>", "<venv>", "<tmp>", "~"
HOST, ADDRESS = "<host>", "<address>"

ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)")
# name = value, name: value, "name": "value" where the name says it is a secret (SDP_JOB_SECRET=...,
# aws_secret_access_key='...', "token": "...", X-Amz-Security-Token=...)
SECRET_WORDS = r"secret|token|password|passwd|credential|access[_-]?key|hmac[_-]?key|api[_-]?key|session[_-]?key"
NAMED_SECRET = re.compile(rf"(?i)(\b[\w.-]*(?:{SECRET_WORDS})[\w.-]*[\"']?\s*[:=]\s*[\"']?)([^\s\"',;}})\]]+)")
AWS_KEY_ID = re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA)[0-9A-Z]{16}\b")
# job secrets are secrets.token_hex(32): 64 digits; 48 leaves widget model ids (uuid4().hex, 32) alone
LONG_HEX = re.compile(r"\b[0-9a-fA-F]{48,}\b")
# pytest's folders (a path cut short with "…" in a summary line included), then any other folder or file
# right under the temporary folder (tempfile's tmpXXXXXXXX, a notebook's mkdtemp(prefix="sm-train-"))
TMP_DIRS = r"pytest-of-[^/\s\"'…]+(?:/pytest-\d+(?:/[^/\s\"'…]+)?)?|[^/\s\"'…,;:)\]}]+"


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


def _machine_names() -> list[tuple[re.Pattern, str]]:
    """(pattern, placeholder) for this machine's host name and its network addresses (not loopback's),
    each matched as a whole word only: never inside another name or number, nor inside base64."""
    import psutil

    found = []
    host = socket.gethostname()
    if len(host) >= 2:
        found.append((re.compile(rf"(?<![\w.+/=-]){re.escape(host)}(?![\w+/=-])"), HOST))
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            ip = a.address.split("%")[0]
            if a.family == socket.AF_INET and not ip.startswith("127."):
                found.append((re.compile(rf"(?<![\w.]){re.escape(ip)}(?![\w.]*\d)"), ADDRESS))
            elif a.family == socket.AF_INET6 and ip not in ("::1", "") and not ip.startswith("fe80"):
                found.append((re.compile(rf"(?<![\w:]){re.escape(ip)}(?![\w:])"), ADDRESS))
    return found


def scrub_text(text: str, paths: list[tuple[str, str]] | None = None, secrets: list[str] | None = None,
               names: list[tuple[re.Pattern, str]] | None = None) -> str:
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
        text = re.sub(rf"(?<![\w./-]){re.escape(root)}/(?:{TMP_DIRS})", TMP, text)
    for pattern, placeholder in _machine_names() if names is None else names:
        text = pattern.sub(placeholder, text)
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

    paths, secrets, names = _known_paths(), _secret_values(), _machine_names()

    def one(text: str) -> str:
        return scrub_text(text, paths, secrets, names)

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


def leaks(text: str) -> list[str]:
    """What in `text` (a written copy) still names this machine, or looks like a job secret."""
    found = [p for p, _ in _known_paths() if p in text]
    found += [m for m in re.findall(r"(?<![\w.-])/tmp/[^\s\"']*", text)]
    found += [m for m in re.findall(r"(?<![\w.-])/(?:home|Users)/[^\s\"'/]+", text)]
    found += ["colour codes"] * (("\x1b[" in text) or ("\\u001b[" in text))
    found += re.findall(r"\b[0-9a-fA-F]{64}\b", text)
    found += [m.group(0) for pattern, _ in _machine_names() for m in pattern.finditer(text)]
    return found


def cells_digest(nb) -> str:
    """A digest of a notebook's cells (their kinds and sources, in order): what a stored copy shows."""
    cells = [[c.cell_type, c.source] for c in nb.cells]
    return hashlib.sha256(json.dumps(cells).encode()).hexdigest()[:32]  # 32 digits: not a secret's 64


def version() -> str:
    import sdp_jupyter

    return sdp_jupyter.__version__


def stamp(notebook: Path) -> dict:
    """What a stored copy of `notebook` made now records in its metadata (STAMP)."""
    import nbformat

    return {"cells": cells_digest(nbformat.read(notebook, as_version=4)), "sdp_jupyter": version()}


def stale() -> dict[str, str]:
    """The stored copies to refresh, by notebook name, each with the reason: a PUBLISHED notebook without
    its copy, a copy made from other cells or by another sdp_jupyter version, a copy of no PUBLISHED
    notebook."""
    import nbformat

    found = {}
    for name in PUBLISHED:
        copy_path = OUTPUTS / name
        if not copy_path.is_file():
            found[name] = f"no stored copy {copy_path.relative_to(REPO)}"
            continue
        have = nbformat.read(copy_path, as_version=4).metadata.get(STAMP, {})
        want = stamp(NOTEBOOKS / name)
        if have.get("cells") != want["cells"]:
            found[name] = "the notebook's cells changed since its copy was made"
        elif have.get("sdp_jupyter") != want["sdp_jupyter"]:
            found[name] = f"made by sdp_jupyter {have.get('sdp_jupyter')}, this is {want['sdp_jupyter']}"
    for extra in sorted(p.name for p in OUTPUTS.glob("*.ipynb") if p.name not in PUBLISHED):
        found[extra] = "not a PUBLISHED notebook: delete it"
    return found



def kernel_env() -> dict:
    """The kernel's environment: ours without PYTEST_CURRENT_TEST (ipykernel would stop capturing
    subprocess output) and with this checkout importable."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def execute(path: Path, out_dir: Path, timeout: int = 600, prepare=None, km=None):
    """Execute a notebook in a fresh kernel (cwd: its folder); write the executed copy to out_dir,
    scrubbed (tools/executed.py: no secrets, no paths of this machine), also when a cell fails. Returns
    the notebook as executed, unscrubbed. `prepare(nb)`, when given, edits the notebook in memory
    first. `km`, when given, is the kernel manager to start the kernel with (another kernelspec: a
    kernel on a test host), instead of python3's; its kernel is shut down at the end all the same."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    if prepare is not None:
        prepare(nb)
    client = NotebookClient(nb, km=km, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute(env=kernel_env(), cleanup_kc=True)  # nbclient leaves a kernel it did not make running
    finally:
        write(nb, out_dir / path.name)
    return nb


def refresh(names=PUBLISHED, timeout: int = 600) -> int:
    """Run each notebook of `names` in a fresh kernel (its folder the working directory, a private jobs
    folder, SageMaker against the local moto server) and store its scrubbed, stamped copy in OUTPUTS.
    A notebook that fails, or whose copy would still name this machine, keeps its old copy. Returns the
    number that failed."""
    import nbformat

    failed = 0
    for name in names:
        path = NOTEBOOKS / name
        work = Path(tempfile.mkdtemp(prefix="sdp-outputs-"))
        t0 = time.monotonic()
        try:
            with mock.patch.dict(os.environ, {"SDP_JOBS_DIR": str(work / "jobs"), "SDP_SAGEMAKER_MOTO": "1"}):
                execute(path, work, timeout=timeout)  # writes work/<name>, scrubbed; raises naming a failed cell
            copy_nb = nbformat.read(work / name, as_version=4)
            copy_nb.metadata[STAMP] = stamp(path)
            text = nbformat.writes(copy_nb) + "\n"
            if found := leaks(text):
                raise RuntimeError(f"the scrubbed copy still holds {sorted(set(found))[:5]}")
            OUTPUTS.mkdir(parents=True, exist_ok=True)
            (OUTPUTS / name).write_text(text)
            print(f"[outputs] {name}: {time.monotonic() - t0:.0f} s -> {(OUTPUTS / name).relative_to(REPO)}",
                  flush=True)
        except Exception as e:  # noqa: BLE001 - report it, go on with the next notebook
            failed += 1
            print(f"[outputs] {name} FAILED after {time.monotonic() - t0:.0f} s, its stored copy is kept: "
                  f"{type(e).__name__}: {ANSI.sub('', str(e))[-2000:]}", file=sys.stderr, flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return failed


def prose(name: str) -> str | None:
    """Bring a stored copy up to its notebook when only markdown cells changed: their text is copied in
    (scrubbed) and the copy re-stamped; its outputs stay, as they came from the same code. Returns why
    not (a code cell or the cells' kinds differ: run `refresh`), or None when done."""
    import nbformat

    path, copy_path = NOTEBOOKS / name, OUTPUTS / name
    if not copy_path.is_file():
        return f"no stored copy {copy_path.relative_to(REPO)}: run refresh"
    nb, stored = nbformat.read(path, as_version=4), nbformat.read(copy_path, as_version=4)
    kinds = [c.cell_type for c in nb.cells]
    if kinds != [c.cell_type for c in stored.cells]:
        return "the notebook's cells were added, removed or changed kind: run refresh"
    for i, (cell, old) in enumerate(zip(nb.cells, stored.cells)):
        if cell.cell_type != "markdown" and scrub_text(cell.source) != old.source:
            return f"code cell {i} changed: run refresh"
    for cell, old in zip(nb.cells, stored.cells):
        if cell.cell_type == "markdown":
            old.source = scrub_text(cell.source)
    stored.metadata[STAMP] = {**stored.metadata.get(STAMP, {}), "cells": stamp(path)["cells"]}
    text = nbformat.writes(stored) + "\n"
    if found := leaks(text):
        return f"the copy would hold {sorted(set(found))[:5]}"
    copy_path.write_text(text)
    return None


def main(argv: list[str]) -> int:
    usage = ("usage: python tools/executed.py refresh [NAME.ipynb ...]  (run the notebooks, store their copies "
             "in notebooks/outputs/)\n       python tools/executed.py check  (say which stored copies are stale)"
             "\n       python tools/executed.py prose NAME.ipynb ...  (only markdown changed: copy it into the "
             "stored copies)")
    if argv and argv[0] == "prose":
        why = {n: prose(n) for n in argv[1:]}
        for n, reason in why.items():
            print(f"{n}: {reason or 'markdown copied, re-stamped'}")
        return 1 if any(why.values()) else 0
    if not argv or argv[0] not in ("refresh", "check"):
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "check":
        found = stale()
        for name, why in found.items():
            print(f"{name}: {why}")
        return 1 if found else 0
    names = argv[1:] or list(PUBLISHED)
    unknown = [n for n in names if n not in PUBLISHED]
    if unknown:
        print(f"not in PUBLISHED (tools/executed.py): {unknown}", file=sys.stderr)
        return 2
    return 1 if refresh(names) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
