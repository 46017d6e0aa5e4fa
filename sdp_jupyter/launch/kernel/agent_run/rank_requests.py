"""What a remote run asks of its ranks on request, through each node's agent (launch/kernel/agent_run/run.py mixes
it in; the local target's agents are the same): the flight recorders' rings (Job.flight()) and every
rank's Python stack (Job.stacks(), launch/kernel/stacks.py; the agent's half is launch/host/rank_stacks.py).
"""
from __future__ import annotations

import itertools
import queue
import time

_ASKS = itertools.count(1)  # stacks request ids, unique in this process
_LATE_S = 1.0  # what the link may add to an agent's own wait (a frame each way; SSH, an actor)


class InspectChannel:
    """AgentRun's requests to its agents for what its ranks are doing now."""

    def request_flight(self) -> None:
        """Job.flight(): every host's ranks write their flight recorders' rings (they come back as metrics do)."""
        for conn in self.nodes():
            conn.send({"type": "flight"})

    def request_stacks(self, ranks: list | None, wait: float) -> tuple[dict, dict]:
        """The Python stacks of `ranks` (None: every rank), asked of the agents of their nodes at once:
        ({rank: the rank's dump}, {rank: why there is none}), within `wait` seconds and a little more."""
        ppn = self.spec.procs_per_node
        nodes = self.nodes()
        wanted = sorted(set(range(len(nodes) * ppn) if ranks is None else ranks))
        n, mail = next(_ASKS), queue.Queue()
        waiting = self.__dict__.setdefault("_stacks_waiting", {})
        waiting[n] = mail
        asked, errors = set(), {}
        try:
            for position, conn in enumerate(nodes):
                here = [r for r in wanted if r // ppn == position]
                # one id per node: its answer says which node answered
                if here and conn.send({"type": "stacks", "id": f"{n}.{position}", "ranks": here, "wait": wait}):
                    asked.add(position)
                elif here:
                    errors.update({r: f"its node's agent ({conn.host}) cannot be reached" for r in here})
            dumps = {}
            deadline = time.monotonic() + wait + _LATE_S
            while asked and time.monotonic() < deadline:
                try:
                    answer = mail.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                dumps.update({int(r): str(t) for r, t in (answer.get("dumps") or {}).items()})
                errors.update({int(r): str(t) for r, t in (answer.get("errors") or {}).items()})
                asked.discard(answer["position"])
            for position in asked:
                errors.update({r: f"its node's agent ({nodes[position].host}) did not answer within {wait:g} s"
                               for r in wanted if r // ppn == position and r not in dumps})
        finally:
            waiting.pop(n, None)
        errors.update({r: "it has not started on its node yet" for r in wanted if r not in dumps and r not in errors})
        return {r: dumps[r] for r in wanted if r in dumps}, {r: errors[r] for r in wanted if r in errors}

    def _stacks_answer(self, message: dict) -> None:
        """An agent's answer (from the run's loop): to the request waiting for it, if it still waits."""
        n, _, position = str(message.get("id")).partition(".")
        mail = self.__dict__.get("_stacks_waiting", {}).get(int(n) if n.isdigit() else None)
        if mail is not None and position.isdigit():
            mail.put({**message, "position": int(position)})

