"""notebooks/04_sagemaker.ipynb end to end in a real kernel, against moto (SDP_SAGEMAKER_MOTO=1).

In that mode the notebook starts a local moto server and the SageMaker stand-in of
tests/moto_fixtures.py, which runs the job's two hosts on this machine with SageMaker's own Torchrun
driver and writes their output into moto's CloudWatch Logs. So the `%%sdp_train --target sagemaker`
cell goes through the magic, the SDK, the request checks, S3 uploads, the container entry, report()'s
log lines, the CloudWatch mirror, the reader and the result download, with nothing reaching AWS.
"""
from __future__ import annotations

import json

import pytest

from conftest import REPO

pytest.importorskip("sagemaker.train")
pytest.importorskip("moto.server")

pytestmark = pytest.mark.slow


def test_sagemaker_notebook_runs_against_moto(tmp_path, monkeypatch):
    from sdp_jupyter.main_job import execute

    monkeypatch.setenv("SDP_SAGEMAKER_MOTO", "1")
    monkeypatch.setenv("SDP_JOBS_DIR", str(tmp_path / "jobs"))
    nb = execute(REPO / "notebooks" / "04_sagemaker.ipynb", tmp_path / "executed")
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    summary = json.loads(next(line for line in text.splitlines() if line.startswith("SUMMARY "))[8:])
    assert summary["state"] == "succeeded" and summary["status"] == "Completed"
    assert summary["result"]["world"] == 2 and summary["result"]["steps"] == 20
    assert summary["result"]["final_loss"] < 1.0  # it trained
    assert summary["ranks"] == [0, 1] and summary["last_step"] == 19
    assert summary["hosts_logged"] == [True, True]
    assert summary["transitions"][0] == "Starting" and summary["transitions"][-1] == "Completed"
    assert "running against a local moto server" in text
    train = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith("%%sdp_train"))
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in train.outputs), \
        "the job view widget was not displayed"
    job = tmp_path / "jobs" / "sm-demo"
    assert sorted(p.name for p in (job / "logs").glob("algo-*.log")) == ["algo-1.log", "algo-2.log"]
    # each host's CloudWatch stream, mirrored: the cell's own output on the host it ran on
    assert "rank 0/2 on algo-1 (cpu); train channel: 1 file(s)" in (job / "logs" / "algo-1.log").read_text()
    assert "rank 1/2 on algo-2 (cpu); train channel: 1 file(s)" in (job / "logs" / "algo-2.log").read_text()
    assert len((job / "metrics" / "rank-1.jsonl").read_text().splitlines()) == 20
    assert (job / "result.pkl").is_file() and (job / "sagemaker_request.json").is_file()
