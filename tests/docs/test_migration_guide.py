"""docs/migration.md's before and after scripts (docs/examples/migration/) run as the page says.

Path A: the torchrun + DDP script under torch.distributed.run (2 processes, gloo, CPU) and its smddp
version through sdp_jupyter's launcher (2 local nodes) train to the same loss. Path B: the script
written for SageMaker's smdistributed runs unchanged as a 2-node smddp job (sdp_jupyter's stand-in
serves the import), through the launch script the page shows; the SDK v2 estimator it replaces
cannot run here (AWS, and SDK v2), so it is checked to compile and to match the launch script's job.
"""
from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from helpers.gloo_exit import aborted_at_exit

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "docs" / "examples" / "migration"
PAGE = REPO / "docs" / "migration.md"
LOSS = re.compile(r"loss on all the data: ([0-9.]+) before, ([0-9.]+) after 40 steps on 2 ranks")


def _losses(text: str) -> tuple[float, float]:
    found = LOSS.findall(text)
    assert len(found) == 1, text[-3000:]
    return float(found[0][0]), float(found[0][1])


def test_the_page_shows_every_example_file_as_it_is():
    """Each file under docs/examples/migration/ is on the page in full, as one ```python block: the code a
    reader copies is the code these tests run."""
    blocks = re.findall(r"^```python\n(.*?)^```$", PAGE.read_text(), flags=re.S | re.M)
    files = sorted(EXAMPLES.glob("*.py"))
    assert len(files) == 5
    for path in files:
        assert path.read_text() in blocks, f"{path.name} is not on the page as it is in the file"


def test_torchrun_script_and_its_smddp_version_train_to_the_same_loss(jobs_dir):
    before = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(EXAMPLES / "torchrun_ddp.py"), "--steps", "40"],
                            capture_output=True, text=True, timeout=180, cwd=jobs_dir)
    # torch's gloo may abort a rank at interpreter exit; excused only after the loss line, which rank 0
    # prints after every rank's last collective (helpers/gloo_exit.py)
    assert before.returncode == 0 or (aborted_at_exit(before.stdout + before.stderr)
                                      and len(LOSS.findall(before.stdout)) == 1), before.stdout + before.stderr
    first, last = _losses(before.stdout)
    assert last < first / 100  # it trained

    import sdp_jupyter

    job = sdp_jupyter.launch(EXAMPLES / "smddp_ddp.py", nodes=2, args=["--steps", "40"])
    assert job.spec.backend == "smddp"
    assert job.wait(180) == "succeeded", job.summary() + job.logs(0) + job.logs(1)
    assert _losses(job.logs(0)) == pytest.approx((first, last), rel=1e-4)
    assert job.result() == pytest.approx({"first": first, "last": last}, rel=1e-4)


def test_a_script_written_for_smdistributed_runs_unchanged_on_two_local_nodes(jobs_dir):
    p = subprocess.run([sys.executable, str(EXAMPLES / "sdp_launch.py")], capture_output=True, text=True,
                       timeout=180, cwd=jobs_dir)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "rank 0 of 2 on algo-1 of ['algo-1', 'algo-2']" in p.stdout, p.stdout  # SageMaker's SM_* variables
    losses = [float(x) for x in re.findall(r"^epoch \d: loss ([0-9.]+)$", p.stdout, flags=re.M)]
    assert len(losses) == 5 and losses[-1] < losses[0] / 10, p.stdout
    name = re.search(r"^(job-\S+): succeeded$", p.stdout, flags=re.M).group(1)
    import torch

    weights = torch.load(jobs_dir / name / "model" / "model.pt", weights_only=True)
    assert set(weights) == {"weight", "bias"}


def _call_keywords(path: Path, func: str) -> dict:
    """The literal keyword arguments of the first call to `func` in `path` (which must compile)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    compile(tree, str(path), "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == func:
            return {k.arg: ast.literal_eval(k.value) for k in node.keywords
                    if isinstance(k.value, (ast.Constant, ast.Dict, ast.List))}
    raise AssertionError(f"no call to {func} in {path.name}")


def test_the_estimator_it_replaces_asks_for_the_same_job():
    """The SDK v2 estimator (the before) and sdp_launch.py's SageMaker launch (the after) ask for the
    same job: smdistributed data parallel = --backend smddp, instance count = --nodes, the same
    instance type and hyperparameters; and that launch passes JobSpec's checks."""
    est = _call_keywords(EXAMPLES / "sagemaker_estimator.py", "PyTorch")
    assert est["distribution"] == {"smdistributed": {"dataparallel": {"enabled": True}}}
    assert est["entry_point"] == "smddp_train.py"
    text = (EXAMPLES / "sdp_launch.py").read_text()
    tree = ast.parse(text)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "launch"]
    ours = {k.arg: ast.literal_eval(k.value) for k in calls[0].keywords if k.arg != "hyperparameters"}
    hps = ast.literal_eval(next(n.value for n in ast.walk(tree)
                                if isinstance(n, ast.Assign) and n.targets[0].id == "hyperparameters"))
    assert ours["target"] == "sagemaker" and ours["backend"] == "smddp"
    assert (ours["nodes"], ours["instance_type"], ours["role"]) == (est["instance_count"], est["instance_type"], est["role"])
    assert hps == est["hyperparameters"]

    from sdp_jupyter.launch import JobSpec

    spec = JobSpec(script=str(EXAMPLES / "smddp_train.py"), target="sagemaker", nodes=ours["nodes"], backend="smddp",
                   hyperparameters=hps, sagemaker={"instance_type": ours["instance_type"], "role": ours["role"]})
    assert spec.sagemaker["instance_type"] == "ml.p4d.24xlarge"
