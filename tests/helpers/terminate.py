"""A pytest plugin: SIGTERM stops the run the way Ctrl-C does, so every fixture's teardown runs.

Without it a SIGTERM (what a CI runner or `kill` sends) ends pytest at once: the daemons that
session fixtures started (JupyterLab, the moto server, munged, a Ray head) outlive it. With it the
signal becomes a KeyboardInterrupt, and pytest's session finish tears every fixture down.
(The test hosts of sdp_jupyter.testing.cluster also tear themselves down on SIGTERM, then call
this handler: see `_on_sigterm` there.)

In a parallel run (pytest-xdist) the fixtures live in the workers: the controller hands the signal on
to each of them and goes on; each worker tears its fixtures down and reports the interruption, and
xdist then ends the run as it does after a Ctrl-C."""
from __future__ import annotations

import os
import signal
import threading

_before = []
_controller = []  # [True] in the controller of a parallel run


def _interrupt(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the run at once
    if _controller and _signal_workers():
        return  # xdist stops the run when the workers report their interruption
    raise KeyboardInterrupt("SIGTERM: stopping the test run, tearing its fixtures down")


def _signal_workers() -> int:
    """SIGTERM to each worker (the controller's only children: it runs no test itself); how many got it."""
    import psutil

    sent = 0
    for worker in psutil.Process(os.getpid()).children():
        try:
            worker.send_signal(signal.SIGTERM)
            sent += 1
        except psutil.Error:
            pass
    return sent


def pytest_configure(config):
    if threading.current_thread() is threading.main_thread():
        _before.append(signal.signal(signal.SIGTERM, _interrupt))
        if is_xdist_controller(config):
            _controller.append(True)


def is_xdist_controller(config) -> bool:
    """Whether this pytest is the controller of a parallel run (it hands out tests and runs none)."""
    return not hasattr(config, "workerinput") and bool(config.getoption("numprocesses", None))


def pytest_unconfigure(config):
    if _before and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _before.pop())
        _controller.clear()
