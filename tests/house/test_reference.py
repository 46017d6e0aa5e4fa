"""docs/reference/ is made by tools/gen_reference.py from the code: the committed pages must be what it
makes now, and every SDP_* variable the code names must be in sdp_jupyter/_env.py's registry (the source
of environment.md), and every registry entry named by the code."""
from __future__ import annotations

import ast
import copy
import importlib.util
import json
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
    literals), notebooks/*.ipynb (their code cells), setup.py (what it reads from os.environ or through _env's
    env_* readers, and ParallelCompile's variable; not the C macros it defines), native/ (what getenv, env_int
    and env_bool read)."""
    where: dict[str, set[str]] = {}
    files = sorted((ROOT / "sdp_jupyter").rglob("*.py")) + sorted((ROOT / "tools").glob("*.py"))
    registry = ROOT / "sdp_jupyter" / "_env.py"  # names every variable: it would make every one look used
    for path in (f for f in files if f != registry):
        for name in string_names(path):
            where.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    for node in ast.walk(ast.parse((ROOT / "setup.py").read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            callee = ast.unparse(node.func)
            reads = callee in ("os.environ.get", "ParallelCompile") or re.fullmatch(r"(_env\.)?env_\w+", callee)
            if reads and NAME.fullmatch(str(node.args[0].value)):
                where.setdefault(node.args[0].value, set()).add("setup.py")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):  # what the example notebooks' code reads
        for cell in (c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"):
            for name in NAME.findall("".join(cell["source"])):
                where.setdefault(name, set()).add(str(path.relative_to(ROOT)))
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
    assert "notebooks/04_sagemaker.ipynb" in where["SDP_SAGEMAKER_ROLE"]


def test_an_unregistered_sdp_name_is_refused_where_it_is_read(monkeypatch):
    monkeypatch.setenv("SDP_NOT_REGISTERED", "3")
    for read in (lambda: _env.env_int("SDP_NOT_REGISTERED", 1), lambda: _env.env_str("SDP_NOT_REGISTERED"),
                 lambda: _env.env_bool("SDP_NOT_REGISTERED", False)):
        with pytest.raises(KeyError, match="SDP_NOT_REGISTERED"):
            read()
    assert _env.env_int("WORLD_SIZE", 1, environ={"WORLD_SIZE": "4"}) == 4  # other names are not its business


def plant_stop_option(monkeypatch, **help) -> None:
    """%sdp_stop gains a --planted-option (with `help=` when given) in what the generator reads."""
    real = gen.magic_parsers()

    def planted():
        rows = []
        for spelling, func, parser in real:
            if spelling == "%sdp_stop":
                parser = copy.deepcopy(parser)
                parser.add_argument("--planted-option", **help)
            rows.append((spelling, func, parser))
        return rows

    monkeypatch.setattr(gen, "magic_parsers", planted)


def test_an_undocumented_magic_option_makes_the_pages_stale(monkeypatch, pages):
    plant_stop_option(monkeypatch, help="an option no page lists")
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


# ----------------------------------------------------------------------------- every entry has a meaning
def test_an_option_without_a_meaning_stops_the_generator(monkeypatch):
    plant_stop_option(monkeypatch)  # no help=
    with pytest.raises(SystemExit, match=r"magics.md: no meaning for %sdp_stop --planted-option"):
        gen.magics_page()


def test_a_public_member_without_a_docstring_stops_the_generator(monkeypatch):
    from sdp_jupyter.launch.kernel.job import Job

    monkeypatch.setattr(Job.summary, "__doc__", None)
    monkeypatch.setattr(Job.state, "__doc__", "   ")  # blank is no meaning either
    with pytest.raises(SystemExit, match=r"api.md: no meaning for (sdp_jupyter.Job.state, sdp_jupyter.Job.summary|sdp_jupyter.Job.summary, sdp_jupyter.Job.state)"):
        gen.api_page()


def test_a_constant_without_its_comment_stops_the_generator(monkeypatch):
    monkeypatch.setattr(gen, "constant_doc", lambda module, name, depth=0: "")
    with pytest.raises(SystemExit, match=r"no meaning for .*sdp_jupyter.comm.DTYPES"):
        gen.api_page()


def test_a_command_line_flag_without_help_stops_the_generator(monkeypatch):
    import argparse

    from sdp_jupyter.launch.host import warm

    def main(argv):
        p = argparse.ArgumentParser(prog="python -m sdp_jupyter.launch.host.warm")
        p.add_argument("--socket", help="the socket")
        p.add_argument("--planted-flag")  # no help=
        p.parse_args(argv)

    monkeypatch.setattr(warm, "main", main)
    with pytest.raises(SystemExit, match=r"cli.md: no meaning for python -m sdp_jupyter.launch.host.warm --planted-flag"):
        gen.cli_page()


def test_docstrings_are_rendered_whole():
    """Not just the first paragraph: DDP's argument list (batch_size=) reaches the page, as a list."""
    text = gen.describe("x.DDP", __import__("sdp_jupyter.torch", fromlist=["x"]).DistributedDataParallel, "###",
                        gen.Meanings("test"))
    page = "".join(text)
    assert "\n- batch_size: samples per step on this rank" in page
    assert gen.doc_markdown("One.\n\n    code = 1\n\nTwo *x* <y> a|b `a*b`") == \
        "One.\n\n```python\ncode = 1\n```\n\nTwo \\*x\\* &lt;y&gt; a|b `a*b`\n\n"
    assert gen.doc_cell("One.\n\n- a|b\n- c") == "One.<br>- a\\|b<br>- c"


def test_launch_is_documented_with_its_signature_not_linked_to_itself(pages):
    entry = pages["api.md"].split("### sdp_jupyter.launch\n", 1)[1].split("\n### ", 1)[0]
    assert "sdp_jupyter.launch(spec_or_script: " in entry and "-> 'Job'" in entry
    assert "](#sdp_jupyterlaunch)" not in entry
    assert "Things to know" in entry and "```python" in entry


def test_the_launch_example_is_true(tmp_path, monkeypatch):
    """The example in launch's docstring runs, and gives what its comments say."""
    import ast

    import sdp_jupyter.launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("SDP_JOBS_DIR", raising=False)
    example = next(text for kind, text in gen.doc_blocks(type(sdp_jupyter.launch).__call__.__doc__)
                   if kind == "code" and "sdp_jupyter.launch(" in text)
    namespace: dict = {}
    checked = 0
    for stmt in ast.parse(example).body:
        line = example.splitlines()[stmt.end_lineno - 1]
        said = re.search(r"#\s*('(?:[^'\\]|\\.)*'|-?\d+)", line)
        if said and isinstance(stmt, ast.Expr):
            got = eval(compile(ast.Expression(stmt.value), "<example>", "eval"), namespace)
            assert got == ast.literal_eval(said.group(1)), line
            checked += 1
        else:
            exec(compile(ast.Module([stmt], []), "<example>", "exec"), namespace)
    assert checked == 3


def test_setup_options_have_their_choices_and_the_target_fields():
    """Every Plan field that refuses a value not in its list offers the list as the option's choices;
    --hosts and --address fill the form's SSH hosts and Ray address fields, as %%sdp_train's do."""
    from dataclasses import fields

    from sdp_jupyter import jobsetup, scaling

    options = {kw.get("dest"): kw for _, kw in jobsetup.setup_arguments()}
    for f in fields(scaling.Plan):
        if not isinstance(f.default, str) or f.name == "instance_type":
            continue
        with pytest.raises(ValueError, match=f.name):
            scaling.Plan(**{f.name: "no-such-value"})
        assert tuple(options[f.name]["choices"]), f.name
        for choice in options[f.name]["choices"]:
            scaling.Plan(**{f.name: choice})  # every choice listed is one Plan takes
    assert all(kw.get("help") for kw in options.values())
    setup = jobsetup.setup_from_line("--target ssh --hosts gpu1,gpu2")
    assert setup.values["hosts"] == "gpu1,gpu2" and setup.target_part()["ssh"]["hosts"] == ["gpu1", "gpu2"]
    assert jobsetup.setup_from_line("--target ray --address h1:6379").values["ray_address"] == "h1:6379"


def test_sdp_jobs_takes_the_jobs_directory():
    from sdp_jupyter.magics import SdpMagics

    assert SdpMagics.sdp_jobs.parser.parse_args(["/data/jobs"]).root == "/data/jobs"
    assert SdpMagics.sdp_jobs.parser.parse_args([]).root is None
