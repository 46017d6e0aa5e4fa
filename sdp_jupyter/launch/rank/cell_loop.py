"""A rank of an interactive session (`%sdp_session start`): the process group made once, then one
notebook cell after another run in this rank's `__main__`, which lives as long as the session.

The session's job script is `SCRIPT` below; the worker (launch/rank/worker.py) runs it as any job's
script, so a session's ranks start, stream their output, die with the kernel and stop exactly as a
job's do. The cells come as frames from the node's agent, over the connection each rank opens to
it (SDP_SESSION_CHANNEL, launch/host/session_relay.py); the agent has them from the notebook over
its own channel, the same on every target. A rank waits for the next cell in a blocking read and
answers on the same connection; nothing is polled. Each frame's data is a pickle:

    ready              rank R has its process group: {pid, host, rss}
    cell N             {kind: run | reconnect | shrink | stop | debug, code, ranks, want: none | result | gather,
                        push (the pushed variables' pickle, made once in the kernel), generation and
                        replaced (reconnect), generation and members (shrink), rank, lines, echo, last
                        and live (debug: pdb's input on that rank, launch/rank/postmortem.py)}
    done N             rank R's answer to cell N: {ok, error, interrupted, value, seconds, printed, counts, rss,
                        debug: {output, open, unused, cell, error} (debug)}; or, while cell N runs,
                        {debugging: {output, open, cell}}: a breakpoint() there waits for pdb's input

A cell is interrupted with SIGUSR2 (a KeyboardInterrupt inside the cell, nothing between cells);
SIGINT stays the job's Stop. After a cell that failed somewhere the notebook may send `reconnect`:
the smddp backend then builds its engine connections anew under the same group objects, so a DDP
model made before keeps working; another backend's default group is destroyed and made again
(objects built on the old one must be made again, which the answer says).

A rank that dies is started again by its supervisor with SDP_SESSION_JOIN=<generation>:<cell>:<members>:
it connects at that generation while the others reconnect in that cell, answers it, and serves the cells
after it, with an empty namespace but for `sdp_replaced = True`. Such a session's store runs in a
process of its own (SDP_SESSION_STORE=1, launch/host/session_store.py), so rank 0 can die too.

A rank keeps its session number (RANK: its files, its output, --ranks) for the session's life. The
process group is made over the session's `members`, in order: at first every rank, so a rank's number
in the group is its session number. When a host is gone for good the notebook may send `shrink` with
the members left: every one of them leaves the old group and makes a new one of the members only, at a
new generation, numbered 0..len(members)-1 in the order of their session numbers (`sdp_members` in the
namespace lists them; torch's get_rank() gives the number in the group).
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback

from sdp_jupyter import backends
from sdp_jupyter._env import env_float, env_str
from sdp_jupyter.launch import channel
from sdp_jupyter.launch.rank import postmortem

SCRIPT = "from sdp_jupyter.launch.rank.cell_loop import serve as _sdp_serve\n_sdp_serve(globals())\n"
INTERRUPT = signal.SIGUSR2


class _Cell:
    running = False


class _Counted:
    """sys.stdout or sys.stderr for the session's life, counting the characters written through it, so
    that a cell's answer says whether it printed: the notebook then waits for late lines only after a
    cell that did (a silent `apply` or `x = 1` answers in milliseconds). Everything else is the stream's."""

    def __init__(self, stream):
        self._stream = stream
        self.chars = 0

    def write(self, text):
        self.chars += len(text)
        return self._stream.write(text)

    def writelines(self, lines):
        for line in lines:
            self.write(line)

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _written() -> int:
    """What the counted streams have passed on so far (a stream replaced by the user counts nothing)."""
    return sum(getattr(s, "chars", 0) for s in (sys.stdout, sys.stderr) if isinstance(s, _Counted))


def _interrupt(signum, frame):
    if _Cell.running:
        raise KeyboardInterrupt("interrupted from the notebook")


