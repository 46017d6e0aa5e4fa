"""A pytest plugin: SIGTERM stops the run the way Ctrl-C does, so every fixture's teardown runs.

Without it a SIGTERM (what a CI runner or `kill` sends) ends pytest at once: the daemons that
session fixtures started (JupyterLab, the moto server, munged, a Ray head) outlive it. With it the
signal becomes a KeyboardInterrupt, and pytest's session finish tears every fixture down.
(The test hosts of sdp_jupyter.testing.cluster also tear themselves down on SIGTERM, then call
this handler: see `_on_sigterm` there.)"""
from __future__ import annotations

import signal
import threading


def _interrupt(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a second SIGTERM ends the run at once
    raise KeyboardInterrupt("SIGTERM: stopping the test run, tearing its fixtures down")


_before = []


def pytest_configure(config):
    if threading.current_thread() is threading.main_thread():
        _before.append(signal.signal(signal.SIGTERM, _interrupt))


def pytest_unconfigure(config):
    if _before and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _before.pop())
