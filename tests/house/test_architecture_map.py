"""docs/architecture.md is the map of the house: every package directory and every module directly
under sdp_jupyter/ (and every module of launch/, whose rooms are process boundaries) is named there as
a path, and every sdp_jupyter/ path the page names exists. A new room without a place on the map, or
a map entry for a room that moved, fails here."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "sdp_jupyter"
PAGE = ROOT / "docs" / "architecture.md"
PATH_RE = re.compile(r"(sdp_jupyter/[A-Za-z0-9_./]*[A-Za-z0-9_/])")


def rooms() -> set[str]:
    """What the map must name: packages (as 'sdp_jupyter/x/'), top-level modules, launch/'s modules."""
    want = set()
    for init in PKG.rglob("__init__.py"):
        d = init.parent
        if d != PKG and "_compat" not in d.relative_to(PKG).parts[:1]:
            want.add(d.relative_to(ROOT).as_posix() + "/")
    for f in PKG.glob("*.py"):
        if f.name != "__init__.py":
            want.add(f.relative_to(ROOT).as_posix())
    for f in (PKG / "launch").rglob("*.py"):
        if f.name != "__init__.py":
            want.add(f.relative_to(ROOT).as_posix())
    want.add("sdp_jupyter/_compat/")
    return want


def named(text: str) -> set[str]:
    out = set()
    for m in PATH_RE.finditer(text):
        p = m.group(1)
        out.add(p if (ROOT / p).is_file() else p.rstrip("/") + "/")
    return out


def test_every_room_is_on_the_map():
    missing = sorted(rooms() - named(PAGE.read_text()))
    assert not missing, f"not on docs/architecture.md (add each with a line on what it is): {missing}"


def test_the_map_names_only_rooms_that_exist():
    stale = sorted(p for p in named(PAGE.read_text()) if not (ROOT / p).exists())
    assert not stale, f"docs/architecture.md names paths that do not exist (moved or gone): {stale}"


def test_the_map_check_can_fail(tmp_path):
    assert "sdp_jupyter/launch/rank/worker.py" in rooms() and "sdp_jupyter/launch/" in rooms()
    assert named("see sdp_jupyter/launch/ and sdp_jupyter/jobdir.py.") == {"sdp_jupyter/launch/", "sdp_jupyter/jobdir.py"}


# Every repository path README.md, CONTRIBUTING.md and docs/*.md cite (a file, a folder or a glob) exists: a page that
# sends the reader to a moved test or module fails here. What a run writes (ignored by git) is exempt.
DOC_PATH_RE = re.compile(r"(?<![\w/.-])((?:sdp_jupyter|tests|docs|native|benchmarks|tools|notebooks)/[\w./*-]*[\w/*])")
WRITTEN_BY_A_RUN = ("notebooks/executed/",)


def stale_doc_paths(text: str) -> list[str]:
    stale = []
    for m in DOC_PATH_RE.finditer(text):
        p = m.group(1).rstrip("/.")
        if (p + "/").startswith(WRITTEN_BY_A_RUN):  # "notebooks/executed/" cited as the folder itself too
            continue
        if not ((ROOT / p).exists() if "*" not in p else any(ROOT.glob(p))):
            stale.append(p)
    return stale


def test_the_docs_cite_only_paths_that_exist():
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    stale = {page.relative_to(ROOT).as_posix(): s for page in pages if (s := stale_doc_paths(page.read_text()))}
    assert not stale, f"paths cited that do not exist (moved or gone; fix the page): {stale}"


def test_the_doc_path_check_can_fail():
    assert stale_doc_paths("`tests/test_magics_browser.py` and benchmarks/results/startup*.json, "
                           "tests/browser/test_magics_browser.py") == ["tests/test_magics_browser.py"]
    # what a run writes is exempt, cited as a folder or as a file in it, whether or not a run made it yet
    assert stale_doc_paths("`notebooks/executed/`, notebooks/executed and notebooks/executed/x.ipynb") == []
