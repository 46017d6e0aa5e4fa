"""docs/architecture.md is the map of the house: every package directory and every module directly
under sdp_jupyter/ (and every module of launch/, whose rooms are process boundaries) is named there as
a path, and every sdp_jupyter/ path the page names exists. A new room without a place on the map, or
a map entry for a room that moved, fails here. The page's edge list (under "## Dependencies") and the
code's import graph (tests/house/test_import_graph.py) agree both ways: every edge the page states is
in the code, and every edge the code has between two of the page's rooms is on the page."""
from __future__ import annotations

import importlib.util
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


# The edge list: the first fenced block under "## Dependencies", one line per room, `room -> a, b`
# (`-`: none). Rooms are dotted names under sdp_jupyter; a module belongs to the longest room that holds it.
EDGE_LINE = re.compile(r"^([a-z_][a-z_0-9.]*) -> (-|[a-z_][a-z_0-9.]*(?:, [a-z_][a-z_0-9.]*)*)$")
PROCESS_ROOMS = ("launch.kernel", "launch.host", "launch.rank", "launch.targets")  # and the targets' folders


def stated_edges(text: str) -> dict[str, set[str]]:
    """The page's edge list as {room: the rooms it imports}."""
    section = text.split("\n## Dependencies\n", 1)[1]
    block = section.split("```", 2)[1].split("\n", 1)[1]  # the fence's first line names the language
    out: dict[str, set[str]] = {}
    for line in filter(None, (ln.strip() for ln in block.splitlines())):
        m = EDGE_LINE.match(line)
        assert m, f"docs/architecture.md: not an edge line (write `room -> a, b` or `room -> -`): {line!r}"
        assert m.group(1) not in out, f"docs/architecture.md: room {m.group(1)} has two lines"
        out[m.group(1)] = set() if m.group(2) == "-" else set(m.group(2).split(", "))
    return out


def _import_graph():
    spec = importlib.util.spec_from_file_location("house_import_graph", Path(__file__).with_name("test_import_graph.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.graph()[0]  # module -> modules, strings naming our modules included, the lazy views excepted


def room_edges(module_edges: dict[str, set[str]], rooms: set[str]) -> set[tuple[str, str]]:
    """The code's edges between rooms: (a, b) when a module of room a imports one of room b (a != b)."""
    def room(module: str) -> str | None:
        held = [r for r in rooms if module == f"sdp_jupyter.{r}" or module.startswith(f"sdp_jupyter.{r}.")]
        return max(held, key=len) if held else None

    out = set()
    for m, deps in module_edges.items():
        for d in deps:
            a, b = room(m), room(d)
            if a and b and a != b:
                out.add((a, b))
    return out


def edge_differences(stated: dict[str, set[str]], code: set[tuple[str, str]]) -> tuple[list[str], list[str]]:
    """(edges the page states that the code does not have, edges the code has that the page does not state)."""
    said = {(a, b) for a, bs in stated.items() for b in bs}
    return sorted(f"{a} -> {b}" for a, b in said - code), sorted(f"{a} -> {b}" for a, b in code - said)


def public_rooms() -> set[str]:
    """What the edge list must have a line for: every package and public module directly under
    sdp_jupyter/, and launch's process rooms."""
    tops = {p.stem for p in PKG.glob("*.py") if not p.name.startswith("_")}
    tops |= {p.parent.name for p in PKG.glob("*/__init__.py") if not p.parent.name.startswith("_")}
    return tops | set(PROCESS_ROOMS)


def test_every_room_has_a_line_in_the_edge_list():
    stated = stated_edges(PAGE.read_text())
    named = set(stated) | {b for bs in stated.values() for b in bs}
    assert not sorted(public_rooms() - set(stated)), \
        f"rooms without a line under ## Dependencies in docs/architecture.md: {sorted(public_rooms() - set(stated))}"
    assert named <= set(stated), f"rooms named on the right but without a line of their own: {sorted(named - set(stated))}"


def test_the_edge_list_is_the_import_graph_both_ways():
    stated = stated_edges(PAGE.read_text())
    false, unstated = edge_differences(stated, room_edges(_import_graph(), set(stated)))
    assert not false, f"docs/architecture.md states edges the code does not have (remove them): {false}"
    assert not unstated, f"the code has edges docs/architecture.md does not state (add them, or remove the import): {unstated}"


def test_the_edge_checks_can_fail():
    page = "x\n## Dependencies\n\ntext\n\n```text\nlaunch.kernel -> launch\nlaunch -> -\njobdir -> launch\n```\n"
    stated = stated_edges(page)
    assert stated == {"launch.kernel": {"launch"}, "launch": set(), "jobdir": {"launch"}}
    code = room_edges({"sdp_jupyter.launch.kernel.job": {"sdp_jupyter.launch.spec", "sdp_jupyter.jobdir"},
                       "sdp_jupyter.launch.spec": {"sdp_jupyter._env"}}, set(stated))
    assert code == {("launch.kernel", "launch"), ("launch.kernel", "jobdir")}  # launch.kernel.job is not launch's
    assert edge_differences(stated, code) == (["jobdir -> launch"], ["launch.kernel -> jobdir"])


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


def unexplained_same_names(text: str, package: Path) -> list[str]:
    """Module file names found twice or more under `package` (not __init__.py) whose paths the page's
    "Same names" paragraph does not all name."""
    by_name: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        if path.name != "__init__.py" and "__pycache__" not in path.parts:
            by_name.setdefault(path.name, []).append(path.relative_to(package).as_posix())
    start = text.find("**Same names.**")
    paragraph = text[start:text.find("\n\n", start)] if start >= 0 else ""
    return [f"{name}: {', '.join(paths)}" for name, paths in by_name.items()
            if len(paths) > 1 and not all(f"`{p}`" in paragraph for p in paths)]


def test_every_module_name_used_twice_is_explained_on_the_map(tmp_path):
    text = PAGE.read_text()
    assert not unexplained_same_names(text, ROOT / "sdp_jupyter"), unexplained_same_names(text, ROOT / "sdp_jupyter")
    # the check can fail: a third session.py the paragraph does not name
    fake = tmp_path / "pkg"
    for rel in ("launch/kernel/session.py", "launch/rank/session.py", "ui/session.py"):
        (fake / rel).parent.mkdir(parents=True, exist_ok=True)
        (fake / rel).write_text("")
    assert unexplained_same_names(text, fake) == [
        "session.py: launch/kernel/session.py, launch/rank/session.py, ui/session.py"]
