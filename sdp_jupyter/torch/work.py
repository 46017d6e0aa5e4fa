"""torch's side of a work handle: `SmddpWork` wraps the communicator's `Work` (sdp_jupyter.comm), which
does the waiting; here are only what torch asks of a `dist._Work` (a future for DDP's reducer, the
result, the sender of a receive from any source) and torch's error type."""
from __future__ import annotations

import collections
import datetime
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


# torch runs a future's then-callbacks in the thread that sets its result: a completer's thread also
# runs user code (a DDP comm hook's callbacks). `_running.completer`: in a completer's thread, that
# completer (see FutureCompleter); a thread of the user's has none.
_running = threading.local()


class FutureCompleter:
    """Settles the futures of works that are not done yet when asked for one (DDP's reducer and its
    comm hooks ask), in one thread, in the order they were asked for (so that callbacks that issue
    collectives issue them in the same order on every rank); callers that never ask pay nothing: the
    thread starts with the first such future.

    That thread runs the futures' callbacks too (torch's way), and a callback may wait for another of
    our futures: PowerSGD's call `all_reduce(..., async_op=True).get_future().wait()`. Queued here,
    such a future would wait for the thread that waits for it, and neither would ever be settled:
    DDP with PowerSGD hung silently (issue 40 item 5). So a future asked for inside a callback goes
    to `nested()`, a completer of its own (its thread is free: only callbacks run here wait for it;
    deeper callbacks go deeper still), and a callback that waits for a future still queued here
    settles it itself (_Future.wait). Either way: every future handed out completes or fails, in the
    worst case when the engine fails the operation at the group's deadline."""

    def __init__(self, level: int = 0):
        self._cv = threading.Condition(threading.Lock())
        self._queue: collections.deque[SmddpWork] = collections.deque()
        self._thread: threading.Thread | None = None
        self._nested: FutureCompleter | None = None
        self._level = level
        self._closed = False

    def put(self, work: "SmddpWork") -> None:
        with self._cv:
            if not self._closed:
                work._future.queued_in = self
                self._queue.append(work)
                if self._thread is None:
                    name = "smddp-futures" + (f"-nested-{self._level}" if self._level else "")
                    self._thread = threading.Thread(target=self._run, name=name, daemon=True)
                    self._thread.start()
                else:
                    self._cv.notify()
                return
        # a shut-down group: its engine is closed (or about to be), so the wait ends at once, in error
        work.settle_future()

    def nested(self) -> "FutureCompleter":
        """The completer for futures asked for inside the callbacks this one runs."""
        with self._cv:
            if self._nested is None:
                self._nested = FutureCompleter(self._level + 1)
                if self._closed:
                    self._nested._closed = True
            return self._nested

    def take(self, work: "SmddpWork") -> bool:
        """Takes `work` out of the queue (its future is then the caller's to settle): False when it
        is not there (a thread has it already)."""
        with self._cv:
            try:
                self._queue.remove(work)
            except ValueError:
                return False
            return True

    def close(self) -> None:
        """The group is shut down: no work is queued any more, and every one still queued is settled
        now, failed unless the engine has finished it (a work the thread is waiting for gets the
        closed engine's error); the threads end."""
        with self._cv:
            self._closed = True
            left = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
            nested = self._nested
        for work in left:
            work.settle_or_fail("the process group was shut down before this operation finished")
        if nested is not None:
            nested.close()

    def _run(self) -> None:
        _running.completer = self
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:  # closed
                    return
                work = self._queue.popleft()
            work.settle_future()


