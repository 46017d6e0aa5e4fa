"""Shared fixtures: a private jobs directory per test and a way to find a job's processes."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Shared fixtures (tests/helpers/), after the plugin that makes a SIGTERM tear them all down (terminate):
# the cluster-in-a-box hosts, an sshd on them, a Ray cluster and a Slurm cluster on them,
# the local AWS stand-in (moto) for the SageMaker tests.
# Session-scoped ones start on first use and are shared by every module that asks for them.
pytest_plugins = ["helpers.terminate", "helpers.cluster", "helpers.sshd", "helpers.raycluster", "helpers.slurmcluster",
                  "helpers.moto"]


# Parallel runs (./dev.sh test runs pytest-xdist's `-n 3 --dist loadgroup`): tests that share one
# machine-wide thing run on one worker, one after another, as in a serial run. Every other test goes to
# the workers a file at a time, so a module's fixtures (a moto server, a built engine) start once.
#   hosts:     every file with a test on the shared test hosts (cluster4, and the sshd, Ray and Slurm
#              clusters on them)
#   browser:   one JupyterLab server and one chromium for every browser test
#   notebooks: the notebooks, executed once per session (helpers/notebooks.py); the docs site, which
#              shows the copies they leave and so runs after them (the `last` marker); and Ray Train's
#              test, which like notebook 06 starts a Ray cluster on this machine
# The controller schedules (GroupScheduling); which files use the test hosts only the workers' collection
# knows (a fixture's closure), so they write that list where the controller reads it (GROUPS_DIR).
# xdist's own xdist_group mark is not used: with pytest 9.2 it no longer groups anything
# (pytest-dev/pytest-xdist#1386).
NOTEBOOK_GROUP = ("tests/notebook/test_notebooks.py", "tests/notebook/test_newcomer_path.py",
                  "tests/ui/test_setup_widget.py", "tests/launch/targets/sagemaker/test_sagemaker_notebook.py",
                  "tests/house/test_docs_site.py", "tests/torch/test_integrations.py")
GROUPS_DIR = "SDP_TEST_GROUPS_DIR"
# The groups given out first (the rest follow in collection order): the longest, so that no worker is
# left with one of them at the end (seconds in a 3-worker run on 2 cores: hosts about 1400, notebooks
# 700, the native builds 430, torch's own suite 300, the browser 90).
LONGEST_FIRST = ("hosts", "notebooks", "tests/engine/test_native_builds.py", "tests/torch/test_conformance.py",
                 "browser")


def xdist_group_of(path: str, files_on_hosts) -> str:
    """The group of the test file `path` (relative to the checkout, with /): see above."""
    if path in files_on_hosts:
        return "hosts"
    if path.startswith("tests/browser/"):
        return "browser"
    return "notebooks" if path in NOTEBOOK_GROUP else path


def pytest_configure(config):
    from helpers.terminate import is_xdist_controller  # imported here: pytest loads it as a plugin first

    if is_xdist_controller(config) and config.getoption("dist", "no") == "loadgroup":
        import tempfile

        os.environ[GROUPS_DIR] = tempfile.mkdtemp(prefix="sdp-test-groups-")  # the workers inherit it


def pytest_unconfigure(config):
    from helpers.terminate import is_xdist_controller

    if is_xdist_controller(config) and os.environ.get(GROUPS_DIR):
        import shutil

        shutil.rmtree(os.environ.pop(GROUPS_DIR), ignore_errors=True)


def pytest_collection_modifyitems(session, config, items):
    """Tests marked `last` run after every other test (the docs site shows the notebooks the suite
    executed). A worker of a parallel run writes which files use the test hosts."""
    items.sort(key=lambda item: item.get_closest_marker("last") is not None)  # stable: the rest keep their order
    where = os.environ.get(GROUPS_DIR)
    if where and hasattr(config, "workerinput"):
        import json

        path = {item: Path(str(item.path)).relative_to(REPO).as_posix() for item in items}
        on_hosts = {path[item] for item in items if "cluster4" in getattr(item, "fixturenames", ())}
        rank = {group: i for i, group in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(xdist_group_of(path[item], on_hosts), len(rank)))  # stable
        mine = Path(where) / f"{config.workerinput['workerid']}.json"
        mine.with_suffix(".tmp").write_text(json.dumps(sorted(on_hosts)))
        mine.with_suffix(".tmp").replace(mine)  # whole or absent: the controller may read it at once


@pytest.hookimpl(optionalhook=True)  # a hook of xdist: a run without it (-p no:xdist) has no such hook
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # the workers' order (LONGEST_FIRST), not the most tests first

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling, a scope being xdist_group_of the test's file."""
        _on_hosts = None

        def _split_scope(self, nodeid: str) -> str:
            if self._on_hosts is None:  # read once: every worker collected the same tests, and all have finished
                import json

                self._on_hosts = set()
                where = os.environ.get(GROUPS_DIR)  # unset: no worker wrote one (no groups but the files)
                for f in Path(where).glob("*.json") if where else ():
                    self._on_hosts.update(json.loads(f.read_text()))
            return xdist_group_of(nodeid.split("::")[0], self._on_hosts)

    return GroupScheduling(config, log)


def job_processes(root) -> list:
    """Live processes (workers, samplers) whose SDP_JOB_DIR lies under `root`."""
    import psutil

    root = os.path.realpath(root)
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid == os.getpid() or p.status() == psutil.STATUS_ZOMBIE:
                continue
            env = p.environ()
            args = p.cmdline()
        except (psutil.Error, OSError):
            continue
        job_dir = env.get("SDP_JOB_DIR") or next((a for a in args if a.startswith(root)), None)
        if job_dir and os.path.realpath(job_dir).startswith(root):
            found.append(p)
    return found + [p for p in warm_ranks(root) if p.pid not in {f.pid for f in found}]


def warm_ranks(root) -> list:
    """Live ranks forked by a warm pool for jobs under `root`: their /proc environ and cmdline are the
    pool's (docs/warm.md), so they are found from each job's status.json ("start": "warm", "pids")."""
    import json

    import psutil

    found = []
    for status_file in Path(root).glob("*/status.json"):
        try:
            status = json.loads(status_file.read_text())
        except (OSError, ValueError):
            continue
        if status.get("start") != "warm":
            continue
        for pid in status.get("pids") or []:
            try:
                p = psutil.Process(int(pid))
                if p.status() != psutil.STATUS_ZOMBIE and "sdp_jupyter.launch.host.warm" in p.cmdline():
                    found.append(p)
            except (psutil.Error, OSError, ValueError, TypeError):
                continue
    return found


def worker_processes(root) -> list:
    """The rank processes (not the samplers) of jobs under `root`."""
    return [p for p in job_processes(root) if "sdp_jupyter.launch.rank.worker" in p.cmdline()
            and "--module" not in p.cmdline()]


def wait_no_processes(root, timeout: float = 15.0) -> list:
    """Wait until no process of a job under `root` is left; return those still alive at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        left = job_processes(root)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.fixture
def jobs_dir(tmp_path, monkeypatch):
    """SDP_JOBS_DIR pointing at a fresh folder; fails the test if any job process outlives it."""
    root = tmp_path / "jobs"
    root.mkdir()
    monkeypatch.setenv("SDP_JOBS_DIR", str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    yield root
    from sdp_jupyter.launch import jobs

    for job in jobs():
        if job.dir.is_relative_to(root) and not job.done:
            job.stop()
    left = wait_no_processes(root)
    assert not left, f"orphan processes left by the test: {[(p.pid, p.cmdline()) for p in left]}"


@pytest.fixture
def python():
    return sys.executable
