"""A session rank's pdb, driven from the notebook: post-mortem on the last failed cell's traceback
(`%sdp_debug RANK`), or live where a cell calls breakpoint() (sys.breakpointhook on a session rank).

pdb runs on the rank's main thread (where the cell ran: thread-local state such as the CUDA device
is the cell's). Its input lines come in session cells of kind "debug" (launch/kernel/session_debug.py
sends them); when pdb asks for a line and the cells so far gave none left, the rank answers the
current debug cell with pdb's output so far and reads the next cell: one more "debug" cell gives the
next lines, anything else ends pdb (as end of input does) and is then run as usual. So a debugging
exchange is one cell per round trip, answered in cell order like every cell, and needs no frames but
the session's own.

A breakpoint() stops a cell that is running: the rank's first prompt goes back as an answer to that
cell marked "debugging" (not its result), which the kernel's wait for the cell serves (input() in the
notebook), sending the lines as debug cells marked "live" that only this rank reads (the others may
still be inside the cell). When pdb lets the cell go on (`c`, or `n` until the next stop) the last
debug cell is answered closed and the cell's own answer comes when it ends.

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
            if self.last:  # so nothing waits for a line no one will send: `q`, then end of input (for
                self.last = False  # pdb's `interact`, which `q` does not end) until pdb has quit
                self.more = lambda: None
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


class Exchange:
    """pdb's input and output as debug cells over `link` (the rank's session: answer(n, answer), read(),
    hold(cell), running(on), rank, and cell_now, the running cell's number). `pending`: the debug cell
    whose answer waits for pdb's next prompt; None when a breakpoint() stopped a running cell, which the
    first prompt then tells the kernel (an answer to that cell marked "debugging": not its result)."""

    def __init__(self, link, pending: int | None, label: str):
        self.link, self.pending, self.label = link, pending, label
        self.out = io.StringIO()
        self.stdin = Lines(self.out, self.more)

    def take(self) -> str:
        text = self.out.getvalue()
        self.out.seek(0)
        self.out.truncate()
        return text

    def more(self) -> tuple[list, bool, bool] | None:
        self.link.running(False)  # an interrupt between commands is not one pdb should see
        try:
            report = {"open": True, "output": self.take(), "cell": self.label}
            if self.pending is None:
                self.link.answer(self.link.cell_now, {"debugging": report})
            else:
                self.link.answer(self.pending, {"ok": True, "ran": True, "debug": report})
            self.pending = None
            cell = self.link.read()
            while cell["kind"] == "debug" and cell.get("live") and cell.get("rank") != self.link.rank:
                cell = self.link.read()  # another rank's breakpoint, served first: this one waits its turn
            if cell["kind"] == "debug" and cell.get("rank") == self.link.rank:
                self.pending = cell["n"]
                return cell.get("lines") or [], bool(cell.get("echo")), bool(cell.get("last"))
            self.link.hold(cell)  # not for pdb: it ends (end of input), and the cell loop runs this one
            return None
        finally:
            self.link.running(True)

    def resumed(self) -> None:
        """pdb let the program go on (a post-mortem: ended): the debug cell waiting is answered, closed."""
        if self.pending is not None:
            self.link.answer(self.pending, {"ok": True, "ran": True, "debug": {
                "open": False, "output": self.take(), "cell": self.label, "unused": list(self.stdin.lines)}})
            self.pending = None


class RemotePdb(pdb.Pdb):
    """pdb whose every stop is served through an Exchange; our own frames (the cell loop) are skipped,
    so `next` past a cell's end does not step into the loop."""

    def __init__(self, exchange: Exchange):
        super().__init__(stdin=exchange.stdin, stdout=exchange.out, skip=["sdp_jupyter.*"], nosigint=True,
                         readrc=False)
        self.exchange = exchange

    def interaction(self, frame, traceback):
        try:
            super().interaction(frame, traceback)
        finally:
            self.exchange.resumed()


def post_mortem(link, tb, cell: dict, label: str) -> None:
    """pdb on `tb` from debug cell `cell` on, until it ends; answers every debug cell it reads."""
    exchange = Exchange(link, cell["n"], label)
    exchange.stdin.give(cell.get("lines") or [], bool(cell.get("echo")), bool(cell.get("last")))
    debugger = RemotePdb(exchange)
    link.running(True)
    try:
        # a statement's print() (`!print(x)`) and input() go where pdb's own output and input go
        with contextlib.redirect_stdout(exchange.out), _stdin(exchange.stdin):
            debugger.reset()
            debugger.interaction(None, tb)
    finally:
        link.running(False)
        sys.settrace(None)  # `step`/`next` in a post-mortem must leave no trace function on the rank
        debugger.forget()


def breakpoint_hook(link):
    """sys.breakpointhook for a session rank: pdb on the caller's frame, each stop served from the
    notebook (launch/kernel/session_debug.py) while the cell waits; the other ranks go on."""
    import os
    import threading

    pid = os.getpid()

    def hook(*args, **kwargs):
        # the cell's connection is read by the cell's own thread only; a forked DataLoader worker shares it
        if os.getpid() != pid or threading.current_thread() is not threading.main_thread():
            raise RuntimeError("breakpoint() in a session rank is served from the notebook only in the cell's own "
                               "thread, not in another thread or a DataLoader worker process. Fix: call it where "
                               "the cell runs (num_workers=0 to step through loading), or raise there and use "
                               "%sdp_debug RANK on the failed frame")
        RemotePdb(Exchange(link, None, link.cell_label)).set_trace(sys._getframe(1))
    return hook


@contextlib.contextmanager
def _stdin(replacement):
    saved = sys.stdin
    sys.stdin = replacement
    try:
        yield
    finally:
        sys.stdin = saved


def cell_frames(tb):
    """`tb` from the first frame of a session cell on (`<cell ...>`) to the last before pdb's own: the
    rank's cell loop and the debugger are not the user's problem."""
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<cell "):
        tb = tb.tb_next
    last = tb
    while last is not None and last.tb_next is not None:
        if last.tb_next.tb_frame.f_globals.get("__name__") == "bdb":
            last.tb_next = None  # `q` at a breakpoint: the BdbQuit comes from pdb's tracing, not the cell
        last = last.tb_next
    return tb


def remember_source(name: str, code: str) -> None:
    """Put a cell's source in linecache under its frames' file name, so pdb's `list`/`ll` and
    tracebacks show its lines (mtime None: checkcache keeps it, as IPython does for its cells)."""
    import linecache

    linecache.cache[name] = (len(code), None, code.splitlines(True), name)

