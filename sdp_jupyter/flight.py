"""The flight recorder's analyser: the ranks' rings and live lines turned into one sentence and a table.

Torch-free and engine-free (it runs in the notebook's kernel, in `sdp-train`, or alone):

    python -m sdp_jupyter.flight JOBDIR        # the cause in one sentence, the last operations per rank, a straggler

Each rank writes `metrics/flight-rank-<RANK>.jsonl` (sdp_jupyter/comm/recorder.py, docs/failures.md): its
ring of recent collectives when something fails, when it is stopped, when a wait passes SDP_HANG_WARN_S
and on request, and every SDP_HANG_WARN_S a live line saying whether it waits in a collective or runs its
own code after one. From those, `analyse()` says, in this order of precedence:

- ranks that disagree: "at #88 rank 1 called broadcast(root 0) while the others called all_reduce";
- a rank that died: "rank 2 (host h2) died (was killed by signal SIGKILL) during all_gather #40 of the default group";
- a rank that stopped moving: "rank 1 (host h1) has made no progress for 30 s, last in barrier #9 of the default group";
- a rank that never came: "rank 3 (host h2) never entered all_reduce #1234 of the default group; ranks 0-2 waited 30 s in it".

A job's status, view and summary show the sentence while the job runs (`live_sentence`), and the job's
error ends with it when the job fails (`cause`).
"""
from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path

from sdp_jupyter import jobdir
from sdp_jupyter.stragglers import Stragglers, stragglers

FIELDS = jobdir.FLIGHT_FIELDS
DEFAULT_WARN_S = 20.0  # SDP_HANG_WARN_S's default (sdp_jupyter/_env.py), for readers that have no rank environment


@dataclass
class Op:
    seq: int
    op: str
    dtype: str
    count: int
    arg: object
    state: str
    posted: float = 0.0
    started: float = 0.0
    ended: float = 0.0

    @classmethod
    def of(cls, fields, row) -> "Op | None":
        try:
            d = dict(zip(fields, row))
            return cls(int(d["seq"]), str(d["op"]), str(d["dtype"]), int(d["count"]), d.get("arg"), str(d["state"]),
                       float(d.get("posted") or 0), float(d.get("started") or 0), float(d.get("ended") or 0))
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def key(self) -> tuple:
        return (self.op, self.dtype, self.count, self.arg)

    def call(self) -> str:
        """"broadcast(root 0)", "all_reduce", "barrier"."""
        if self.rooted:
            return f"{self.op}(root {self.arg})"
        return self.op

    def name(self) -> str:
        return f"{self.op} #{self.seq}"

    # `arg` says which kind of collective this is (comm/recorder.py's entry()): a rooted one's root (an
    # int), a reducing one's op (its name), else None
    @property
    def rooted(self) -> bool:
        return isinstance(self.arg, int) and not isinstance(self.arg, bool)

    @property
    def reducing(self) -> bool:
        return isinstance(self.arg, str)

    @property
    def open(self) -> bool:
        return self.state in ("posted", "started")


@dataclass
class RankLog:
    rank: int
    group: str
    host: str = ""
    ring: list[Op] = field(default_factory=list)
    ring_t: float = 0.0
    ring_reason: str = ""
    error: str = ""
    live: dict | None = None
    live_op: Op | None = None
    seen: float = 0.0  # the newest line of this rank for this group
    world: int = 0     # the group's size, as the rank said
    every: float = 0.0  # how often it writes a live line (its SDP_HANG_WARN_S)

    def position(self) -> Op | None:
        """The newest thing known of this rank: its live line's collective or its ring's newest entry."""
        newest = self.ring[-1] if self.ring else None
        if self.live_op is not None and (newest is None or (self.live_op.seq, self.live_t) >= (newest.seq, self.ring_t)):
            return self.live_op
        return newest

    @property
    def live_t(self) -> float:
        return float((self.live or {}).get("t") or 0)

    def waiting_since(self) -> float | None:
        pos = self.position()
        if pos is None or not pos.open:
            return None
        return pos.started or pos.posted


