"""Elastic jobs, `--nodes MIN:MAX`: a lost node costs a re-formation, not the job.

A job's run (launch/kernel/agent_run/run.py; the local target's is one too, its nodes the agents it started)
holds one link per host it may use: up to MAX of them are the formation (`run.members`, in node order),
the others are spares. Membership drives the attempts:

- A node that is *lost* (its link ended: the agent or the host died; it went silent: a cut link; it did
  not stop when asked) ends the attempt; the others' agents stop their ranks, and the job re-forms. This
  is a membership change: it does not count against `--max-restarts`.
- A rank that *fails* on a node whose agent is fine (an exception, a crash) is a failure: it counts
  against `--max-restarts`, and the job re-forms with the same nodes (the failed node restarted on its host).
- To re-form, every lost host is tried again at once (its agent started anew over a new link) and waited
  for up to REFORM_GRACE seconds, so a host whose agent alone was killed is back in the next formation.
  Then the formation is the nodes that answer, survivors first in their old order (node 0 stays a node that
  held the last checkpoint), then returned hosts and spares, up to MAX. Ranks are renumbered without gaps;
  WORLD_SIZE, SDP_NUM_NODES and SDP_RESTART (the attempt) say the new shape.
- Hosts still missing are tried again every RETRY_EVERY seconds while the job runs. One that answers while
  the formation has fewer than MAX nodes makes the job re-form with it at once (as torchrun does when a
  node joins), also a membership change.
- With fewer than MIN usable nodes the job waits up to `--elastic-wait` seconds for hosts to return, then
  fails naming each missing host and why it left.

Every change is written to the job's status (`membership`: one entry per formation, with who left and
why) and told to every rank's log, so the job view, `status.json` and the dashboard show it.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from typing import Callable, Protocol

from sdp_jupyter.launch import channel
from sdp_jupyter.launch.kernel import supervise

REFORM_GRACE = 8.0   # seconds a re-formation waits for lost hosts being tried again
RETRY_EVERY = 5.0    # seconds between tries to reach a missing host again
MEMBERSHIP_METRICS = "membership.jsonl"  # in the job's metrics folder: the dashboard's markers


class ElasticRun(Protocol):
    """What Membership asks of the run it drives, all of it: the door of the run every target shares
    (launch/kernel/agent_run/run.py's AgentRun), which elastic membership reaches through nothing else.
    tests/launch/test_elastic.py drives Membership with a stand-in that has exactly these."""

    spec: "object"                  # the job's JobSpec (min_nodes, nodes, elastic_wait, max_restarts, ...)
    job: "object"                   # its Job: update_status(...)
    hosts: list[str]                # every host the run may use, by index
    conns: list                     # one link per host (a Link: node, last_heard, inbox, close())
    inbox: queue.Queue              # where the run reads its links' frames
    members: list[int] | None       # the formation: indexes of conns, node order
    preflight_missing: dict[int, str]  # hosts the first preflight found unusable: {index: why}
    heartbeat_timeout: float        # a link quiet this long is lost
    hello_timeout: float            # how long an agent may take to say hello
    membership: "Membership | None"  # set while Membership drives the run

    @property
    def stopping(self) -> bool: ...

    @property
    def stop_reason(self) -> str | None: ...

    def attempt(self, attempt: int) -> tuple[str, str | None, list]: ...

    def lost(self) -> dict[int, tuple[str, float]]: ...

    def eof_reason(self, node: int, message: dict) -> str: ...

    def reopen(self, node: int, inbox: queue.Queue): ...

    def rejoined(self, node: int, link) -> None: ...

    def elastic_ended(self, state: str) -> None: ...

    def write_metrics(self, name: str, text: str) -> None: ...


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


class Membership:
    """The formation of one elastic run and the attempts over it (`attempts()` replaces with_restarts)."""

    def __init__(self, run: ElasticRun, announce: Callable[[str], None]):
        self.run, self.announce = run, announce
        self.spec = run.spec
        self.missing: dict[int, dict] = {}  # index of run.conns -> {"why", "t"}: hosts not usable now
        self._returned: queue.Queue = queue.Queue()  # (index, link): a missing host's agent said hello again
        self._trying: set[int] = set()  # indexes with a retry thread running
        self._lock = threading.Lock()
        self.timeline: list[dict] = []
        self._grow_reason: str | None = None

    # ---------------------------------------------------------------- the attempts
    def attempts(self) -> tuple:
        run, spec, job = self.run, self.spec, self.run.job
        run.membership = self
        attempt, failures, causes = 0, 0, []
        self._change: dict = {"why": "started"}
        state = "failed"
        try:
            while True:
                if run.conns:  # else the target makes its links in its attempt (a Slurm allocation), then formed()
                    members = self._form(run.members or [], self._change)
                    if isinstance(members, str):  # below MIN for --elastic-wait, or stopped while waiting
                        state = "stopped" if run.stopping else "failed"
                        return state, members, []
                    run.members = members
                state, error, codes = run.attempt(attempt)
                if run.stopping and state != "succeeded":
                    state = "stopped"
                    return state, run.stop_reason, codes
                if state not in ("failed", "reform") or run.members is None:
                    return state, error, codes
                if state == "failed" and error and error.startswith("timed out"):
                    return state, error, codes
                left = run.lost()
                attempt += 1
                for node, (why, since) in left.items():
                    self.lose(node, why, since=since)
                if state == "reform" or left:  # a host came back with room for it, or nodes were lost:
                    # a membership change, not a failure
                    self._change = {"why": error.splitlines()[0] if error else "re-formed"}
                    if left:
                        self._change["lost"] = {run.hosts[n]: why for n, (why, _t) in left.items()}
                        self._change["lost_at"] = {run.hosts[n]: t for n, (_why, t) in left.items()}
                    continue
                if failures >= spec.max_restarts:
                    return state, error, codes
                failures += 1
                supervise.count_restart(job, failures, spec.max_restarts, error, causes, self.announce)
                self._change = {"why": f"restart {failures} of {spec.max_restarts}"}
        finally:
            run.membership = None  # the retry threads end at their next look, closing what they opened
            with self._lock:
                self._trying.clear()
            while (node := self._take_returned(timeout=0)) is not None:
                pass  # a host that answered as the job ended: in run.conns, so close_all says bye to it
            run.elastic_ended(state)
            with self._lock:
                self._trying.clear()  # the retry threads end at their next look

    def formed(self) -> list[int]:
        """The first formation of a target that opened its links inside its attempt (its preflight done)."""
        members = self._form([], self._change)
        return members if isinstance(members, list) else list(range(len(self.run.conns)))

    def _form(self, previous: list[int], change: dict):
        """The next formation (indexes of run.conns, node order), or the error when fewer than MIN nodes
        are usable within --elastic-wait."""
        run, spec = self.run, self.spec
        for node, why in run.preflight_missing.items():  # hosts the first preflight found unusable
            self.lose(node, why)
        run.preflight_missing = {}
        if self.missing and previous:  # give the hosts lost just now a moment to come back
            deadline = time.monotonic() + REFORM_GRACE
            while self.missing and time.monotonic() < deadline and not run.stopping:
                self._take_returned(timeout=0.2)
        while self._take_returned(timeout=0) is not None:
            pass
        quiet = run.heartbeat_timeout
        for n, conn in enumerate(run.conns):  # a spare whose link went quiet (its end was read elsewhere)
            if n not in self.missing and time.monotonic() - conn.last_heard > quiet:
                self.lose(n, f"has not answered for {quiet:g} s: its link or the host is down")
        waited_from = time.monotonic()
        told = False
        while True:
            usable = [n for n in range(len(run.conns)) if n not in self.missing]
            if len(usable) >= spec.min_nodes:
                break
            if not told:
                self.announce(f"[sdp_jupyter] {len(usable)} node(s) usable, the job needs {spec.min_nodes}: "
                              f"waiting up to {spec.elastic_wait:g} s (--elastic-wait) for hosts to return\n")
                run.job.update_status(state="waiting", waiting_for=self._missing_text())
                told = True
            if run.stopping:
                return f"stopped while waiting for hosts: {self._missing_text()}"
            if time.monotonic() - waited_from > spec.elastic_wait:
                return (f"fewer than {spec.min_nodes} node(s) (--nodes {spec.min_nodes}:{spec.nodes}) were usable "
                        f"for {spec.elastic_wait:g} s (--elastic-wait); missing: {self._missing_text()}")
            self._take_returned(timeout=0.5)
        order = [n for n in previous if n in usable] + [n for n in usable if n not in previous]
        members = order[:spec.nodes]
        self._record(members, change)
        return members

    def _record(self, members: list[int], change: dict) -> None:
        run = self.run
        now = time.time()
        hosts = [run.hosts[n] for n in members]
        entry = {"t": now, "nodes": len(members), "hosts": hosts, "world_size": len(members) * run.spec.procs_per_node,
                 **change}
        if self.missing:
            entry["missing"] = {run.hosts[n]: m["why"] for n, m in sorted(self.missing.items())}
        self.timeline.append(entry)
        run.job.update_status(membership=self.timeline, nodes=len(members), hosts_now=hosts,
                              world_size=entry["world_size"], waiting_for=None)
        if len(self.timeline) > 1:
            lost = "; ".join(f"node {h} lost: {why}" for h, why in change.get("lost", {}).items())
            self.announce(f"[sdp_jupyter] {_clock(now)} {lost or change['why']}; the job goes on with "
                          f"{len(members)} node(s): {', '.join(hosts)} (from its last checkpoint)\n")
            # the dashboard's marker (monitor/reader.py reads every metrics file)
            label = (", ".join(f"{h} lost" for h in change.get("lost", {})) or change["why"])[:60]
            line = {"t": now, "kind": "membership", "nodes": len(members), "label": f"{label}: {len(members)} nodes"}
            run.write_metrics(MEMBERSHIP_METRICS, json.dumps(line) + "\n")

    def _missing_text(self) -> str:
        return "; ".join(f"{self.run.hosts[n]} (since {_clock(m['t'])}: {m['why']})"
                         for n, m in sorted(self.missing.items())) or "none"

    # ---------------------------------------------------------------- hosts that leave and return
    def lose(self, node: int, why: str, since: float | None = None) -> None:
        """conns[node] is not usable (found at `since`, else now): close its link (its late frames go
        nowhere) and try it again."""
        run = self.run
        old = run.conns[node]
        old.inbox = queue.Queue()  # its eof, when it comes, is not the new link's
        threading.Thread(target=old.close, kwargs={"wait": 1.0}, daemon=True).start()
        with self._lock:
            self.missing[node] = {"why": why, "t": since or time.time()}
            if node in self._trying:
                return
            self._trying.add(node)
        threading.Thread(target=self._retry, args=(node,), daemon=True, name=f"sdp-rejoin-{run.hosts[node]}").start()

    def spare_lost(self, node: int, message: dict) -> None:
        """A spare's link ended (its host went away while it waited)."""
        self.lose(node, self.run.eof_reason(node, message))
        self.run.job.update_status(spares_missing=self._missing_text())

    def _retry(self, node: int) -> None:
        """Reach conns[node]'s host again until its agent says hello at this version (or the job ends)."""
        run = self.run
        while True:
            with self._lock:
                if node not in self._trying:
                    return
            inbox: queue.Queue = queue.Queue()
            try:
                link = run.reopen(node, inbox)
            except Exception:  # the client (ssh, a local agent) could not start: tried again later
                time.sleep(RETRY_EVERY)
                continue
            if link is None:
                with self._lock:
                    self._trying.discard(node)
                return
            hello = self._await_hello(link, inbox, link.connect_timeout + run.hello_timeout)
            if run.membership is not self:  # the job ended meanwhile
                link.close(wait=1.0)
                return
            if hello is not None and hello.get("version") == channel.version():
                link.hello = hello
                self._returned.put((node, link))
                return
            link.close(wait=1.0)
            with self._lock:
                if node in self.missing and hello is not None:
                    self.missing[node]["why"] = f"it has sdp_jupyter {hello.get('version')}"
            time.sleep(RETRY_EVERY)

    def _await_hello(self, link, inbox: queue.Queue, limit: float) -> dict | None:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline and self.run.membership is self:
            try:
                _, message = inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if message["type"] == "hello":
                return message
            if message["type"] == "eof":
                return None
        return None

    def _take_returned(self, timeout: float) -> int | None:
        """Put a link that said hello again in place; its index, or None when none came."""
        run = self.run
        try:
            node, link = self._returned.get(timeout=timeout) if timeout else self._returned.get_nowait()
        except queue.Empty:
            return None
        link.last_heard = time.monotonic()
        link.inbox = run.inbox
        run.rejoined(node, link)
        run.conns[node] = link
        with self._lock:
            left = self.missing.pop(node, None)
            self._trying.discard(node)
        self.timeline.append({"t": time.time(), "returned": run.hosts[node],
                              "was": left and left["why"]})
        return node

    def grow_now(self, formation: int) -> bool:
        """While an attempt runs (asked every second): put hosts that answered again in place (a spare
        then hears the launcher's pings); True when the formation has room for one."""
        came = []
        while True:
            node = self._take_returned(timeout=0)
            if node is None:
                break
            came.append(self.run.hosts[node])
        if not came or formation >= self.spec.nodes:
            return False
        self._grow_reason = f"host {', '.join(came)} is reachable again and joins"
        return True

    def grow_reason(self) -> str:
        return self._grow_reason or "a host joins"
