"""notebooks/04_sagemaker.ipynb end to end in a real kernel, with no AWS credentials.

Without credentials the notebook starts a local moto server and the SageMaker stand-in of
sdp_jupyter.testing.sagemaker_standin (product code, not the test tree), which runs the job's two hosts on this machine with SageMaker's own Torchrun
driver and writes their output into moto's CloudWatch Logs. So the `%%sdp_train --target sagemaker`
cell goes through the magic, the SDK, the request checks, S3 uploads, the container entry, report()'s
log lines, the CloudWatch mirror, the reader and the result download, with nothing reaching AWS.
It runs from a temporary folder that holds only a copy of the notebook: nothing of tests/ is on
its path, as for a user's copy of it.
"""
from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO

pytest.importorskip("sagemaker.train")
pytest.importorskip("moto.server")

pytestmark = pytest.mark.slow


def test_sagemaker_notebook_runs_without_aws_from_any_folder(tmp_path, monkeypatch):
    from tools.executed import execute

    # no credentials anywhere boto3 looks, and no flag: the notebook must choose the stand-in itself
    monkeypatch.delenv("SDP_SAGEMAKER_MOTO", raising=False)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
                "AWS_ENDPOINT_URL", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
                "AWS_WEB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("SDP_JOBS_DIR", str(tmp_path / "jobs"))
    folder = tmp_path / "somewhere"
    folder.mkdir()
    notebook = folder / "04_sagemaker.ipynb"
    shutil.copy(REPO / "notebooks" / "04_sagemaker.ipynb", notebook)
    assert [p.name for p in folder.iterdir()] == ["04_sagemaker.ipynb"]
    nb = execute(notebook, tmp_path / "executed")  # the kernel's working directory is `folder`
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    summary = json.loads(next(line for line in text.splitlines() if line.startswith("SUMMARY "))[8:])
    assert summary["state"] == "succeeded" and summary["status"] == "Completed"
    assert summary["result"]["world"] == 2 and summary["result"]["steps"] == 20
    assert summary["result"]["final_loss"] < 1.0  # it trained
    assert summary["ranks"] == [0, 1] and summary["last_step"] == 19
    assert summary["hosts_logged"] == [True, True]
    assert summary["transitions"][0] == "Starting" and summary["transitions"][-1] == "Completed"
    first = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert first.startswith("no AWS credentials found: running against a local moto server at http://127.0.0.1:")
    assert "moto_fixtures" not in "".join(c.source for c in nb.cells) and "tests" not in nb.cells[1].source
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