class FlightLog:
    """Follows a job directory's flight files (or an SDP_FLIGHT_DIR folder) and, with `arrivals`, the
    ranks' "arrivals" metrics lines, each through one jobdir.JsonLinesTail: every update() reads only
    what was written since the last, so a live job's status can ask every second at the cost of its new
    lines, not of every ring written so far. `groups`: {group: {rank: RankLog}}."""

    def __init__(self, folder: str | os.PathLike, arrivals: bool = False, window: int = 600):
        self.folder = Path(folder)
        self.groups: dict[str, dict[int, RankLog]] = {}
        self.arrivals: deque = deque(maxlen=window) if arrivals else deque(maxlen=0)
        self.arrivals_seen = 0  # arrivals records taken so far (a reader knows whether to recompute)
        self._tails: dict[str, jobdir.JsonLinesTail] = {}
        self._want_arrivals = arrivals

    def _paths(self) -> list[Path]:
        if not (self.folder / jobdir.METRICS).is_dir():  # a bare SDP_FLIGHT_DIR folder
            return sorted(self.folder.glob("flight-rank-*.jsonl"))
        paths = jobdir.flight_paths(self.folder)
        return paths + (jobdir.metrics_paths(self.folder, ranks_only=True) if self._want_arrivals else [])

    def update(self, final: bool = False) -> dict[str, dict[int, RankLog]]:
        for path in self._paths():
            tail = self._tails.get(str(path))
            if tail is None:
                tail = self._tails[str(path)] = jobdir.JsonLinesTail(path)
            for rec in tail.records(final):
                self._take(rec)
        return self.groups

    def _take(self, rec: dict) -> None:
        kind = rec.get("kind")
        if kind == "arrivals":
            self.arrivals.append(rec)
            self.arrivals_seen += 1
            return
        if kind not in ("flight", "flight-live"):
            return
        try:
            rank, t = int(rec["rank"]), float(rec.get("t") or 0)
        except (KeyError, TypeError, ValueError):
            return
        group = str(rec.get("group") or "default")
        log = self.groups.setdefault(group, {}).setdefault(rank, RankLog(rank, group))
        log.host = str(rec.get("host") or log.host)
        log.seen = max(log.seen, t)
        try:
            log.world = max(log.world, int(rec.get("world_size") or 0))
            if rec.get("every"):
                log.every = float(rec["every"])
        except (TypeError, ValueError):
            pass
        fields = rec.get("fields") or ()
        if kind == "flight":
            if t >= log.ring_t:
                ops = [Op.of(fields, row) for row in rec.get("entries") or ()]
                log.ring = [o for o in ops if o is not None]
                log.ring_t, log.ring_reason = t, str(rec.get("reason") or "")
                if rec.get("error"):
                    log.error = str(rec["error"])
        elif t >= log.live_t:
            log.live = rec
            log.live_op = Op.of(fields, rec.get("last") or ())


def load(folder: str | os.PathLike) -> dict[str, dict[int, RankLog]]:
    """{group: {rank: RankLog}} from a job directory (or a folder of flight-rank-*.jsonl files: SDP_FLIGHT_DIR)."""
    return FlightLog(folder).update(final=True)


