"""A post-mortem pdb on a session rank (`%sdp_debug RANK`): the last failed cell's traceback, looked
into from the notebook while the rank's variables stay as they are.

pdb runs on the rank's main thread (where the cell ran: thread-local state such as the CUDA device
is the cell's), on the traceback kept from the last cell that failed on this rank. Its input lines
come in session cells of kind "debug" (launch/kernel/session_debug.py sends them); when pdb asks for
a line and the cells so far gave none left, the rank answers the cell with pdb's output so far and
reads the next cell: one more "debug" cell gives the next lines, anything else ends pdb (as end of
input does) and is then run as usual. So a debugging exchange is one cell per round trip, answered
in cell order like every cell, and needs no frames but the session's own.

While pdb runs a command (`p slow()`), the session's interrupt (SIGUSR2 -> KeyboardInterrupt) stops
that command: pdb's loop catches it and prompts again.
"""
from __future__ import annotations

import contextlib
import io
import pdb
import sys
from typing import Callable

class Lines:
    """pdb's stdin: the lines the cells gave, then `more()` for the next cell's (None: no more cells
    for pdb, which then reads end of input and quits). `echo`: write each line after its prompt, as a
    terminal would show it (the -c form: nobody typed it)."""

    def __init__(self, out: io.StringIO, more: Callable[[], tuple[list, bool, bool] | None]):
        self.out, self.more = out, more
        self.lines: list[str] = []
        self.echo = False
        self.last = False  # the lines given are all there will be: `q` after them

    def give(self, lines: list, echo: bool, last: bool) -> None:
        self.lines, self.echo, self.last = [str(x).rstrip("\r\n") for x in lines], echo, last

    def readline(self) -> str:
        while not self.lines:
            if self.last:  # so nothing waits for a line no one will send
                if self.echo:
                    self.out.write("q\n")
                return "q\n"
            given = self.more()
            if given is None:
                return ""  # end of input: pdb quits
            self.give(*given)
        line = self.lines.pop(0)
        if self.echo:
            self.out.write(line + "\n")
        return line + "\n"

    # pdb's `interact` and a statement's input() read sys.stdin, which this replaces while pdb runs
    def read(self, size=-1) -> str:
        return self.readline()

    def isatty(self) -> bool:
        return False


class PostMortem:
    """pdb on `tb`, fed by `Lines`; `take()` gives the output since the last take."""

    def __init__(self, tb, more: Callable[[], tuple[list, bool, bool] | None], running: Callable[[bool], None]):
        self.tb = tb
        self.out = io.StringIO()
        self.stdin = Lines(self.out, self._waiting(more, running))
        self.running = running
        self.debugger = pdb.Pdb(stdin=self.stdin, stdout=self.out, nosigint=True, readrc=False)

    def _waiting(self, more, running):
        def wait():
            running(False)  # an interrupt between commands is not one pdb should see
            try:
                return more()
            finally:
                running(True)
        return wait

    def take(self) -> str:
        text = self.out.getvalue()
        self.out.seek(0)
        self.out.truncate()
        return text

    def run(self, lines: list, echo: bool, last: bool) -> list:
        """Drive pdb with `lines` (and further ones from `more`) until it ends; the lines it never read."""
        self.stdin.give(lines, echo, last)
        self.running(True)
        try:
            # a statement's print() (`!print(x)`) and input() go where pdb's own output and input go
            with contextlib.redirect_stdout(self.out), _stdin(self.stdin):
                self.debugger.reset()
                self.debugger.interaction(None, self.tb)
        finally:
            self.running(False)
            sys.settrace(None)  # `step`/`next` in a post-mortem must leave no trace function on the rank
            self.debugger.forget()
        return list(self.stdin.lines)


@contextlib.contextmanager
def _stdin(replacement):
    saved = sys.stdin
    sys.stdin = replacement
    try:
        yield
    finally:
        sys.stdin = saved


def cell_frames(tb):
    """`tb` from the first frame of a session cell on (`<cell ...>`): the rank's cell loop is not the
    user's problem; nor is the hook that made breakpoint() raise."""
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell "):
        tb = tb.tb_next
    last = tb
    while last is not None and last.tb_next is not None:
        if last.tb_next.tb_frame.f_code is no_breakpoint.__code__:
            last.tb_next = None  # a breakpoint() ends the traceback, and pdb opens, at the breakpoint() line
        last = last.tb_next
    return tb


def remember_source(name: str, code: str) -> None:
    """Put a cell's source in linecache under its frames' file name, so pdb's `list`/`ll` and
    tracebacks show its lines (mtime None: checkcache keeps it, as IPython does for its cells)."""
    import linecache

    linecache.cache[name] = (len(code), None, code.splitlines(True), name)


def no_breakpoint(*args, **kwargs):
    """sys.breakpointhook on a session rank: a live pdb inside a running cell is not served (its
    prompt would have to reach the notebook while the kernel waits for the cell's answers: see
    docs/session.md), and the rank has no terminal, so breakpoint() fails the cell at that line, and
    `%sdp_debug RANK` opens pdb on that very frame."""
    raise RuntimeError("breakpoint() on a session rank: pdb cannot prompt inside a running cell (the rank has no "
                       "terminal). The cell fails here instead; %sdp_debug RANK opens pdb on this frame, with its "
                       "variables (or raise an exception where you want to stop)")
