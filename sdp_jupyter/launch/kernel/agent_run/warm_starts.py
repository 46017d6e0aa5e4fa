"""How the agent run's ranks start warm (mixed into AgentRun, run.py): each node's host's warm pool
(launch/host/warm.py) asked for before an attempt and waited for together, the start frame's warm fields,
the job's "warm start" / "cold start (why)" from what every node said, and the pools started after a job
for the next (launch/kernel/warm_pool.py decides when).
"""
from __future__ import annotations

import time

from sdp_jupyter.launch import channel
from sdp_jupyter.launch.kernel import warm_pool


class WarmStarts:
    """AgentRun's warm starts; a target with warm pools gives `pool_key` and `warm_pool`. Needs the run's
    spec, hosts, job, warm_choice, warm_after_job, nodes(), _starts and _stop."""

    def pool_key(self, node: int) -> tuple | None:
        """The key of node's host's warm pool (launch/host/warm.py), None where the target has none."""
        return None

    def warm_pool(self, node: int, preload: list[str] | tuple = ()):
        raise NotImplementedError

    def _warm_fields(self) -> dict[int, dict]:
        """Per node, the start frame's warm fields: its host's pool's address, or why its ranks start
        cold. Pools that are still starting (a --warm job, or new --preload modules) start at once on
        every host and are waited for together, up to warm_pool.READY_TIMEOUT, while _keep_alive pings the agents
        (an agent that hears nothing for its heartbeat timeout stops)."""
        pools = {}
        for conn in self.nodes():
            key = self.pool_key(conn.node)
            if key is not None and warm_pool.wanted(self.warm_choice, key):
                pools[conn.node] = self.warm_pool(conn.node, warm_pool.job_preload(self.spec))  # in the background
        deadline = time.monotonic() + warm_pool.READY_TIMEOUT
        for pool in pools.values():
            while not pool.started() and time.monotonic() < deadline and not self._stop.is_set():
                pool.ready(timeout=channel.HEARTBEAT_EVERY)
        fields = {}
        for node, pool in pools.items():
            refused = warm_pool.refusal(pool, self.spec.backend)
            address, reason = (None, refused) if refused else pool.address(timeout=0)
            fields[node] = {"warm": address} if address else {"cold_reason": reason}
        return fields

    def _started(self, node: int, message: dict) -> None:
        """A node said how its ranks started: the job is warm when every node's were (as locally)."""
        self._starts[node] = (bool(message.get("warm")), message.get("reason"))
        reason = message.get("reason") or ""
        if reason.startswith("the installed code changed"):
            warm_pool.discard(self.pool_key(node))  # the next job starts a new pool there
        if len(self._starts) < len(self.nodes()) or self.job.status.get("start"):
            return
        cold = [(n, why) for n, (is_warm, why) in sorted(self._starts.items()) if not is_warm]  # n: a link's index
        if not cold:
            self.job.update_status(start="warm")
        elif all(why is None for _, why in cold):
            self.job.update_status(start="cold")
        else:
            n, why = next((n, why) for n, why in cold if why)
            self.job.update_status(start="cold", start_reason=f"warm start not possible{self._started_where(n)}: {why}")

    def _started_where(self, node: int) -> str:  # in "warm start not possible on h2: ..."
        return f" on {self.hosts[node]}"

    def _warm_after(self) -> None:
        """After the job: start the hosts' pools for the next (warm_pool.job_done decides)."""
        if self.warm_after_job and self.pool_key(0) is not None:
            warm_pool.job_done(self.warm_choice, warm_pool.job_preload(self.spec), start=self._warm_next)

    def _warm_next(self, preload) -> None:
        for node in range(len(self.hosts)):
            self.warm_pool(node, preload)