def _ranks(ranks) -> str:
    """[0, 1, 2, 5] -> "ranks 0-2 and 5"; [3] -> "rank 3"."""
    ranks = sorted(set(ranks))
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    parts, start = [], ranks[0]
    for a, b in zip(ranks, ranks[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return "ranks " + (", ".join(parts[:-1]) + " and " + parts[-1] if len(parts) > 1 else parts[0])


def _who(log: RankLog) -> str:
    return f"rank {log.rank}" + (f" (host {log.host})" if log.host else "")


def _of(group: str) -> str:
    return f" of the {group} group"


@dataclass
class Finding:
    sentence: str | None
    group: str | None = None
    first_difference: int | None = None  # the seq the table marks
    logs: dict[int, RankLog] = field(default_factory=dict)
    last: int = 8  # operations per rank shown
    awaited: list[int] = field(default_factory=list)  # a stall's ranks the others wait for (JobFlight locates them)

    def table(self, last: int | None = None) -> list[list[str]]:
        return table(self.logs, self.last if last is None else last, self.first_difference)

    def text(self, last: int | None = None) -> str:
        lines = [self.sentence or "the flight recorder shows nothing wrong"]
        rows = self.table(last)
        if rows:
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            lines.append("")
            lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        import html

        rows = self.table()
        out = [f"<p><b>{html.escape(self.sentence or 'the flight recorder shows nothing wrong')}</b></p>"]
        if rows:
            out.append("<table><tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in rows[0]) + "</tr>")
            for r in rows[1:]:
                mark = ' style="background:#fde2e1"' if r[0].endswith("<") else ""
                out.append(f"<tr{mark}>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>")
            out.append("</table>")
        return "".join(out)

    def __str__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p, cycle):  # IPython in a terminal
        p.text(self.text())


def table(logs: dict[int, RankLog], last: int = 8, mark: int | None = None) -> list[list[str]]:
    """The last `last` operations per rank, aligned by sequence number: a header, then a row per seq
    ("#12 <" marks the first disagreement); a cell is "all_reduce 1000xfloat32 finished"."""
    if not logs:
        return []
    ranks = sorted(logs)
    by_rank = {r: {o.seq: o for o in logs[r].ring} for r in ranks}
    for r in ranks:
        pos = logs[r].position()
        if pos is not None:
            by_rank[r][pos.seq] = pos
    seqs = sorted({s for d in by_rank.values() for s in d})
    if mark is not None and mark in seqs:
        i = seqs.index(mark)
        seqs = seqs[max(0, i - last // 2): i + last - last // 2]
    else:
        seqs = seqs[-last:]
    rows = [["seq"] + [f"rank {r}" for r in ranks]]
    for s in seqs:
        row = [f"#{s}" + (" <" if s == mark else "")]
        for r in ranks:
            o = by_rank[r].get(s)
            row.append("-" if o is None else f"{o.call()} {o.count}x{o.dtype} {o.state}")
        rows.append(row)
    return rows


def _mismatch(logs: dict[int, RankLog], group: str) -> Finding | None:
    seqs: dict[int, dict[int, Op]] = {}
    for r, log in logs.items():
        for o in log.ring:
            seqs.setdefault(o.seq, {})[r] = o
        pos = log.position()
        if pos is not None:
            seqs.setdefault(pos.seq, {})[r] = pos
    for s in sorted(seqs):
        ops = seqs[s]
        if len(ops) < 2:
            continue
        keys = Counter(o.key for o in ops.values())
        if len(keys) == 1:
            continue
        common, _ = keys.most_common(1)[0]
        odd = sorted(r for r, o in ops.items() if o.key != common)
        others = next(o for o in ops.values() if o.key == common)
        mine = ops[odd[0]]
        who = _ranks(odd)
        if mine.op != others.op:
            what = f"called {mine.call()} while the others called {others.call()}"
        elif mine.count != others.count:
            verb = "reduced" if mine.reducing else "had"
            what = f"{verb} {mine.count} elements, the others {others.count}"
        elif mine.dtype != others.dtype:
            what = f"used {mine.dtype}, the others {others.dtype}"
        else:
            what = f"called {mine.call()}" + (f" ({mine.arg})" if mine.reducing else "") + \
                f", the others {others.call()}" + (f" ({others.arg})" if others.reducing else "")
        return Finding(f"at #{s}{_of(group)} {who} {what}", group, s, logs)
    return None


def _died(logs: dict[int, RankLog], group: str, exits: dict[int, int]) -> Finding | None:
    """A rank killed by a signal (or that exited without leaving a failure of its own) while the
    others were still in the job: the cause, whatever its peers then said of each other."""
    killed = sorted(r for r, c in exits.items() if c is not None and c < 0)
    if not killed:
        return None
    r = killed[0]
    log = logs.get(r) or RankLog(r, group)
    survivors = [lg for q, lg in logs.items() if q != r]
    failed = [o for lg in survivors for o in lg.ring if o.state in ("failed", "started", "posted")]
    op = min(failed, key=lambda o: o.seq) if failed else None
    pos = log.position()
    if op is None and pos is not None:
        op = pos
    how = jobdir.describe_exit(exits[r])
    if op is None:
        return Finding(f"{_who(log)} died ({how})", group, None, logs)
    during = "during" if op.open or op.state == "failed" else "after"
    return Finding(f"{_who(log)} died ({how}) {during} {op.name()}{_of(group)}", group, op.seq, logs)


def _inside(log: RankLog) -> Op | None:
    """The collective this rank is in (waiting, or failed by the deadline), else None."""
    pos = log.position()
    return pos if pos is not None and (pos.open or pos.state == "failed") else None


def _stalled(logs: dict[int, RankLog], group: str, now: float, warn_s: float, exits: dict[int, int],
             live: bool, world: int) -> Finding | None:
    newest_seen = max(lg.seen for lg in logs.values())
    stale_after = max(2.5 * warn_s, 3.0)
    # frozen: its lines stopped while the others' went on (a live rank writes one every warn_s)
    frozen = sorted(r for r, lg in logs.items() if newest_seen - lg.seen > stale_after and exits.get(r) is None)
    inside = {r: op for r, lg in logs.items() if r not in frozen and (op := _inside(lg)) is not None}
    if not inside:
        return None
    # the collective the job is stuck in: the oldest one a rank waits in (a rank already in a later one
    # waits for those, and they for whoever has not come)
    s = min(op.seq for op in inside.values())
    at = {r: op for r, op in inside.items() if op.seq == s}
    op = next(iter(at.values()))
    silent = sorted(r for r in range(world) if r not in logs and exits.get(r) is None) if group == "default" else []
    waiters = sorted(r for r in at if r not in frozen)
    if not waiters:
        return None
    start = min(at[r].started or at[r].posted for r in waiters)
    ends = [at[r].ended for r in waiters if at[r].state == "failed" and at[r].ended]
    end = now if live or len(ends) < len(waiters) else max(ends)
    waited = end - start
    if waited < warn_s:  # the ranks' lines are snapshots taken at different moments: a short wait is no stall
        return None
    sentences = []
    for r in frozen:
        lg = logs[r]
        pos = lg.position()
        if pos is not None and pos.seq >= s:
            where = f", last in {pos.name()}{_of(group)}"
        else:  # its last line is older than the wait: where it was is known only up to then
            where = f": {_ranks(waiters)} waited {waited:.0f} s for it in {op.name()}{_of(group)}" + (
                f" (its last flight line, {end - lg.seen:.0f} s ago, was in {pos.name()})" if pos is not None else "")
        sentences.append(f"{_who(lg)} has made no progress for {max(waited, 0):.0f} s{where}")
    for r in silent:
        sentences.append(f"rank {r} has made no progress for {max(waited, 0):.0f} s: {_ranks(waiters)} waited "
                         f"{waited:.0f} s for it in {op.name()}{_of(group)} (it wrote no flight line: stopped, "
                         f"frozen or cut off before its first)")
    absent = sorted(r for r, lg in logs.items() if r not in at and r not in frozen and (lg.position() is None or
                                                                                     lg.position().seq < s))
    tail = f"{_ranks(waiters)} waited {waited:.0f} s in {op.name()}{_of(group)}"
    if absent:
        first = logs[absent[0]]
        who = _ranks(absent) + (f" (host {first.host})" if len(absent) == 1 and first.host else "")
        sentences.append(f"{who} never entered {op.name()}{_of(group)}; {_ranks(waiters)} waited {waited:.0f} s in it")
    elif any((logs[r].position() or op).seq >= s for r in frozen):
        sentences.append(tail)
    elif sentences:
        pass
    elif len(waiters) == len(logs):
        sentences.append(f"every rank has waited {waited:.0f} s in {op.name()}{_of(group)} (a link between hosts, "
                         f"or a rank that is not a member calling it?)")
    else:
        return None
    return Finding("; ".join(sentences), group, s, logs, awaited=sorted({*frozen, *silent, *absent}))


def analyse(folder: "str | os.PathLike | FlightLog", *, exits: list | dict | None = None, now: float | None = None,
            warn_s: float | None = None, live: bool = False, first_failure: dict | None = None) -> Finding:
    """The one-sentence cause from a job directory's flight files, or from a FlightLog that follows them
    (see the module's docstring).
    `exits`: {rank: exit code} of the rank(s) that ended on their own (negative: killed by that signal),
    not of those the launcher stopped after it; or `first_failure`, status.json's record of the first
    rank that ended ({"rank", "code", "host"}), which names the host of a rank that left no flight line.
    `live`: the job still runs, so a wait shorter than `warn_s` is no finding yet."""
    groups = folder.update(final=not live) if isinstance(folder, FlightLog) else load(folder)
    groups = {g: dict(logs) for g, logs in groups.items()}  # what this analysis adds stays its own
    first = first_failure or {}
    if "rank" in first and "code" in first:
        try:
            exits = {**(exits if isinstance(exits, dict) else {}), int(first["rank"]): int(first["code"])}
            if first.get("host") and int(first["code"]) < 0 and "default" in groups:  # died: named with its host
                groups["default"].setdefault(int(first["rank"]), RankLog(int(first["rank"]), "default")).host = \
                    str(first["host"])
        except (TypeError, ValueError):
            pass
    worlds = {g: max(lg.world for lg in logs.values()) for g, logs in groups.items()}
    if isinstance(exits, list):
        exits = {r: c for r, c in enumerate(exits) if c is not None}
    exits = dict(exits or {})
    if not groups:
        return Finding(None)
    if warn_s is None:  # what the ranks used, as their live lines say
        everies = [lg.every for g in groups.values() for lg in g.values() if lg.every]
        warn_s = max(everies) if everies else DEFAULT_WARN_S
    warn_s = float(warn_s)
    newest = max(lg.seen for g in groups.values() for lg in g.values())
    now = newest if now is None else now
    order = sorted(groups, key=lambda g: (g != "default", g))
    for check in (lambda g: _mismatch(groups[g], g), lambda g: None if live else _died(groups[g], g, exits),
                  lambda g: _stalled(groups[g], g, now, warn_s, exits, live, worlds.get(g, 0))):
        for g in order:
            found = check(g)
            if found is not None and found.sentence:
                return found
    return Finding(None, "default" if "default" in groups else order[0], None, groups[order[0]])


def live_sentence(job_dir: "str | os.PathLike | FlightLog", warn_s: float | None = None) -> str | None:
    """While a job runs: who waits where and who has not arrived, once a wait has passed warn_s."""
    return live_finding(job_dir, warn_s).sentence


def live_finding(job_dir: "str | os.PathLike | FlightLog", warn_s: float | None = None) -> Finding:
    """live_sentence's Finding (its `awaited`: the ranks the others wait for)."""
    try:
        return analyse(job_dir, now=time.time(), warn_s=warn_s, live=True)
    except Exception:  # noqa: BLE001 - a status read must never fail on a half-written file
        return Finding(None)


def cause(job_dir: str | os.PathLike, first_failure: dict | None = None, warn_s: float | None = None) -> str | None:
    """After a job failed: the flight recorder's sentence, or None when it has nothing to say."""
    return cause_finding(job_dir, first_failure, warn_s).sentence


def cause_finding(job_dir: str | os.PathLike, first_failure: dict | None = None, warn_s: float | None = None) -> Finding:
    """cause()'s Finding (its `awaited`: the ranks the others waited for)."""
    try:
        return analyse(job_dir, first_failure=first_failure, warn_s=warn_s)
    except Exception:  # noqa: BLE001
        return Finding(None)


# ---------------------------------------------------------------------------------------------- stragglers
def job_stragglers(job_dir: "str | os.PathLike | FlightLog", final: bool = True) -> Stragglers:
    """stragglers() (sdp_jupyter/stragglers.py) over a job directory's arrivals (a FlightLog made with
    arrivals=True: its new lines only; `final`: the ranks have ended, so a last line without its
    newline counts)."""
    log = job_dir if isinstance(job_dir, FlightLog) else FlightLog(job_dir, arrivals=True, window=100_000)
    log.update(final)
    return stragglers(list(log.arrivals))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m sdp_jupyter.flight", description=__doc__.split("\n\n")[0])
    ap.add_argument("job_dir", help="a job directory (or a folder of flight-rank-*.jsonl files: SDP_FLIGHT_DIR)")
    ap.add_argument("--last", type=int, default=8, help="operations per rank in the table (default 8)")
    ap.add_argument("--json", action="store_true", help="print the finding as JSON")
    args = ap.parse_args(argv)
    status = jobdir.read_json(Path(args.job_dir) / jobdir.STATUS, {}) or {}
    # the rank that ended first (the others were stopped after it)
    found = analyse(args.job_dir, first_failure=status.get("first_failure"))
    straggler = job_stragglers(args.job_dir).sentence
    if args.json:
        print(json.dumps({"sentence": found.sentence, "group": found.group, "straggler": straggler,
                          "first_difference": found.first_difference, "table": found.table(args.last)}))
    else:
        print(found.text(args.last))
        if straggler:
            print(f"\nstraggler: {straggler}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
