"""The handle of an asynchronous operation: a collective (engine handles), messages (mailbox
handles), or both at once (a collective split between the node's shared memory and messages to
other nodes). One object per operation and nothing below it but integers: it is made on every
all_reduce, where microseconds count at 4 KiB."""
from __future__ import annotations

import re
import threading
import time
from typing import Any, Callable

from sdp_jupyter.comm.codes import EngineError, SmddpError


# How long a failed message waits for the engine to name a rank that died before it (see
# Work._message_failed): the engine checks its links every 20 ms when idle; on a loaded 2-core host a
# check can come hundreds of milliseconds late (benchmarks/kill_stress.py).
CAUSE_GRACE_S = 0.5
_RANK = re.compile(r"\brank (\d+)\b")  # the peer a message's error names first


class Channels:
    """What a group's works wait on: its engine and mailbox, and how a failure is raised (the
    torch adapter makes torch's DistBackendError; the numpy face SmddpError)."""

    __slots__ = ("engine", "mailbox", "error", "failed")

    def __init__(self, engine, mailbox, error: Callable[[str], BaseException] = SmddpError,
                 failed: Callable[[str], None] | None = None):
        self.engine = engine
        self.mailbox = mailbox
        self.error = error
        self.failed = failed  # told of every failure's message: the flight recorder


class Work:
    """wait() blocks (the GIL released) until done, runs the `finish` steps (copies back), then
    lets go of the buffers it kept alive; it re-raises the first failure on every later call. A
    receive's wait() returns its sender's rank (`source`).

    `after`, when given, holds one step per engine handle (or None), run as soon as that handle is
    done and before the next is waited for: the torch adapter copies a staged chunk back to the
    GPU while the engine reduces the next one. A step must be safe to run twice (the adapter runs
    them early too, when it sees a chunk done).

    `wait(timeout)` bounds the messages (none or 0: the group's timeout); a message that times out
    is withdrawn, so nothing writes into its buffer afterwards. A collective runs to its end or to
    the group's deadline whatever the timeout: the engine cannot withdraw one that other ranks take
    part in, and its buffers are only let go after it."""

    __slots__ = ("_ch", "_handles", "_messages", "_keep", "_finish", "_after", "_lock", "_done", "_error", "source")

    def __init__(self, channels: Channels, handles=(), messages=(), keepalive: Any = None,
                 finish: tuple[Callable[[], None], ...] | list = (), after: tuple | None = None):
        self._ch = channels
        self._handles = handles    # the engine's
        self._messages = messages  # the mailbox's
        self._keep = keepalive
        self._finish = finish
        self._after = after  # None, or one step (or None) per engine handle
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self.source: int | None = None

    def wait(self, timeout: float | None = None) -> int | None:
        """Block (the GIL released) until done, run the `finish` steps, and return a receive's sender
        rank (None for other work). A failure raises, here and on every later call. `timeout` bounds
        the wait for posted messages (None or 0: no bound of its own); a collective runs to its end or
        to the group's deadline (the communicator's timeout, SDP_TIMEOUT)."""
        with self._lock:
            if self._done:
                if self._error is not None:
                    raise self._error
                return self.source
            try:
                if self._messages:
                    try:
                        self._wait_messages(float(timeout or 0.0))
                    except EngineError as exc:
                        cause = self._message_failed(str(exc), bool(timeout))
                        if cause == str(exc):
                            raise
                        raise EngineError(cause) from None
                    finally:  # the engine's part runs to its end before any buffer goes (peers read them)
                        if self._handles:
                            self._wait_engine()
                else:
                    self._wait_engine()
                for f in self._finish:
                    f()
            except EngineError as exc:
                self._error = self._ch.error(str(exc))
                if self._ch.failed is not None:
                    self._ch.failed(str(exc))
                raise self._error from None
            finally:
                self._done = True
                self._keep = None
            return self.source

    def _wait_engine(self) -> None:
        wait = self._ch.engine.wait
        if self._after is None:
            for h in self._handles:
                wait(h, 0.0)
            return
        for h, step in zip(self._handles, self._after, strict=True):
            wait(h, 0.0)
            if step is not None:
                step()

    def _message_failed(self, message: str, own_timeout: bool) -> str:
        """A message failed because its peer died, broke the connection or missed the group's
        deadline. That peer may only have left because a third rank died: then the engine, whose
        links and liveness sockets watch every node, learns of the death within a few of its 20 ms
        idle checks, and its message (naming the rank that died) is the one to raise; it is waited
        for briefly. Otherwise this failure is the cause: the engine fails with it and passes it on,
        so that this rank's peers name that peer, not this rank, whose exit follows. A timeout the
        caller chose (the message is withdrawn and the group goes on) or a group already shut down
        is neither, and neither is a message that failed on its own (a size mismatch): the group goes
        on. Returns the message to raise."""
        lost = "connection" in message or ("Timed out" in message and not own_timeout)
        if not lost or "was shut down" in message:
            return message  # a size mismatch, a timeout the caller chose: this message's own failure
        peer = _RANK.search(message)
        engine = self._ch.engine
        try:
            # A peer that left may have left because of a third: wait for the engine's account. A
            # deadline is different: in a chain of receives every rank's deadline passes at once, so
            # nobody would hear of anybody in the grace; such a timeout names its own peer at once.
            deadline = time.monotonic() + (CAUSE_GRACE_S if "connection" in message else 0.0)
            while True:
                known = engine.broken_message()
                if known:  # the engine's account, unless it only names the same peer (then ours says more)
                    return message if peer and re.search(rf"\brank {peer.group(1)}\b", known) else known
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.01)
            engine.report(message)
        except Exception:  # noqa: BLE001 - a closed engine cannot pass anything on
            pass
        return message

    def _wait_messages(self, timeout_s: float) -> None:
        wait = self._ch.mailbox.wait
        handles = list(self._messages)
        deadline = time.monotonic() + timeout_s
        try:
            while handles:
                left = max(deadline - time.monotonic(), 1e-3) if timeout_s else 0.0
                self.source = wait(handles[0], left)
                handles.pop(0)
        except EngineError:
            for h in handles[1:]:  # withdraw the others before their buffers go
                try:
                    wait(h, 1e-3)
                except EngineError:
                    pass
            raise

    def is_completed(self) -> bool:
        """Whether the work is done, without waiting (it does not run the finish steps: wait() does);
        a failed group raises."""
        if self._done:
            return True
        try:
            test = self._ch.mailbox.test
            if not all(test(h) for h in self._messages):
                return False
            test = self._ch.engine.test
            return all(test(h) for h in self._handles)
        except EngineError as exc:
            raise self._ch.error(str(exc)) from None

    @property
    def succeeded(self) -> bool:
        """Done, and without an error."""
        return self._done and self._error is None

    @classmethod
    def joined(cls, channels: Channels, works) -> "Work":
        """One work for several (coalesced calls): done when all are, finished in order."""
        works = list(works)
        after = None
        if any(w._after is not None for w in works):
            after = tuple(s for w in works for s in (w._after or (None,) * len(w._handles)))
        return cls(channels, tuple(h for w in works for h in w._handles), tuple(h for w in works for h in w._messages),
                   [w._keep for w in works], tuple(f for w in works for f in w._finish), after)

    def then(self, step: Callable[[], None]) -> "Work":
        """Adds a step run after the others once the work is done (e.g. copying results out)."""
        self._finish = (*self._finish, step)
        return self