def _rss() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class RankSession:
    def __init__(self, namespace: dict):
        self.ns = namespace
        self._link = None  # the connection to the node's agent (socket, reader)
        self.rank = int(os.environ.get("RANK", "0"))  # the session's number for this rank: never changes
        self.members = list(range(int(os.environ.get("WORLD_SIZE", "1"))))  # the ranks the group is made of
        self.backend = backends.job_backend()
        self.generation = 0
        self._store = None
        self._groups: dict[tuple, object] = {}
        self._failed = None  # (traceback from the cell's frames on, the cell's label): the last failure here
        self._n = 0  # the number of the next cell to read
        self._held = None  # a cell read while pdb waited for input, run next (launch/rank/postmortem.py)
        self.cell_now, self.cell_label = 0, "0"  # the cell running: where a breakpoint() stopped

    # ------------------------------------------------------------------ the process group
    def connect(self) -> None:
        import torch.distributed as dist

        # empty: the default; a bad number: an error naming the variable, before anything connects
        timeout = env_float("SDP_SESSION_CONNECT_TIMEOUT", 300.0, min=0.001)
        if self.backend == "smddp":
            import sdp_jupyter.torch  # noqa: F401  registers the backend
        import datetime

        # the store runs in its own process (launch/host/session_store.py) when ranks are replaced on
        # death, rank 0 among them; else rank 0 hosts it
        master = self.rank == 0 and not env_str("SDP_SESSION_STORE")
        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                    len(self.members), master,
                                    timeout=datetime.timedelta(seconds=timeout))
        self._init_group()

    def _init_group(self) -> None:
        from sdp_jupyter.torch.generations import make_default_group

        make_default_group(self.backend, self._store, "session", self.generation, self.members.index(self.rank),
                           len(self.members))
        self.ns["sdp_members"] = list(self.members)

    def shrink(self, generation: int, members: list) -> str:
        """Leave the process group and make a new one of `members` only (a host is gone for good): the
        namespace stays; objects built on the old group (a DistributedDataParallel model, groups from
        new_group) must be made again."""
        from sdp_jupyter.torch.generations import leave_every_group

        self._groups.clear()
        leave_every_group(self.backend)  # every group: some hold engines connected to the ranks now gone
        old = [r for r in self.members if r not in members]
        self.generation, self.members = int(generation), [int(r) for r in members]
        self._init_group()
        return (f"the process group was made again of the {len(self.members)} ranks left (session ranks "
                f"{self.members}; in the group 0..{len(self.members) - 1}; rank(s) {old} left): objects built on the "
                "old group (DistributedDataParallel models, groups from new_group) must be made again")

    def reconnect(self, generation: int, replaced: list | None = None) -> str:
        """Make the group usable again after a cell left collectives half done on some ranks, or with
        the ranks in `replaced` started anew (they join by connecting at the same `generation`)."""
        import torch.distributed as dist

        self.generation = int(generation)
        if replaced:  # a replaced rank has none of the groups made for --ranks cells: they go, everywhere
            for group in self._groups.values():
                try:
                    dist.destroy_process_group(group)
                except Exception:  # noqa: BLE001 - a group whose engine the death broke
                    pass
            self._groups.clear()
        if self.backend == "smddp":
            from sdp_jupyter.torch.process_group import reconnect_all

            reconnect_all(self.generation, default_only=bool(replaced))
            return "the smddp engine's connections were made anew under the same process groups: models " \
                   "wrapped in DistributedDataParallel before keep working"
        dist.destroy_process_group()
        self._groups.clear()
        self._init_group()
        return (f"the {self.backend} process group was destroyed and made again: objects built on the old "
                "group (DistributedDataParallel models, groups from new_group) must be made again")

    def counts(self) -> dict:
        """How many collectives and messages this rank's default group has issued (smddp only): equal on
        every rank after a cell means no collective was left half done."""
        try:
            import torch.distributed as dist

            backend = dist.distributed_c10d._get_default_group()
            comm = getattr(backend, "comm", None)
            if comm is None:
                return {}
            stats = comm.stats()
            return {"collectives": int(stats.get("collectives", 0)), "messages": int(stats.get("messages", 0))}
        except Exception:  # noqa: BLE001 - a broken engine: no counts, the notebook reconnects
            return {}

    def group_for(self, ranks):
        """A cell on some ranks gets `sdp_group`, the group of exactly those ranks; every rank makes it
        (torch's new_group is collective), once per set of ranks."""
        import torch.distributed as dist

        if ranks is None or list(ranks) == self.members:
            return None
        key = tuple(ranks)
        if key not in self._groups:  # new_group counts ranks in the group, not the session
            self._groups[key] = dist.new_group([self.members.index(r) for r in key])
        return self._groups[key]

    # ------------------------------------------------------------------ the cells
    def open_link(self, first: int) -> None:
        """Connect to the node's agent (its session relay) and say who this rank is; cells from `first` on."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect("\0" + env_str("SDP_SESSION_CHANNEL"))
        self._link = (conn, conn.makefile("rb"))
        self._send({"type": "hello", "rank": self.rank, "secret": os.environ.get("SDP_JOB_SECRET", ""),
                    "first": first})

    def _send(self, message: dict) -> None:
        self._link[0].sendall(channel.encode(message))

    def ready(self) -> None:
        self._send({"type": "ready", "data": channel.b64(
            _dumps({"pid": os.getpid(), "host": socket.gethostname(), "rss": _rss()}))})

    def next_cell(self, n: int) -> dict:
        """Cell `n` (earlier ones, which a replacement may be handed first, are skipped). The agent gone
        (ChannelClosed): this rank's node is over, and so is the rank."""
        import pickle

        while True:
            frame = channel.decode(self._link[1])
            if frame.get("type") == "cell" and int(frame["n"]) == n:
                return pickle.loads(channel.unb64(frame["data"]))

    def run(self, cell: dict) -> dict:
        ranks = cell.get("ranks")
        answer: dict = {"ok": True, "ran": False}
        if cell["kind"] in ("reconnect", "shrink"):
            try:
                answer["note"] = (self.reconnect(cell["generation"], cell.get("replaced")) if cell["kind"] == "reconnect"
                                  else self.shrink(cell["generation"], cell["members"]))
            except Exception as e:  # noqa: BLE001
                answer.update(ok=False, error=f"the process group could not be made again: {type(e).__name__}: {e}")
            return answer
        if cell["kind"] == "debug":  # for another rank: nothing runs here; whether this rank has a failure to debug
            answer["failed_cell"] = self._failed[1] if self._failed and self._failed[0] is not None else None
            return answer
        if self.rank not in self.members:  # left by a shrink it did not hear (never so on a live host)
            return answer
        group = self.group_for(ranks)
        if ranks is not None and self.rank not in ranks:
            return answer
        if self.rank == (ranks[0] if ranks else 0):  # the dashboard marks where each cell began
            from sdp_jupyter.monitor import reporter

            reporter.emit("cell", cell=cell["n"])
        if cell.get("push"):  # the pushed variables, unpickled here once
            import pickle

            from sdp_jupyter.launch.rank.bootstrap import bind_pushed

            bind_pushed(pickle.loads(cell["push"]), self.ns)
        self.ns["sdp_group"] = group
        self.cell_now, self.cell_label = cell["n"], str(cell.get("label") or cell["n"])
        answer["ran"] = True
        started, written = time.perf_counter(), _written()
        try:
            value = self._exec(cell["code"], f"<cell {cell.get('label') or cell['n']}>", want=cell.get("want", "none"))
        except KeyboardInterrupt:
            answer.update(ok=False, interrupted=True, error=self._trace(sys.exc_info(), cell))
        except BaseException:  # noqa: BLE001 - SystemExit too: the session stays up
            answer.update(ok=False, error=self._trace(sys.exc_info(), cell))
        else:
            first = ranks[0] if ranks else 0
            if value is not None and (cell.get("want") == "gather" or self.rank == first):
                try:
                    answer["value"] = _dumps(value)
                except Exception as e:  # noqa: BLE001
                    answer["value_error"] = f"{type(value).__name__} cannot be pickled: {e}"
        answer["seconds"] = time.perf_counter() - started
        answer["printed"] = _written() - written
        return answer

    def _exec(self, code: str, name: str, want: str):
        from sdp_jupyter.launch.rank.bootstrap import compile_parts

        body, last = compile_parts(code, name, want != "none")
        postmortem.remember_source(name, code)  # pdb's `list` and the traceback show the cell's lines
        _Cell.running = True
        try:
            exec(body, self.ns)
            return eval(last, self.ns) if last is not None else None
        finally:
            _Cell.running = False
            sys.settrace(None)  # a pdb a breakpoint() started (postmortem.py) ends with its cell

    def _trace(self, info, cell: dict) -> str:
        kind, exc, tb = info
        tb = postmortem.cell_frames(tb)
        self._failed = (tb, str(cell.get("label") or cell["n"]))  # kept for %sdp_debug, as %debug keeps its own
        return "".join(traceback.format_exception(kind, exc, tb))

    def debug(self, cell: dict) -> None:
        """Post-mortem pdb on the last cell that failed here, from debug `cell` on (postmortem.py): it
        answers every debug cell pdb reads; a cell read while pdb waited that was not for it ends pdb
        and is held for the loop."""
        if self._failed is None or self._failed[0] is None:
            self._answer(cell["n"], {"ok": True, "ran": True, "debug": {"open": False, "output": "", "error": (
                f"rank {self.rank} has had no failed cell in this session (or only one whose error came "
                "before its code ran), so there is no traceback to look into")}})
            return
        postmortem.post_mortem(self, self._failed[0], cell, self._failed[1])

    # what postmortem.py's pdb uses to talk to the notebook through the cells
    def answer(self, n: int, answer: dict) -> None:
        self._answer(n, answer)

    def read(self) -> dict:
        """The next cell (one held while pdb waited first)."""
        if self._held is not None:
            cell, self._held = self._held, None
            return cell
        cell = self.next_cell(self._n)
        self._n += 1
        return cell

    def hold(self, cell: dict) -> None:
        self._held = cell

    @staticmethod
    def running(on: bool) -> None:
        _Cell.running = on  # an interrupt is a KeyboardInterrupt only while something runs

    def serve(self) -> None:
        signal.signal(INTERRUPT, _interrupt)
        sys.stdout, sys.stderr = _Counted(sys.stdout), _Counted(sys.stderr)
        sys.breakpointhook = postmortem.breakpoint_hook(self)  # pdb served from the notebook (docs/session.md)
        # a replacement for a rank that died (SDP_SESSION_JOIN=generation:cell:members): it joins the group the
        # others make again in that cell, answers it, and goes on from the next one
        join = os.environ.pop("SDP_SESSION_JOIN", "")
        n = 0
        if join:
            generation, n, members = join.split(":")
            self.generation, n = int(generation), int(n)
            self.members = [int(r) for r in members.split(",")]
        self.ns["sdp_replaced"] = bool(join)  # a cell can rebuild what only this rank lost
        self.open_link(n)
        self.connect()
        self.ready()
        if join:
            self._answer(n, {"ok": True, "ran": False, "joined": True, "pid": os.getpid(),
                             "host": socket.gethostname(),
                             "note": f"rank {self.rank} started anew and joined the process group"})
            n += 1
        self._n = n
        while True:
            cell = self.read()
            if cell["kind"] == "stop":
                return
            if cell["kind"] == "debug" and cell.get("rank") == self.rank:
                self.debug(cell)
            elif not (cell["kind"] == "debug" and cell.get("live")):  # a breakpoint's lines: for its rank only
                self._answer(cell["n"], self.run(cell))

    def _answer(self, n: int, answer: dict) -> None:
        answer.update(counts=self.counts(), rss=_rss())
        sys.stdout.flush()
        sys.stderr.flush()
        self._send({"type": "done", "n": n, "data": channel.b64(_dumps(answer))})


def _dumps(value) -> bytes:
    import pickle

    return pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)


def serve(namespace: dict) -> None:
    """The session script's one call: serve cells in `namespace` (the rank's __main__) until `stop`."""
    namespace.pop("_sdp_serve", None)  # the script's own name: not the user's
    RankSession(namespace).serve()
