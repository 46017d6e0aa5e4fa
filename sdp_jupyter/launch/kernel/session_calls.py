"""A session driven from Python, as ipyparallel's DirectView is: `execute`, `push`, `pull`, `apply`,
`stop`, and `with` for a session that ends with the block. `sdp_jupyter.session(...)` starts one;
`%sdp_session` and `%%sdp_px` are a face on the same object (launch/kernel/session.py: Session).

    with sdp_jupyter.session(nodes=2, backend="gloo") as s:
        s.push(scale=2, step=step)             # a notebook function goes by value
        s.execute("import torch.distributed as dist; x = step(dist.get_rank())")
        s.pull("x")                            # [x on rank 0, x on rank 1]
        s.apply(lambda k: k * scale, 10)       # [20, 20]

`sdp_jupyter.session` is launch/kernel/session.py's `session`. Every call waits for every rank's answer; a cell that failed raises SessionError with the ranks'
errors, and the session stays up. What goes to the ranks goes by value as --push does
(launch/kernel/push.py): functions, classes and closures defined in the notebook included.
"""
from __future__ import annotations

import sys
import time

# the name a pushed call travels under on the ranks (popped by the very expression that calls it)
_CALL = "_sdp_apply_call"


class SessionCalls:
    """The Python face of a session (mixed into Session, whose `run` and `job` it uses)."""

    def execute(self, code: str, ranks: list | None = None, *, output=None) -> None:
        """Run `code` on every rank (or `ranks`) in the namespace each rank keeps; raises SessionError
        when it failed anywhere. `output`: an object with drain() and close() that shows the ranks'
        output as it comes; None: a CellStream, printing the ranks' lines here, merged as %%sdp_px does."""
        self._call(code, ranks, "none", [], {}, output)

    def push(self, ranks: list | None = None, **values) -> None:
        """Set these variables on every rank (or `ranks`): `push(lr=0.1, Net=Net)`. Notebook functions
        and classes go by value and read the rank's variables there."""
        if values:
            self._call("pass", ranks, "none", list(values), values, None)

    def pull(self, name: str, ranks: list | None = None) -> list:
        """The value of `name` on each rank, as a list in rank order (None for a rank left out)."""
        if not name.isidentifier():
            raise ValueError(f"pull({name!r}): give a variable name, e.g. pull('loss')")
        return self._call(name, ranks, "gather", [], {}, None)

    def apply(self, fn, *args, **kwargs) -> list:
        """`fn(*args, **kwargs)` on every rank: the return values as a list in rank order. `fn` may be a
        notebook function, a lambda or a closure (sent by value, run in the rank's namespace)."""
        if not callable(fn):
            raise TypeError(f"apply: {fn!r} is not callable")
        code = f"(lambda c: c[0](*c[1], **c[2]))(globals().pop({_CALL!r}))"
        return self._call(code, None, "gather", [_CALL], {_CALL: (fn, args, kwargs)}, None)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _call(self, code: str, ranks, want: str, names: list, values: dict, output):
        from sdp_jupyter.launch.kernel.session_result import SessionError

        stream = output if output is not None else CellStream(self.job)
        result = None
        try:
            result = self.run(code, ranks=ranks, want=want, push_names=names, values=values, on_wait=stream.drain)
        finally:
            stream.close(result)
        if result.failed:
            raise SessionError(result.message(), self.job)
        if want == "gather":
            return [result.value(r) if r in result.ranks else None for r in range(self.job.world_size)]
        return None


class CellStream:
    """A session cell's output as it comes (%%sdp_px, Session.execute/pull/apply): with several ranks, a
    line they all printed once with their ranks (`[ranks 0-3] loss 0.5`), a rank's own line `[rank R] ...`
    (rank_groups.Stream; the session's --ranks-output raw: every line with its own rank); after a cell
    whose ranks printed, what arrives just after the last answer is waited for briefly (QUIET seconds;
    the output travels apart from the answers), and what is still waiting to merge goes out when the
    cell ends."""

    QUIET = 0.03

    def __init__(self, job):
        from sdp_jupyter.launch.kernel.rank_groups import RAW, Stream

        self.job = job
        self.stream = Stream(job.world_size, RAW if job.spec.ranks_output == RAW else "all")
        self.last = time.monotonic()
        job.subscribe(self._heard)

    def _heard(self, rank: int, text: str) -> None:
        self.last = time.monotonic()
        self.stream.add(rank, text)

    def drain(self, final: bool = False) -> None:
        text = self.stream.take(final)
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def close(self, result=None) -> None:
        """`result`: the cell's CellResult; None (the cell raised here): wait as after a cell that printed."""
        deadline = time.monotonic() + 0.5
        while (result is None or result.printed) and time.monotonic() - self.last < self.QUIET \
                and time.monotonic() < deadline:
            time.sleep(0.005)
        self.job.unsubscribe(self._heard)
        self.drain(final=True)
