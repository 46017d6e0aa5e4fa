"""The suite's parallel run (./dev.sh test: pytest-xdist, `-n 3 --dist loadgroup`) keeps what must stay
together on one worker: a test file's tests (its module fixtures start once, and some tests build on the
one before), and the groups of tests/conftest.py. xdist's own group mark stopped grouping under pytest
9.2 without a word (pytest-dev/pytest-xdist#1386): this shows ours does."""
from __future__ import annotations

import collections
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("xdist", reason="pytest-xdist comes with the test extra (pip install '.[test]')")


def test_the_groups_follow_the_files():
    from conftest import NOTEBOOK_GROUP, xdist_group_of

    on_hosts = {"tests/launch/targets/test_ssh.py", "tests/engine/test_cluster.py"}
    assert xdist_group_of("tests/launch/targets/test_ssh.py", on_hosts) == xdist_group_of("tests/engine/test_cluster.py",
                                                                                  on_hosts) == "hosts"
    assert xdist_group_of("tests/browser/test_setup_browser.py", on_hosts) == "browser"
    assert {xdist_group_of(f, on_hosts) for f in NOTEBOOK_GROUP} == {"notebooks"}
    assert xdist_group_of("tests/advice/test_scaling.py", on_hosts) == "tests/advice/test_scaling.py"


def test_a_parallel_run_keeps_each_file_on_one_worker():
    files = ["tests/advice/test_instances.py", "tests/advice/test_scaling.py", "tests/advice/test_advisor.py"]
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadgroup",
                          "-v", *files], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    workers = collections.defaultdict(set)
    for worker, path in re.findall(r"^\[(gw\d+)\] \[ *\d+%\] PASSED (tests/[^:]+)::", run.stdout, re.M):
        workers[path].add(worker)
    assert set(workers) == set(files), run.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
