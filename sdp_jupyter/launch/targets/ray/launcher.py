"""The Ray target: `%%sdp_train --target ray --address HOST:6379 --nodes 4` runs the cell on a Ray cluster.

One placement group with one bundle per node, STRICT_SPREAD (every node of the job on its own Ray
node), and in each bundle one actor that starts the per-host agent (launch/host/agent.py) as its child and
relays its frames: the same agent the SSH target reaches over ssh, reached here through actor calls.
The ranks are real processes in their own sessions, started by the agent exactly as the local
launcher starts them; the job secret travels in the `start` frame of an actor call, never in a
node's environment or a log. Everything else (preflight, mirroring, heartbeats, stop, restarts) is
the remote run of launch/kernel/agent_run/run.py. See docs/ray.md.

Warm starts (docs/warm.md): the notebook holds one PoolActor per Ray node (pinned to it, no CPU
reserved), whose child is that node's warm pool server; the job's agent there forks the ranks from it.
The actors' classes are in launch/targets/ray/actors.py.
The actor is owned by the notebook's Ray driver, so it and its pool end with the notebook.

Ray is optional: `pip install '.[ray]'` from a checkout (the test extra includes it).
"""
from __future__ import annotations

import os
import queue
import socket
import threading

from sdp_jupyter.launch import channel
from sdp_jupyter.launch.kernel.agent_run import run as agent_run
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.kernel.preparation import prepared
from sdp_jupyter.launch.kernel.push import pickle_push
from sdp_jupyter.launch.targets.ray.actors import AgentActor, PoolActor, PoolChannel
from sdp_jupyter.launch.kernel.agent_run.link import CONNECT_TIMEOUT
from sdp_jupyter import backends
from sdp_jupyter.launch.spec import JobSpec, SpecError

from sdp_jupyter.launch.targets.ray import KEYS, OPTIONS as RAY_OPTIONS  # noqa: E402  (the record's rows)
PLACEMENT_TIMEOUT = 30   # seconds for the cluster to place every node's bundle
RECV_WAIT = 0.2          # seconds an actor holds a poll for frames


def address_of(spec: JobSpec) -> str:
    options = spec.ray or {}
    unknown = sorted(set(options) - KEYS)
    if unknown:
        raise SpecError("ray", f"unknown Ray option(s) {', '.join(unknown)}; known: {', '.join(sorted(KEYS))}")
    return str(options.get("address") or os.environ.get("RAY_ADDRESS") or "auto")


def _import_ray():
    try:
        import ray
    except ImportError:
        raise SpecError("--target", "ray is not installed here. Fix: pip install ray (what sdp_jupyter's "
                                    "`ray` extra installs), then run the cell again") from None
    return ray


def _addresses(host: str) -> set[str]:
    """The IP addresses `host` names; a loopback name stands for every address of this machine."""
    import ipaddress

    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return {host}
    if any(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found):
        import psutil

        found |= {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                  if a.family in (socket.AF_INET, socket.AF_INET6)}
    return found


def same_cluster(asked: str, joined: str) -> bool:
    """Whether --address `asked` (HOST:PORT, or ray://HOST:PORT, a client port on the head) names the
    cluster whose GCS is at `joined` (HOST:PORT): the same port (not for ray://) and a shared host address."""
    host, _, port = asked.removeprefix("ray://").rpartition(":")
    joined_host, _, joined_port = joined.rpartition(":")
    if not asked.startswith("ray://") and port != joined_port:
        return False
    return bool(_addresses(host.strip("[]")) & _addresses(joined_host.strip("[]")))


def connect(address: str, given: str | None = None):
    """Join the cluster at `address` (unless this process already has); SpecError naming it if not.

    `given` is the job's own --address: if this process already joined another cluster (a notebook's
    `ray.init(...)`), the job would go there, so it is refused, naming both and the fix."""
    ray = _import_ray()
    if ray.is_initialized():
        if given and given not in ("auto", "local"):
            try:
                joined = str(ray.get_runtime_context().gcs_address)
            except Exception:  # Ray cannot say: nothing to compare
                joined = ""
            if joined and not same_cluster(given, joined):
                raise SpecError("--address", f"{given}: this process already joined the Ray cluster at {joined} "
                                             "(ray.init), and a job runs on the cluster its process has joined. "
                                             "Fix: drop --address to run there, or call ray.shutdown() first to "
                                             f"run on {given}")
        return ray
    # where the address came from, when not from the job's --address: the kernel's RAY_ADDRESS
    from_env = not given and address not in ("auto", "local") and os.environ.get("RAY_ADDRESS") == address
    source = " (RAY_ADDRESS of this kernel; no --address given)" if from_env else ""
    if address not in ("auto", "local"):
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT).close()
        except (OSError, ValueError) as e:
            raise SpecError("--address", f"cannot reach the Ray cluster at {address} within {CONNECT_TIMEOUT} s "
                                         f"({e}){source}. Fix: the head's address and port (`ray status` on the "
                                         "head prints them), or start one: ray start --head") from None
    try:
        ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
    except Exception as e:
        first = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
        if address == "auto":  # nothing named a cluster: Ray looked for a head on this machine
            why = "" if given or os.environ.get("RAY_ADDRESS") else ": no --address given, RAY_ADDRESS not set"
            raise SpecError("--address", f"this machine finds no Ray cluster to join (address auto{why}), and no "
                                         f"Ray head runs here (Ray: {first}). "
                                         "Fix: --address HOST:PORT of the cluster's head (`ray status` on the head "
                                         "prints it), or start one here: ray start --head") from None
        raise SpecError("--address", f"cannot join the Ray cluster at {address}{source}: {first}. Fix: check the "
                                     "address; a ray:// client needs the cluster's Ray and Python versions") from None
    return ray


