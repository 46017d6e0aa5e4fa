"""Every notebook in notebooks/ runs top to bottom in a real kernel (nbclient).

The kernel's environment lacks PYTEST_CURRENT_TEST (with it, ipykernel stops capturing subprocess
output) and points SDP_JOBS_DIR at a private folder, so the jobs a notebook starts are checked for
leftover processes after the kernel has shut down.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, wait_no_processes
from tools.main_job import cell_seconds, execute

NOTEBOOKS = sorted(p for p in (REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path, monkeypatch):
    jobs = tmp_path / "jobs"
    monkeypatch.setenv("SDP_JOBS_DIR", str(jobs))
    # 04_sagemaker runs against a local moto server, never AWS, even where credentials exist
    monkeypatch.setenv("SDP_SAGEMAKER_MOTO", "1")
    nb = execute(path, tmp_path / "executed")  # raises CellExecutionError naming the failing cell
    assert wait_no_processes(jobs) == [], "a job process outlived the notebook's kernel"
    if path.name == "01_quickstart.ipynb":
        check_quickstart(nb, jobs)
    if path.name == "05_model_parallel.ipynb":  # tp x pp with --backend smddp: no gloo group at all
        logs = (jobs / "gpt_tp2_pp2" / "logs")
        said = [(logs / f"rank-{r}.log").read_text() for r in range(4)]
        assert all("process groups on: smddp\n" in s for s in said), said[0][-2000:]


def check_quickstart(nb, jobs: Path):
    outputs = {c.source.splitlines()[0]: c for c in nb.cells if c.cell_type == "code"}
    train = next(c for first, c in outputs.items() if first.startswith("%%sdp_train --nodes 4"))
    text = "".join(o.get("text", "") for o in train.outputs if o.get("output_type") == "stream")
    assert "Job quickstart: succeeded" in text and "4 node(s)" in text
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in train.outputs), \
        "the job view widget was not displayed"
    print(f"\nquickstart training cell: {cell_seconds(train):.1f} s from a fresh kernel")
    all_text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "test accuracy on 450 held-out digits: 0." in all_text
    job = jobs / "quickstart"
    assert sorted(p.name for p in (job / "logs").glob("rank-*.log")) == [f"rank-{r}.log" for r in range(4)]
    assert (job / "result.pkl").is_file() and (job / "script.py").read_text().startswith("# %%sdp_train")
    assert any((job / "metrics").glob("rank-*.jsonl")), "sdp_jupyter.report() wrote no metrics"
