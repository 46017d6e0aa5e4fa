"""Many ranks read as one: output lines merged across ranks and failures grouped by identical cause, in
one place every view reads (the job view, `Job.follow`, a session cell's output, the job's error, a
session cell's error and %sdp_jobs). Pure functions over text; no processes, no torch.

- `span(ranks)`: a rank set as people write it, `0-7`, `1,3,5-6`; `label(ranks)`: `rank 3` / `ranks 0-7`.
- `LineMerger`: (rank, line) as they come -> (ranks, line) groups. The same line from several ranks
  within WINDOW_S of its first arrival is one group, so the lines of one step merge while a rank's own
  lines keep their own label; each rank's lines come out in the order it wrote them. `Stream` is what
  a terminal, a cell and the job view write of it, by --ranks-output.
- `group_failures({rank: text})`: ranks whose last traceback (exception line and stack) is identical,
  together; `headline` / `describe` say it in one line ("ranks 1-3 raised ValueError: boom").
"""
from __future__ import annotations

import collections
import itertools
import re
import time

WINDOW_S = 1.0  # how long a line waits for the same line from other ranks (ranks of one step drift apart)
LOOKAHEAD = 16  # how far down a rank's waiting lines a head's text is looked for (bounds the work per line)
RAW = "raw"  # --ranks-output raw: every rank's lines, each with its own [rank R] label, not merged


def span(ranks) -> str:
    """`0-7`, `1,3,5-6`: sorted, runs of three or more consecutive ranks as a range, pairs as `5-6`."""
    out, run = [], []
    for r in sorted(set(int(r) for r in ranks)):
        if run and r == run[-1] + 1:
            run.append(r)
            continue
        if run:
            out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [r]
    if run:
        out.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(out)


def label(ranks) -> str:
    """`rank 3` for one rank, `ranks 0-7` for several."""
    ranks = set(ranks)
    return f"rank {span(ranks)}" if len(ranks) == 1 else f"ranks {span(ranks)}"


def prefixed(ranks, text: str) -> str:
    """A merged line as the views print it: `[ranks 0-7] epoch 1 done`."""
    return f"[{label(ranks)}] {text}"


class LineMerger:
    """Merge the same line from several ranks into one (ranks, line) group.

    `add(rank, text)` as lines arrive: each rank's lines wait in its own queue. `ready()` takes groups
    off the queues' heads, oldest head first (`_next`: one no other rank still has further down): its
    text with every rank whose head is the same text and came within `window` of it. A group goes out once no rank can still join it (every
    expected rank has a line waiting, so every head is known) or its window has passed; the oldest head
    not ready holds back the rest, so output keeps the order lines came in. Merging heads only keeps each
    rank's lines in the order it wrote them, and lets a shared line merge even after ranks' own lines
    (every rank's own `I am rank R`, then the same traceback from each). `flush()` takes everything (the
    job or cell ended). Not thread-safe: Stream and the views call it under a lock.
    """

    def __init__(self, ranks, window: float = WINDOW_S, clock=time.monotonic):
        self.expected = set(ranks)
        self.window = window
        self.clock = clock
        self._queues: dict[int, collections.deque] = {}  # rank -> (arrival, seq, text) waiting
        self._seq = 0

    def add(self, rank: int, text: str) -> None:
        self._seq += 1
        self._queues.setdefault(rank, collections.deque()).append((self.clock(), self._seq, text))

    def ready(self) -> list[tuple[frozenset, str]]:
        """The groups that are settled, in the order their first lines came."""
        return self._take(final=False)

    def flush(self) -> list[tuple[frozenset, str]]:
        return self._take(final=True)

    def _take(self, final: bool) -> list[tuple[frozenset, str]]:
        out = []
        now = self.clock()
        while True:
            heads = {r: q[0] for r, q in self._queues.items() if q}
            if not heads:
                return out
            rank = self._next(heads)
            first, _seq, text = heads[rank]
            # the head itself, and the same text from other ranks within the window (0: lines go alone)
            group = {rank} | {r for r, (t, _, head) in heads.items() if head == text and t - first < self.window}
            settled = final or now - first >= self.window or all(r in heads for r in self.expected)
            if not settled:
                return out
            for r in group:
                self._queues[r].popleft()
            out.append((frozenset(group), text))

    def _next(self, heads: dict) -> int:
        """The head to take next: the oldest whose text no other rank has further down its queue (that
        rank's earlier lines go first, so the same line can merge with it: each rank's own line, then
        the same traceback); the oldest of all when every head is held so (A, B on one rank, B, A on another)."""
        order = sorted(heads, key=lambda r: heads[r][:2])
        further: dict[str, float] = {}  # text -> its earliest arrival below a queue's head
        for q in self._queues.values():
            for t, _, text in itertools.islice(q, 1, LOOKAHEAD):
                further[text] = min(t, further.get(text, t))
        for rank in order:
            first, _, head = heads[rank]
            if head not in further or further[head] - first >= self.window:
                return rank
        return order[0]


