"""A test run stopped with SIGTERM leaves nothing behind: pytest tears every fixture down
(tests/helpers/terminate.py), the test hosts of sdp_jupyter.testing.cluster included, which tear
themselves down first and then hand the signal on."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sdp_jupyter.testing import cluster as test_hosts

TESTS = Path(__file__).resolve().parent.parent
REPO = TESTS.parent

INNER_TEST = '''
import os, subprocess, time
from pathlib import Path
import pytest

OUT = Path(os.environ["OUT"])

@pytest.fixture(scope="session")
def daemon():
    p = subprocess.Popen(["sleep", "600"])  # stands for JupyterLab, moto, munged...
    (OUT / "daemon").write_text(str(p.pid))
    yield p
    p.kill()
    p.wait()
    (OUT / "torn-down").touch()

@pytest.fixture(scope="session")
def hosts():
    if os.environ.get("WITH_HOSTS") != "1":
        yield None
        return
    from sdp_jupyter.testing.cluster import Cluster
    with Cluster(hosts=1, rate=None) as c:
        (OUT / "hosts").write_text(c.name)
        yield c

def test_waits(daemon, hosts):
    (OUT / "started").touch()
    time.sleep(300)
'''


def _run_and_terminate(tmp_path: Path, with_hosts: bool, plugin: bool = True, args: tuple = ()) -> subprocess.Popen:
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "conftest.py").write_text('pytest_plugins = ["helpers.terminate"]\n' if plugin else "")
    (inner / "test_inner.py").write_text(INNER_TEST)
    env = {**os.environ, "OUT": str(tmp_path), "WITH_HOSTS": "1" if with_hosts else "0",
           "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(inner)],
                            cwd=inner, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "started").exists():
        assert proc.poll() is None, proc.stdout.read().decode()
        assert time.monotonic() < deadline, "the inner test run did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the inner run (its workers too) does not outlive the test
        raise AssertionError("the inner run did not end within 60 s of SIGTERM:\n"
                             + proc.communicate(timeout=30)[0].decode()[-3000:]) from None
    return proc


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _kill_daemon(out: Path) -> None:
    """Whatever the outcome, the inner run's daemon does not outlive this test."""
    pid_file = out / "daemon"
    if pid_file.exists() and _alive(int(pid_file.read_text())):
        os.kill(int(pid_file.read_text()), signal.SIGKILL)


@pytest.mark.parametrize("with_hosts,args", [(False, ()), (True, ()), (True, ("-n", "2", "--dist", "loadgroup"))],
                         ids=["fixtures", "fixtures-and-test-hosts", "parallel-run"])
def test_sigterm_tears_every_fixture_down(tmp_path, with_hosts, args):
    """`parallel-run` is ./dev.sh test's way: the fixtures live in an xdist worker, the signal reaches
    the controller."""
    if with_hosts and test_hosts.available():
        pytest.skip(f"no test hosts here: {test_hosts.available()}")
    try:
        proc = _run_and_terminate(tmp_path, with_hosts, args=args)
        out = proc.stdout.read().decode()
        daemon = int((tmp_path / "daemon").read_text())
        assert (tmp_path / "torn-down").exists() and not _alive(daemon), f"the fixture was not torn down:\n{out}"
        if with_hosts:
            name = (tmp_path / "hosts").read_text()
            left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            assert name not in left, f"test host namespaces left: {left}"
    finally:
        _kill_daemon(tmp_path)


def test_without_the_plugin_the_daemon_would_outlive_the_run(tmp_path):
    """The check above can fail: without the plugin, SIGTERM ends pytest and its daemon survives."""
    try:
        _run_and_terminate(tmp_path, with_hosts=False, plugin=False)
        assert not (tmp_path / "torn-down").exists()
        assert _alive(int((tmp_path / "daemon").read_text()))
    finally:
        _kill_daemon(tmp_path)