class RayLink(agent_run.Link):
    kind = "ray"
    # `connected` comes with the actor's first answer, after Ray started a worker process for it:
    # on a busy node that alone can take longer than a connection does, so it has the hello's time
    connect_timeout = agent_run.HELLO_TIMEOUT

    def __init__(self, node: int, host: str, actor, inbox: queue.Queue):
        super().__init__(node, host, inbox)
        self.actor = actor
        threading.Thread(target=self._poll, daemon=True, name=f"sdp-ray-{node}").start()

    def _poll(self) -> None:
        import ray

        pending = None
        while True:
            # A call not answered in time is waited for again, never asked anew: the actor answers its
            # calls in order, and the first one (queued while Ray starts the actor's worker, which on a
            # busy node can take longer than the timeout) carries the agent's hello; asking anew lost it
            # ("connected, but the agent did not start within 60 s").
            if pending is None:
                pending = self.actor.recv.remote(RECV_WAIT)
            try:
                frames, ended, stderr = ray.get(pending, timeout=agent_run.HEARTBEAT_TIMEOUT)
                pending = None
            except ray.exceptions.GetTimeoutError:
                continue  # the run's heartbeat check names a node that stays silent
            except Exception as e:  # the actor died: its node was lost, or it never started
                text = str(e)
                self.stderr.extend(line for line in text.splitlines()[-20:] if line.strip())
                why = "its Ray actor died (the node was lost?)" if self.connected.is_set() \
                    else "its Ray actor did not start"
                self.inbox.put((self.node, {"type": "eof", "why": why, "code": None}))
                return
            self.connected.set()
            for body in frames:
                try:
                    self.heard(channel.parse(body))
                except ValueError as e:
                    self.inbox.put((self.node, {"type": "eof", "why": f"the agent sent a bad frame ({e})",
                                                "code": None}))
                    return
            if ended is not None:
                self.stderr.extend(stderr)
                self.inbox.put((self.node, {"type": "eof", "why": "the agent ended", "code": ended}))
                return

    def unreachable(self) -> str:
        return (f"Ray did not start its actor there within {self.connect_timeout} s (a node too busy to start a "
                "worker, or lost?). Fix: `ray status` on the head shows the nodes and what they are running")

    def diagnose(self, code, python: str) -> str:
        said = " ".join(line for line in self.stderr if line)[-400:]
        if "No module named" in said and "sdp_jupyter" in said:
            return ("sdp_jupyter is not importable by the Ray workers there. Fix: " + agent_run.install_fix(
                channel.version(), f"in the Python environment of the Ray node on {self.host}"))
        return super().diagnose(code, python)

    def send(self, message: dict) -> bool:
        try:
            self.actor.send.remote(channel.encode(message))
            return True
        except Exception:
            return False

    def close(self, wait: float = 5.0) -> None:
        import ray

        try:
            ray.get(self.actor.close.remote(wait), timeout=wait + 5)
        except Exception:
            pass
        try:
            ray.kill(self.actor)
        except Exception:
            pass


def _describe_nodes(nodes: list[dict]) -> str:
    return ", ".join(f"{n['NodeManagerAddress']} ({n['Resources'].get('CPU', 0):g} CPU, "
                     f"{n['Resources'].get('GPU', 0):g} GPU)" for n in nodes) or "no node"