class _Future(torch.futures.Future):
    """The future a work hands out. `queued_in`: the completer whose queue holds its work, while it
    waits there."""

    queued_in: FutureCompleter | None = None
    work: "SmddpWork | None" = None

    def wait(self):
        # A callback (run by a completer's thread) that waits for a future still queued, in this
        # completer or another, settles it here: the thread that would settle it may be this one
        # (e.g. `fa.then(lambda _: fb.wait())` with fa and fb asked for in that order).
        completer, work = self.queued_in, self.work
        if (completer is not None and work is not None and getattr(_running, "completer", None) is not None
                and completer.take(work)):
            work.settle_future()
        return super().wait()


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
        """Block (the GIL released) until the engine is done and return True; a failure raises. A
        `timeout` (seconds or a timedelta) bounds messages only: a collective runs to its end or to
        the group's deadline (SDP_TIMEOUT)."""
        if timeout is None:  # what torch passes for a blocking call: the short way (small calls are us)
            self.comm_work.wait()
            return True
        # a timeout bounds messages (withdrawn when it passes); a collective runs to its end or to
        # the group's deadline (SDP_TIMEOUT): the engine cannot withdraw one that other ranks take part in
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout or 0.0)
        self.comm_work.wait(seconds if seconds > 0 else None)
        return True

    def is_completed(self) -> bool:
        """Whether the engine is done, without waiting; a failed group raises."""
        return self.comm_work.is_completed()

    def is_success(self) -> bool:
        """True once the work has been waited for and succeeded; False before, and after a failure."""
        return self.comm_work.succeeded

    def get_future(self) -> torch.futures.Future:
        """A torch Future (the same one on every call) completed with `result()` once the engine is
        done, or set to the error; what DDP's comm hooks chain on."""
        with _future_lock:
            if self._future is not None:
                return self._future
            self._future = _Future()
        try:
            done = self.is_completed()
        except SmddpError:
            done = True
        if done:  # no hand-off to the completer thread when the engine has already finished
            self.settle_future()
            return self._future
        self._future.work = self  # for _Future.wait, until settled
        running = getattr(_running, "completer", None)
        # asked for inside a callback that a completer's thread runs: not to that thread (see FutureCompleter)
        (self._completer if running is None else running.nested()).put(self)
        return self._future

    def settle_future(self) -> None:
        """Waits for the engine, then completes the future: its then-callbacks run here, in this
        thread (torch's way)."""
        try:
            self.comm_work.wait()
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            self._deliver(exc)
        else:
            self._deliver(None)

    def settle_or_fail(self, why: str) -> None:
        """The group is shut down: settled as usual if the engine has finished, else failed."""
        try:
            done = self.is_completed()
        except SmddpError:
            done = True
        if done:
            self.settle_future()
        else:
            self._deliver(backend_error("smddp: " + why))

    def _deliver(self, error: BaseException | None) -> None:
        fut = self._future
        fut.queued_in = fut.work = None  # no cycle left between the work and its future
        try:
            if error is not None:
                torch._C.Future._set_unwrap_func(fut, _raise_failed)  # what set_exception does, with our value
                fut.set_result(_Failed(error))
            else:
                fut.set_result(self._result)
        except Exception:  # noqa: BLE001 - a completer thread lives on (a callback's own error is its future's)
            pass

    def result(self):
        """What torch gets back: the list of tensors the operation was given (filled in once it is done)."""
        return self._result

    def _source_rank(self) -> int:
        """The sender of a receive from any source (torch asks once it is done)."""
        self.comm_work.wait()
        src = self.comm_work.source
        return -1 if src is None else src


class _Failed:
    """What a failed work's future holds. torch's `Future.set_exception` stores the exception as the
    future's value and only Python's wait() raises it: C++ readers see a value. DDP's reducer takes the
    first tensor it can extract from that value, found none and crashed the rank (SIGSEGV, no message:
    a peer killed mid-backward under torchrun). Extracting tensors pickles the value; this one refuses
    with the error, so the reducer raises it ("Cannot extract tensors from value: SmddpBackendError: ...")
    and Python's wait() raises the error itself."""

    def __init__(self, error: BaseException):
        self.error = error

    def __reduce__(self):
        raise self.error


def _raise_failed(value: _Failed):
    raise value.error


# get_future is called once per DDP bucket, never on the all_reduce fast path: one lock for all
# works instead of one made per work.
_future_lock = threading.Lock()
