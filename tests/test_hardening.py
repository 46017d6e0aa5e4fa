"""Issue 11: no silent wrong result, no hang, no way in. Each test reproduces one scenario."""
from __future__ import annotations

import os

import pytest

from _ranks import run_ranks

pytestmark = pytest.mark.slow


def test_mismatch_never_returns_success():
    """4 ranks on one node, the last passing 12 elements and the others 10, in a fresh group each
    time: every rank must raise every time (a lost error message once meant a silent success)."""
    iterations = int(os.environ.get("SDP_TEST_MISMATCH_ITERATIONS", "2000"))
    budget = float(os.environ.get("SDP_TEST_MISMATCH_SECONDS", "25"))
    results = run_ranks("engine_workers:mismatch_repeated", 4, 4, args=(iterations, budget), timeout=budget + 90)
    bad = [r for r in results if not r.ok]
    assert not bad, "\n".join(f"rank {r.rank}: {r.error}\n{r.output[-2000:]}" for r in bad)
    runs = results[0].value["runs"]
    assert runs >= 20, f"only {runs} iterations ran"
    wrong = {r.rank: r.value["successes"] for r in results if r.value["successes"]}
    assert not wrong, f"collectives that returned success although the counts differed (rank: iterations): {wrong}"
