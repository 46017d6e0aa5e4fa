"""torch's side of a work handle: `SmddpWork` wraps the communicator's `Work` (sdp_jupyter.comm), which
does the waiting; here are only what torch asks of a `dist._Work` (a future for DDP's reducer, the
result, the sender of a receive from any source) and torch's error type."""
from __future__ import annotations

import datetime
import queue
import threading

import torch
import torch.distributed as dist

from sdp_jupyter.comm import SmddpError, Work


class SmddpBackendError(SmddpError, dist.DistBackendError):
    """A collective failed (peer lost, timeout, mismatch): torch's `DistBackendError`, so
    torchelastic, Ray and user code that catch torch's type catch ours; `except SmddpError`
    keeps working."""


def backend_error(exc: BaseException | str) -> SmddpBackendError:
    """The error torch's tools expect: they look for " Timed out " (gloo and NCCL say it that way)."""
    msg = str(exc)
    if "timed out" in msg and " Timed out " not in msg:
        msg = "smddp: " + msg.replace("timed out", "Timed out", 1)
    return SmddpBackendError(msg)


class SmddpUnsupportedError(NotImplementedError):
    """An operation the smddp engine does not do yet; the message names it and the way around."""


def unsupported(op: str, instead: str):
    raise SmddpUnsupportedError(f"smddp does not implement {op} yet; {instead}")


class FutureCompleter:
    """Completes the futures of works that are not done yet when asked for one (DDP's reducer asks),
    in one small thread per process group; callers that never ask pay nothing."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="smddp-futures", daemon=True)
        self._thread.start()

    def put(self, work: "SmddpWork") -> None:
        self._queue.put(work)

    def close(self) -> None:
        self._queue.put(None)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            if work is None:
                return
            work.settle_future()


class SmddpWork(dist._Work):
    """wait() blocks (GIL released) until the engine is done; get_future() for DDP. `comm_work` is
    the communicator's Work, which holds the engine's integer handles and the buffers it writes
    into until the operation is done."""

    def __init__(self, completer: FutureCompleter, work: Work, result):
        super().__init__()
        self.comm_work = work
        self._result = result
        self._future: torch.futures.Future | None = None
        self._completer = completer

    def wait(self, timeout=None) -> bool:
        if timeout is None:  # what torch passes for a blocking call: the short way (small calls are us)
            self.comm_work.wait()
            return True
        # a timeout bounds messages (withdrawn when it passes); a collective runs to its end or to
        # the group's deadline (SDP_TIMEOUT): the engine cannot withdraw one that other ranks take part in
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout or 0.0)
        self.comm_work.wait(seconds if seconds > 0 else None)
        return True

    def is_completed(self) -> bool:
        return self.comm_work.is_completed()

    def is_success(self) -> bool:
        return self.comm_work.succeeded

    def get_future(self) -> torch.futures.Future:
        with _future_lock:
            if self._future is not None:
                return self._future
            self._future = torch.futures.Future()
        try:
            done = self.is_completed()
        except SmddpError:
            done = True
        if done:  # no hand-off to the completer thread when the engine has already finished
            self.settle_future()
        else:
            self._completer.put(self)
        return self._future

    def settle_future(self) -> None:
        try:
            self.comm_work.wait()
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            self._future.set_exception(exc)
        else:
            self._future.set_result(self._result)

    def result(self):
        return self._result

    def _source_rank(self) -> int:
        """The sender of a receive from any source (torch asks once it is done)."""
        self.comm_work.wait()
        src = self.comm_work.source
        return -1 if src is None else src


# get_future is called once per DDP bucket, never on the all_reduce fast path: one lock for all
# works instead of one made per work.
_future_lock = threading.Lock()
