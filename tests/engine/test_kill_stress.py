"""The kill stress benchmark, short: random ranks SIGKILLed (and one frozen with SIGSTOP) at random
moments, in every layout; no survivor hangs, every survivor names the dead rank (and its host across
test hosts), and the flight recorder's analyser names it too. The long run (1,000 rounds) is
`benchmarks/kill_stress.py --rounds 1000` (docs/benchmarks.md)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO
from sdp_jupyter.testing import cluster

pytestmark = pytest.mark.slow


def _run(tmp_path, *args, timeout: float = 240) -> dict:
    out = tmp_path / "stress.json"
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "kill_stress.py"), *args, "--out", str(out),
                        "--keep", str(tmp_path / "logs")], capture_output=True, text=True, cwd=REPO, timeout=timeout)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-2000:]
    return json.loads(out.read_text())


def test_killed_ranks_are_named_by_every_survivor_fast(tmp_path):
    layouts = "1x4,2x2,4x1" + ("" if cluster.available() else ",2x2h")
    result = _run(tmp_path, "--rounds", "12" if "2x2h" not in layouts else "16", "--layouts", layouts)
    for row in result["rows"]:
        assert row["hangs"] == 0 and row["wrong_name"] == 0 and row["analysis_wrong"] == 0, row
        assert row["lag_max"] < 2.0, row


def test_a_frozen_rank_is_named_at_the_deadline(tmp_path):
    result = _run(tmp_path, "--rounds", "3", "--stop")
    for row in result["rows"]:
        assert row["hangs"] == 0 and row["wrong_name"] == 0 and row["analysis_wrong"] == 0, row
