"""Who comes last to the collectives: the stragglers analysis over the ranks' "arrivals" metrics lines.

Each rank writes, every SDP_ARRIVALS_S, when it came to its recent collectives of the default group and
how long it waited in them (sdp_jupyter/comm/recorder.py, docs/failures.md). Lined up by sequence
number, those say which rank comes last, how late it is then, and what that costs the others:
`stragglers(records)` from metrics lines in any order. Torch-free and engine-free, and a leaf: the
dashboard's per-rank panel (through monitor/reader.py), a job's `straggler` and
`python -m sdp_jupyter.flight` (through `flight.job_stragglers`, which follows a job directory) read it.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Stragglers:
    """Who comes last to the collectives of the default group, from the ranks' "arrivals" metrics lines
    (sdp_jupyter/comm/recorder.py): per rank, the share of collectives it came to last, how late it was
    then (against the median of the others), and the share of its time spent waiting inside them."""

    collectives: int = 0                                  # collectives every rank reported
    last_share: dict = field(default_factory=dict)        # rank -> share of them it came to last
    late_s: dict = field(default_factory=dict)            # rank -> mean lateness when last (s)
    wait_share: dict = field(default_factory=dict)        # rank -> share of its time waiting in collectives
    hosts: dict = field(default_factory=dict)             # rank -> host
    cost: float = 0.0                                     # the straggler's lateness over the span: the others' wait
    straggler: int | None = None

    @property
    def sentence(self) -> str | None:
        r = self.straggler
        if r is None:
            return None
        who = f"host {self.hosts[r]} (rank {r})" if self.hosts.get(r) else f"rank {r}"
        return (f"{who} arrived last in {self.last_share[r]:.0%} of {self.collectives} collectives, "
                f"{self.late_s[r] * 1e3:.0f} ms late on average: about {self.cost:.0%} of the job's time")


MIN_COLLECTIVES = 20  # fewer aligned collectives than this: no verdict
LATE_S = 0.005  # a straggler is this late on average when it comes last...
CROWDED_LATE_S = 0.020  # ... or this, when the ranks of its host outnumber the host's CPUs: they take turns
# on the cores, and a rank the scheduler set aside for a time slice (a few ms) comes last by that much


def stragglers(records: list[dict], hosts: dict | None = None) -> Stragglers:
    """The analysis from metrics lines (any order; other kinds are skipped)."""
    arrivals: dict[int, dict[int, tuple[float, float]]] = {}
    named = dict(hosts or {})
    cpus: dict[str, int] = {}  # host -> CPUs its ranks may use, as they said
    for rec in records:
        if rec.get("kind") != "arrivals" or (rec.get("group") or "default") != "default":
            continue
        try:
            rank, seq0, base = int(rec["rank"]), int(rec["seq0"]), float(rec["base"])
            if rec.get("host"):
                named[rank] = str(rec["host"])
                if rec.get("cpus"):
                    cpus[named[rank]] = int(rec["cpus"])
            mine = arrivals.setdefault(rank, {})
            for i, (p, w) in enumerate(zip(rec["posted_ms"], rec["wait_ms"])):
                mine[seq0 + i] = (base + float(p) / 1e3, float(w) / 1e3)
        except (KeyError, TypeError, ValueError):
            continue
    out = Stragglers(hosts=named)
    if len(arrivals) < 2:
        return out
    ranks = sorted(arrivals)
    common = sorted(set.intersection(*(set(arrivals[r]) for r in ranks)))
    out.collectives = len(common)
    last = {r: 0 for r in ranks}
    late = {r: 0.0 for r in ranks}
    for s in common:
        times = {r: arrivals[r][s][0] for r in ranks}
        r_last = max(times, key=times.get)
        others = sorted(t for r, t in times.items() if r != r_last)
        last[r_last] += 1
        late[r_last] += times[r_last] - others[len(others) // 2]
    for r in ranks:
        out.last_share[r] = last[r] / len(common) if common else 0.0
        out.late_s[r] = late[r] / last[r] if last[r] else 0.0
        waits = [arrivals[r][s][1] for s in common]
        span = (arrivals[r][common[-1]][0] + arrivals[r][common[-1]][1] - arrivals[r][common[0]][0]) if common else 0
        out.wait_share[r] = sum(waits) / span if span > 0 else 0.0
    if len(common) < MIN_COLLECTIVES:
        return out
    # the straggler is the rank the others wait for: the most lateness summed over the collectives. By chance
    # each rank is last in 1/W of them, a little late each time; a straggler is last more often than that, and
    # most of all the waiting is for it (3/4 with two ranks), late enough to matter. Not "last in most of
    # them": on a busy machine a slow host is last in fewer, and then by far (a host at a tenth of a CPU,
    # 3 ranks, 2 cores shared with other work: last in 40%, 57 ms late; the others 3 ms when last)
    top = max(ranks, key=lambda r: late[r])
    total = sum(late.values())
    span = max(arrivals[r][common[-1]][0] for r in ranks) - min(arrivals[r][common[0]][0] for r in ranks)
    host = named.get(top)
    crowded = host in cpus and sum(named.get(r) == host for r in ranks) > cpus[host]
    if (total > 0 and late[top] / total >= max(0.5, 1.5 / len(ranks)) and out.last_share[top] > 1 / len(ranks)
            and out.late_s[top] >= (CROWDED_LATE_S if crowded else LATE_S) and span > 0):
        out.straggler = top
        out.cost = min(1.0, late[top] / span)
    return out