class Stream:
    """The text a terminal, a cell or a view writes of many ranks' lines, by --ranks-output `mode`:
    "all": merged (`[ranks 0-7] text`, a rank's own line `[rank R] text`); RAW: every line with its
    own `[rank R] `; "0": rank 0's lines alone, as they are. One rank: lines as they are. Thread-safe:
    `add` from the job's reader threads, `take` from the writer."""

    def __init__(self, world_size: int, mode: str = "all", window: float = WINDOW_S):
        import threading

        self.every = mode in ("all", RAW)
        self.labelled = self.every and world_size > 1
        merge = mode == "all" and world_size > 1
        self._merger = LineMerger(range(world_size), window=window if merge else 0.0)  # 0: lines go alone
        self._lock = threading.Lock()

    def add(self, rank: int, text: str) -> None:
        if self.every or rank == 0:
            with self._lock:
                self._merger.add(rank, text)

    def add_seen(self, seen: dict) -> None:
        """Lines that came before ({rank: [line, ...]}): line i of every rank side by side (a step's lines)."""
        for i in range(max(map(len, seen.values()), default=0)):
            for rank, lines in sorted(seen.items()):
                if i < len(lines):
                    self.add(rank, lines[i])

    def take(self, final: bool = False) -> str:
        """The settled lines' text (every line left, when `final`)."""
        with self._lock:
            groups = self._merger.flush() if final else self._merger.ready()
        return "".join(prefixed(ranks, text) if self.labelled else text for ranks, text in groups)


# ---------------------------------------------------------------------- failures
_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^\s*File "[^"]*", line \d+')


def last_traceback(text: str) -> tuple[str, str]:
    """A rank's output's last Python traceback: (the stack, its exception line). Without a traceback
    header (the tail was cut, or the rank died of a signal): the frames present and the last line."""
    lines = [ln for ln in text.rstrip().splitlines()]
    start = max((i for i, ln in enumerate(lines) if ln.strip() == _TRACEBACK), default=None)
    if start is None:
        last = next((ln for ln in reversed(lines) if ln.strip()), "")
        frames = [ln for ln in lines if _FRAME.match(ln)]
        return "\n".join(frames), last.strip()
    block = [ln for ln in lines[start:] if ln.strip()]
    # the exception line is the first line after the stack that is not a frame or its source (a
    # message may run over several lines: the rest of the block)
    i = 1
    while i < len(block) and block[i].startswith(" "):
        i += 1
    return "\n".join(block[:i]), "\n".join(ln.rstrip() for ln in block[i:]).strip() or block[-1].strip()


class FailureGroup:
    """Ranks that failed the same way: `error` (the exception line), `text` (one rank's full text:
    its traceback), `kind` ("raised", or what the caller says: "lost a peer", "died", "interrupted")."""

    def __init__(self, ranks, error: str, text: str, kind: str = "raised"):
        self.ranks, self.error, self.text, self.kind = sorted(ranks), error, text, kind

    def headline(self) -> str:
        """`ranks 1-3 raised ValueError: boom on a worker` (the exception's first line)."""
        first = self.error.splitlines()[0] if self.error else ""
        if self.kind == "raised":
            return f"{label(self.ranks)} raised {first}" if first else f"{label(self.ranks)} failed"
        return f"{label(self.ranks)} {self.kind}" + (f": {first}" if first else "")

    def to_dict(self) -> dict:
        return {"ranks": self.ranks, "error": self.error, "kind": self.kind}

    def __repr__(self) -> str:
        return f"<FailureGroup {self.headline()}>"


def group_failures(texts: dict, kinds: dict | None = None) -> list[FailureGroup]:
    """{rank: its failure's text} -> groups of ranks with the same kind, exception line and stack, in the
    order of each group's first rank in `texts` (put the cause first). `kinds`: {rank: kind}, default
    "raised" (a traceback) or "failed" (none); ranks of different kinds never share a group."""
    kinds = kinds or {}
    groups: dict[tuple, FailureGroup] = {}
    for rank, text in texts.items():
        stack, error = last_traceback(text or "")
        # no traceback (SystemExit's message, a C library's last words): the rank "failed", saying that
        key = (kinds.get(rank, "raised" if _TRACEBACK in (text or "") else "failed"), stack, error)
        if key in groups:
            groups[key].ranks = sorted(groups[key].ranks + [rank])
        else:
            groups[key] = FailureGroup([rank], error, (text or "").rstrip(), key[0])
    return list(groups.values())


def failure_lines(groups) -> list[str]:
    """Groups as an error lists them: the first (the cause) with its text in full, the others' last line;
    `ranks 1-3 failed:` then the traceback once."""
    return [f"{label(g.ranks)} {g.kind}:\n{g.text}" if i == 0 else
            f"{label(g.ranks)} {g.kind}: {g.text.splitlines()[-1] if g.text else ''}" for i, g in enumerate(groups)]


def describe(groups) -> str:
    """Groups in one line, as %sdp_jobs shows them: `ranks 1-3 raised ValueError: boom; rank 0 lost a
    peer`. `groups`: FailureGroup objects or their to_dict() (status.json keeps the dicts)."""
    parts = []
    for g in groups:
        if isinstance(g, dict):
            g = FailureGroup(g.get("ranks", []), g.get("error", ""), "", g.get("kind", "raised"))
        parts.append(g.headline())
    return "; ".join(parts)