class RayRun(agent_run.AgentRun):
    option = "--nodes"
    # No pool starts in the background after a job: nothing may touch Ray from another thread while
    # the notebook may call ray.shutdown() (Ray ends the process then). Pools start inside a --warm job.
    warm_after_job = False

    def __init__(self, spec: JobSpec, launcher: "RayLauncher", address: str):
        super().__init__(spec, [], launcher)
        self.address = address
        self.pg = None
        self.node_ids: list = []  # the Ray node of each job node (their warm pools are per Ray node)

    def open_links(self) -> list[agent_run.Link]:
        ray = connect(self.address, given=(self.spec.ray or {}).get("address"))
        from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

        spec = self.spec
        alive = [n for n in ray.nodes() if n.get("Alive")]
        gpus = backends.needs_gpus(spec.backend)
        ppn = spec.procs_per_node or (max(1, int(min(n["Resources"].get("GPU", 0) for n in alive))) if gpus else 1)
        bundle = {"CPU": float(ppn)} | ({"GPU": float(ppn)} if gpus else {})
        fit = [n for n in alive if all(n["Resources"].get(k, 0) >= v for k, v in bundle.items())]
        count = min(len(fit), spec.nodes) if spec.elastic and len(fit) >= spec.min_nodes else spec.nodes
        if len(fit) < count:
            need = " and ".join(f"{v:g} {k}" for k, v in bundle.items())
            raise SpecError("--nodes", f"{spec.nodes} node(s) with {need} each asked, and the Ray cluster at "
                                       f"{self.address} has {len(fit)} such node(s) of {len(alive)}: "
                                       f"{_describe_nodes(alive)}. Fix: --nodes {max(1, len(fit))}"
                                       + (" or fewer --procs-per-node" if spec.procs_per_node else ""))
        self.spec = spec.replace(procs_per_node=ppn)
        # an elastic job's bundles: as many as the cluster has nodes for, up to MAX; Ray places a bundle whose
        # node died on another node when one is free, where a new agent actor then starts (reopen)
        self.pg = placement_group([dict(bundle) for _ in range(count)], strategy="STRICT_SPREAD",
                                  name=f"sdp-{spec.name}")
        try:
            ray.get(self.pg.ready(), timeout=PLACEMENT_TIMEOUT)
        except Exception:
            remove_placement_group(self.pg)
            self.pg = None
            raise SpecError("--nodes", f"the Ray cluster at {self.address} could not place {count} bundle(s) "
                                       f"of {bundle} on distinct nodes within {PLACEMENT_TIMEOUT} s (busy with other "
                                       f"work?); it has {_describe_nodes(alive)}") from None
        # asked again now: a node that joined since `alive` was read (a restarted one) may hold a bundle
        by_id = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
        placed = placement_group_table(self.pg).get("bundles_to_node_id", {})
        self.node_ids = [placed.get(i) for i in range(count)]
        self.hosts = [by_id.get(placed.get(i), f"ray-node-{i}") for i in range(count)]
        self._bundle = bundle
        return [self._link(node, self.inbox) for node in range(count)]

    def _link(self, node: int, inbox, again: int = 0) -> "RayLink":
        """An agent actor in bundle `node` of the job's placement group (`again`: a later one there)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle
        actor = ray.remote(AgentActor).options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_concurrency=1,
            name=f"sdp-agent-{self.spec.name}-{node}" + (f"-{again}" if again else ""),
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=node),
        ).remote()
        return RayLink(node, self.hosts[node], actor, inbox)

    def reopen(self, node: int, inbox) -> "RayLink | None":
        """An elastic job's lost node: a new agent actor in its bundle, which Ray places again once a node
        is free for it (the same node restarted, or a spare)."""
        if self.pg is None:
            return None
        self._reopened = getattr(self, "_reopened", 0) + 1
        return self._link(node, inbox, again=self._reopened)

    def rejoined(self, node: int, link) -> None:
        """Where the bundle's new actor runs (maybe another Ray node): the job names that host now; its
        ranks start cold (the warm pool belonged to the node that left)."""
        self.hosts[node] = link.host = link.hello.get("addr") or link.host
        if node < len(self.node_ids):
            self.node_ids[node] = None

    def pool_key(self, node: int) -> tuple | None:
        node_id = self.node_ids[node] if node < len(self.node_ids) else None
        return ("ray", self.address, node_id) if node_id else None

    def warm_pool(self, node: int, preload: list[str] | tuple = ()):
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from sdp_jupyter.launch.kernel import warm_pool

        node_id = self.node_ids[node]

        def opener(server_args: list) -> PoolChannel:
            actor = ray.remote(PoolActor).options(
                num_cpus=0, max_concurrency=4,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(server_args)
            return PoolChannel(actor)

        return warm_pool.held_pool(self.pool_key(node), opener, preload)

    def close_all(self) -> None:
        super().close_all()
        self._remove_group()

    def kill_now(self) -> None:
        super().kill_now()
        self._remove_group()

    def _remove_group(self) -> None:
        if self.pg is None:
            return
        try:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.pg)
        except Exception:
            pass
        self.pg = None


class RayLauncher:
    """Runs a JobSpec on a Ray cluster, one node per Ray node. Grace periods (seconds) apply when stopping."""

    def __init__(self, sigint_grace: float = 3.0, sigterm_grace: float = 2.0):
        self.sigint_grace = sigint_grace
        self.sigterm_grace = sigterm_grace

    def start(self, spec: JobSpec, push: dict | None = None) -> Job:
        address = address_of(spec)
        _import_ray()
        spec = prepared(spec)
        push_bytes = pickle_push(spec.push, push or {})
        return agent_run.start_job(RayRun(spec, self, address), push_bytes, ray_address=address)

