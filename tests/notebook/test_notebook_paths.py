"""Every notebook runs from any working folder, as a user who downloads one runs it: no code cell reads a
path relative to the working folder ("../benchmarks/...", "./data"), and notebook 10's results cell finds
the benchmark results from another folder, or says where they are and what to do when they are not there."""
from __future__ import annotations

import json
import re
import subprocess
import sys

from conftest import REPO

NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
# a string literal that is a path relative to the working folder: "..", "../x", "./x" (also in Path(".."))
RELATIVE = re.compile(r"""(["'])(?:\.\.|\.\.?[/\\][^"']*)\1""")


def _code_cells(path):
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def test_no_notebook_reads_a_path_relative_to_the_working_folder():
    assert NOTEBOOKS
    found = [f"{path.name}: {line.strip()}" for path in NOTEBOOKS for cell in _code_cells(path)
             for line in cell.splitlines() if RELATIVE.search(line) and not line.lstrip().startswith("#")]
    assert found == [], f"relative to the working folder (the notebook then runs only from notebooks/): {found}"
    # the pattern catches what notebook 10 once did, and leaves a default "." of an environment variable alone
    assert RELATIVE.search('pathlib.Path("..") / "benchmarks"') and RELATIVE.search("open('../data/x.csv')")
    assert RELATIVE.search('open("./data.txt")') and not RELATIVE.search('os.environ.get("SM_CHANNEL_TRAIN", ".")')


def _results_cell() -> str:
    return _code_cells(REPO / "notebooks" / "10_headline_benchmark.ipynb")[0]


def _run(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_the_headline_notebook_finds_its_results_from_another_folder(tmp_path):
    p = _run(_results_cell(), tmp_path)
    assert p.returncode == 0, p.stderr
    assert "parameters" in p.stdout and "ours-smddp" in p.stdout, p.stdout


def test_without_a_checkout_the_headline_notebook_says_where_the_results_are(tmp_path):
    # sdp_jupyter installed from a wheel: no benchmarks/ beside it, and none above the working folder
    (tmp_path / "site" / "sdp_jupyter").mkdir(parents=True)
    (tmp_path / "site" / "sdp_jupyter" / "__init__.py").write_text("")
    (tmp_path / "work").mkdir()
    code = f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r})\n" + _results_cell()
    p = _run(code, tmp_path / "work")
    assert p.returncode != 0
    said = p.stderr.strip().splitlines()[-1]
    assert said.startswith("FileNotFoundError: benchmarks/results/headline.json is not in this folder"), said
    assert "Run this notebook from inside a checkout" in said and "benchmarks/headline.py" in said, said
