"""What a job says about itself in words: the labels of its summary line (how the ranks started, where
they run, which backend they used, its nodes, an elastic job's membership) and the summary a job view,
`repr` and `%sdp_jobs` show. A part of Job (launch/kernel/job.py), read from its status.json alone, so a
reopened job says the same.
"""
from __future__ import annotations

import time

from sdp_jupyter.launch import targets


class JobWords:
    """Job's labels and summary; needs `_read_status()`, `spec`, `name`, `dir`, `elapsed`, `hang` and
    `straggler` of the Job it is part of."""

    @property
    def start_label(self) -> str | None:
        """How the ranks started: "warm start" (forked from the warm pool), "cold start", or
        "cold start (warm start not possible: REASON)" when a warm start fell back; None until the
        ranks start, and for targets that do not say (docs/warm.md)."""
        st = self._read_status()
        if st.get("start") not in ("warm", "cold"):
            return None
        label = f"{st['start']} start"
        return f"{label} ({st['start_reason']})" if st.get("start_reason") else label

    @property
    def where_label(self) -> str | None:
        """Where a remote job's ranks run: "ssh: gpu1, gpu2" (the hosts' own names, node by node), or
        "ray: ..."; None for local and SageMaker jobs (their hosts are this machine or algo-N)."""
        st = self._read_status()
        target = st.get("target")
        record = targets.TARGETS.get(str(target))
        if record is None or not record.own_hosts:
            return None
        names = st.get("host_names") or st.get("hosts") or []
        if st.get("allocation"):  # a target's allocation (Slurm's job id), and while it waits, the reason
            target = st["allocation"]
            if st.get("state") == "pending" and not names:
                return f"{target} (pending: {st.get('pending_reason') or 'in the queue'})"
        return f"{target}: {', '.join(str(n) for n in names)}" if names else str(target)

    @property
    def backend_label(self) -> str:
        """The backend as the ranks used it (status `backend_used`, written when the job ends;
        launch/rank/backend_check.py): the one asked for when they used it, "gloo (asked: smddp)" when
        their default group was another, "smddp (no process group)" when they made none."""
        st, asked = self._read_status(), self.spec.backend
        if "backend_used" not in st:
            return asked
        used = st["backend_used"]
        if not used:
            return f"{asked} (no process group)"
        return asked if used == asked else f"{used} (asked: {asked})"

    @property
    def warnings(self) -> list[str]:
        """What the job did that was not what was asked (another backend; ranks that trained
        independently): status `warnings`, written when the job ends."""
        return [str(w) for w in self._read_status().get("warnings") or []]

    @property
    def nodes_label(self) -> str:
        """How many nodes: N, or an elastic job's "now of MIN:MAX" (2 of 2:3)."""
        if self.spec.min_nodes is None:
            return str(self.spec.nodes)
        now = self._read_status().get("nodes", self.spec.nodes)
        return f"{now} of {self.spec.min_nodes}:{self.spec.nodes}"

    @property
    def membership(self) -> list[str]:
        """An elastic job's membership changes, one line each (launch/kernel/elastic.py)."""
        lines = []
        for entry in self._read_status().get("membership", [])[1:]:
            at = time.strftime("%H:%M:%S", time.localtime(entry.get("t", 0)))
            if "returned" in entry:  # in the status; the formation it joins says it
                continue
            lost = "; ".join(f"node {h} lost: {why}" for h, why in (entry.get("lost") or {}).items())
            lines.append(f"{at} {lost or entry.get('why')}: {entry.get('nodes')} node(s) from then "
                         f"({', '.join(entry.get('hosts', []))})")
        return lines

    def summary(self, error: bool = True) -> str:
        """The job in a few lines: name, state, elapsed time, nodes x processes, where, backend, how the
        ranks started, restarts and directory; then any warnings, a hang or straggler, and the error
        (`error=False`: not the error, which the caller raises right after, so it is said once)."""
        st = self._read_status()
        start = f", {self.start_label}" if self.start_label else ""
        where = f" on {self.where_label}" if self.where_label else ""
        line = (f"Job {self.name}: {st.get('state', 'pending')} after {self.elapsed:.1f} s "
                f"({self.nodes_label} node(s) x {self.spec.procs_per_node or 1} proc(s){where}, backend "
                f"{self.backend_label}{start}, restarts {st.get('restarts', 0)}) in {self.dir}")
        for change in self.membership:
            line += "\nmembership: " + change
        for warning in self.warnings:
            line += "\nwarning: " + warning
        hang = self.hang
        if hang:
            line += "\nwaiting: " + hang
        straggler = self.straggler
        if straggler:
            line += "\nstraggler: " + straggler
        if error and st.get("error"):
            line += "\n" + st["error"]
        return line
