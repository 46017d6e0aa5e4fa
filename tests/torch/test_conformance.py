"""PyTorch's own distributed suite for the operations smddp added (gather, scatter and the object
collective on it, all_gather_coalesced, send/recv, any-source receives, batch_isend_irecv, sparse
all_reduce) and torch's timeout contract, run by `python -m
sdp_jupyter.testing.conformance` with gloo as the reference. The suite tests all_to_all only for MPI;
tests/torch/test_torch_backend.py checks ours against gloo. The full table is a command, not a CI job."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.ranks import ROOT

pytest.importorskip("expecttest")  # torch's suite needs it

CI_TESTS = ("test_gather$", "test_scatter$", "test_scatter_object_list$",
            "test_all_gather_coalesced_simple$", "test_barrier_timeout_global$",
            "test_send_recv$", "test_send_recv_any_source$", "test_batch_isend_irecv_gloo$",
            "test_sparse_all_reduce_sum$")


def test_selection_anchors_and_excludes():
    from sdp_jupyter.testing.conformance import select

    names = ["test_gather", "test_gather_checks", "test_gather_cuda", "test_all_gather"]
    assert select(names, ["test_gather$"]) == ["test_gather"]
    assert select(names, ["gather"]) == ["test_gather", "test_gather_checks", "test_all_gather"]


def test_suite_passes_on_smddp_wherever_it_passes_on_gloo(tmp_path):
    args = [a for t in CI_TESTS for a in ("-k", t)]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "sdp_jupyter.testing.conformance", *args, "--json", "--budget", "420",
                        "--log-dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=500, cwd=ROOT)
    out = p.stdout[p.stdout.index("{"):]
    rows = json.loads(out)["rows"]
    logs = "\n".join(open(tmp_path / f).read()[-1500:] for f in sorted(os.listdir(tmp_path)) if f.endswith(".jsonl"))
    assert len(rows["passes on both"]) == len(CI_TESTS), (rows, logs)
    assert p.returncode == 0
