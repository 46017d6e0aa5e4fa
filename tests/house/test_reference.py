"""docs/reference/ is made by tools/gen_reference.py from the code: the committed pages must be what it
makes now, and every SDP_* variable the code names must be in sdp_jupyter/_env.py's registry (the source
of environment.md), and every registry entry named by the code."""
from __future__ import annotations

import ast
import copy
import importlib.util
import re
from pathlib import Path

import pytest

from sdp_jupyter import _env

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bSDP_[A-Z0-9_]*[A-Z0-9]\b")


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


@pytest.fixture(scope="module")
def pages():
    return gen.generate()


def string_names(path: Path) -> set[str]:
    """SDP_* names in the string literals of a Python file (messages and f-strings included, comments not)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found |= set(NAME.findall(node.value))
    return found


def names_in_code() -> dict[str, set[str]]:
    """Every SDP_* variable the code names -> the files naming it: sdp_jupyter/ and tools/ (string
    literals), setup.py (what it reads from os.environ, and ParallelCompile's variable; not the C macros
    it defines), native/ (what getenv, env_int and env_bool read)."""
    where: dict[str, set[str]] = {}
    files = sorted((ROOT / "sdp_jupyter").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    for path in files:
        for name in string_names(path):
            where.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            callee = ast.unparse(node.func)
            if callee in ("os.environ.get", "ParallelCompile") and NAME.fullmatch(str(node.args[0].value)):
                where.setdefault(node.args[0].value, set()).add("setup.py")
    for path in sorted((ROOT / "native").rglob("*.cpp")) + sorted((ROOT / "native").rglob("*.h")):
        for name in re.findall(r"\b(?:getenv|env_int|env_bool)\(\s*\"(SDP_\w+)\"", path.read_text()):
            where.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return where


def test_the_committed_pages_are_what_the_generator_makes(pages):
    diff = gen.stale(pages)
    assert not diff, "docs/reference/ is stale: run python tools/gen_reference.py\n" + diff[:4000]


def test_every_page_says_it_is_generated_and_links_only_to_pages_that_exist(pages):
    for name, text in pages.items():
        assert text.startswith(gen.BANNER), name
        for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", text):
            assert (gen.OUT / target).exists() or target in pages, f"{name} links to {target}"


def test_every_sdp_variable_the_code_names_is_registered():
    unregistered = {n: sorted(f) for n, f in names_in_code().items() if n not in _env.VARIABLES}
    assert not unregistered, f"register these in sdp_jupyter/_env.py VARIABLES: {unregistered}"


def test_every_registered_variable_is_named_by_the_code():
    unused = sorted(set(_env.VARIABLES) - set(names_in_code()))
    assert not unused, f"in sdp_jupyter/_env.py VARIABLES but no code reads or sets them: {unused}"


def test_the_variable_scan_sees_every_kind_of_source():
    where = names_in_code()
    assert "sdp_jupyter/comm/communicator.py" in where["SDP_TIMEOUT"]
    assert "setup.py" in where["SDP_BUILD_JOBS"] and "SDP_NO_INTRINSICS" not in where
    assert "native/src/transport.cpp" in where["SDP_SOCKET_BUFFER"]


def test_an_unregistered_sdp_name_is_refused_where_it_is_read(monkeypatch):
    monkeypatch.setenv("SDP_NOT_REGISTERED", "3")
    for read in (lambda: _env.env_int("SDP_NOT_REGISTERED", 1), lambda: _env.env_str("SDP_NOT_REGISTERED"),
                 lambda: _env.env_bool("SDP_NOT_REGISTERED", False)):
        with pytest.raises(KeyError, match="SDP_NOT_REGISTERED"):
            read()
    assert _env.env_int("WORLD_SIZE", 1, environ={"WORLD_SIZE": "4"}) == 4  # other names are not its business


def test_an_undocumented_magic_option_makes_the_pages_stale(monkeypatch, pages):
    real = gen.magic_parsers()

    def planted():
        rows = []
        for spelling, func, parser in real:
            if spelling == "%sdp_stop":
                parser = copy.deepcopy(parser)
                parser.add_argument("--planted-option", help="an option no page lists")
            rows.append((spelling, func, parser))
        return rows

    monkeypatch.setattr(gen, "magic_parsers", planted)
    diff = gen.stale(dict(pages, **{"magics.md": gen.magics_page()}))
    assert "+| `--planted-option` |" in diff


def test_a_removed_variable_makes_the_pages_stale(monkeypatch, pages):
    trimmed = {k: v for k, v in _env.VARIABLES.items() if k != "SDP_SPIN"}
    monkeypatch.setattr(_env, "VARIABLES", trimmed)
    diff = gen.stale(dict(pages, **{"environment.md": gen.environment_page()}))
    assert re.search(r"^-\| `SDP_SPIN` \|", diff, re.M)


def test_a_command_line_missing_from_the_generator_stops_it(monkeypatch):
    entry_points = dict(gen.ENTRY_POINTS)
    del entry_points["sdp_jupyter.doctor"]
    monkeypatch.setattr(gen, "ENTRY_POINTS", entry_points)
    with pytest.raises(SystemExit, match="sdp_jupyter.doctor"):
        gen.cli_page()
