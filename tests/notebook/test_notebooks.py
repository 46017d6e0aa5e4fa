"""Every notebook in notebooks/ runs top to bottom in a real kernel (nbclient).

The kernel's environment lacks PYTEST_CURRENT_TEST (with it, ipykernel stops capturing subprocess
output) and points SDP_JOBS_DIR at a private folder, so the jobs a notebook starts are checked for
leftover processes after the kernel has shut down.

07_slurm's kernel runs on h0 of the Slurm test cluster (the `slurm_hosts` fixture, started for that
notebook only), as a notebook's kernel on a login node would: Slurm's commands reach slurmctld only
from the test hosts' network, and SLURM_CONF is the kernel's environment, not the notebook's.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import REPO, wait_no_processes
from tools.main_job import cell_seconds, execute

NOTEBOOKS = sorted(p for p in (REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, tmp_path, monkeypatch, request):
    jobs = tmp_path / "jobs"
    monkeypatch.setenv("SDP_JOBS_DIR", str(jobs))
    # 04_sagemaker runs against a local moto server, never AWS, even where credentials exist
    monkeypatch.setenv("SDP_SAGEMAKER_MOTO", "1")
    km = slurm_hosts = None
    if path.name == "07_slurm.ipynb":
        slurm_hosts = request.getfixturevalue("slurm_hosts")
        for key, value in slurm_hosts.env({}).items():  # the kernel's environment (kernel_env) carries it
            monkeypatch.setenv(key, value)
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)  # the kernel submits, as on a login node
        km = slurm_hosts.cluster.kernel_manager(0, tmp_path, cwd=path.parent)
    nb = execute(path, tmp_path / "executed", km=km)  # raises CellExecutionError naming the failing cell
    assert wait_no_processes(jobs) == [], "a job process outlived the notebook's kernel"
    if path.name == "01_quickstart.ipynb":
        check_quickstart(nb, jobs)
    if slurm_hosts is not None:
        check_slurm(nb, jobs, slurm_hosts)
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


def check_slurm(nb, jobs: Path, slurm_hosts):
    code = [c for c in nb.cells if c.cell_type == "code"]
    train = next(c for c in code if c.source.startswith("%%sdp_train --target slurm --nodes 3"))
    text = "".join(o.get("text", "") for o in train.outputs if o.get("output_type") == "stream")
    assert "Job slurm-quickstart: succeeded" in text, text[-3000:]
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in train.outputs), \
        "the job view widget was not displayed"
    print(f"\nslurm training cell (3 nodes of the Slurm test cluster): {cell_seconds(train):.1f} s "
          "from a fresh kernel, queue and allocation included")
    sinfo = next(c for c in code if c.source == "!sinfo")
    said = "".join(o.get("text", "") for o in sinfo.outputs)
    assert "debug*" in said and "h[1-3]" in said, said
    all_text = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "test accuracy on 450 held-out digits: 0." in all_text
    status = json.loads((jobs / "slurm-quickstart" / "status.json").read_text())
    assert status["state"] == "succeeded" and sorted(status["host_names"]) == ["h1", "h2", "h3"], status
    assert f"Slurm job {status['slurm_job_id']} ran on: " in all_text
    assert (jobs / "slurm-quickstart" / "result.pkl").is_file()
    assert any((jobs / "slurm-quickstart" / "metrics").glob("rank-*.jsonl")), "sdp_jupyter.report() wrote no metrics"
    assert slurm_hosts.wait_clean(30) == {}, "a rank, an agent or a Slurm job outlived the notebook"
