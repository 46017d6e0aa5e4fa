"""The run every target but SageMaker shares, local included: one agent per node (launch/host/agent.py)
reached over a link.

The local target's link is its agent's stdin/stdout, the SSH target's an ssh client's, the Ray target's
an actor that runs the agent (link.py beside this one). Either way the notebook side is this module: start every node's agent at once and check its hello (version, GPUs) before anything starts;
then, per attempt, ask node 0 for a port, send each agent its `start`, mirror output, metrics and the
result into the job directory, and name a rank that fails or a node that goes silent (HEARTBEAT_TIMEOUT).
Stop, restarts and the exit hook: launch/kernel/supervise.py.
"""
from __future__ import annotations

import queue
import secrets
import sys
import threading
import time

from sdp_jupyter.launch import channel
from sdp_jupyter import jobdir
from sdp_jupyter.launch.kernel import backend_verdict
from sdp_jupyter.launch.kernel.rank_report import ViewCut, failure_message
from sdp_jupyter.launch.kernel import supervise
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.kernel.preparation import create_job
from sdp_jupyter.launch.kernel.agent_run.heal_channel import HealChannel
from sdp_jupyter.launch.kernel.agent_run.rank_requests import InspectChannel
from sdp_jupyter.launch.kernel.agent_run.mirror import MirrorChannel
from sdp_jupyter.launch.kernel.agent_run.session_channel import SessionChannel
from sdp_jupyter.launch.kernel.agent_run.warm_starts import WarmStarts
from sdp_jupyter import backends
from sdp_jupyter.launch.spec import JobSpec, SpecError
# a Link, what a target subclasses, and its fix text: in launch/kernel/agent_run/link.py, named here too for the targets
from sdp_jupyter.launch.kernel.agent_run.link import Link, install_fix

# seconds from opening a link to the agent's hello (connect + interpreter start; on Ray also the actor's
# worker process): a full suite run on a slow 2-core day saw all 4 Ray test hosts miss 30 s while the
# first --warm job started a pool and an agent actor on each (issue 40's final run)
HELLO_TIMEOUT = 60
HEARTBEAT_TIMEOUT = 10.0   # a node silent this long is lost (the agent pings every second)


def start_job(run: "AgentRun", push_bytes: bytes | None, **status) -> Job:
    """Preflight `run`, make the job directory, start the run; nothing is left open on failure."""
    try:
        spec = run.preflight()
        names = [(c.hello or {}).get("hostname") for c in run.conns]  # an elastic job may start without some
        job = create_job(spec, push_bytes, hosts=run.hosts, host_names=names, **status)
    except BaseException:
        run.close_all()
        raise
    run.attach(job, push_bytes)
    job.supervisor = run
    run.start()
    return job


class AgentRun(MirrorChannel, SessionChannel, HealChannel, InspectChannel, WarmStarts, supervise.Run):
    """The supervisor of one job run through node agents: its links (one agent per node), attempts,
    restarts and stop.

    A target subclasses it with `open_links()` (start every node's agent; the links put frames into
    `self.inbox`) and `option` (the flag an unusable node is reported under). Elastic membership
    (launch/kernel/elastic.py) drives it through its door, `elastic.ElasticRun`: `attempt(n)`, `lost()`,
    `eof_reason`, `reopen`, `rejoined`, `elastic_ended`, `write_metrics`, `stopping`, `membership`."""

    option = "--nodes"
    python = sys.executable  # the interpreter named in "not installed" errors
    warm_after_job = True    # start the hosts' warm pools after a job, for the next (warm_pool.job_done)
    final_errors = ("timed out", "host ")  # failures --max-restarts does not restart (a lost host stays lost)
    hello_timeout, heartbeat_timeout = HELLO_TIMEOUT, HEARTBEAT_TIMEOUT  # as elastic.py reads them
    logs_written = False     # the agents write the ranks' logs into the job directory itself (the local target)

    def __init__(self, spec: JobSpec, hosts: list[str], launcher):
        self.spec, self.hosts, self.launcher = spec, hosts, launcher
        self.inbox: queue.Queue = queue.Queue()
        self.conns: list[Link] = []
        self.secret = secrets.token_hex(32)
        self.job: Job | None = None
        self.push_bytes: bytes | None = None
        self._mirror_files = jobdir.Mirror()  # logs, metrics and the result, written into the job directory
        self._views: dict[int, ViewCut] = {}  # what the job view shows of each rank's output
        self.warm_choice = {"warm": True, "cold": False}.get(spec.start)  # --warm / --cold / auto
        self._starts: dict[int, tuple[bool, str | None]] = {}  # node -> (warm, why cold) this attempt
        self._links_closed = threading.Event()  # set by close_all: the pings stop
        self.session = False  # an interactive session's job: a node whose rank died waits for its respawn
        self.session_mail: queue.Queue = queue.Queue()  # a session's answers (supervise.Run.open_session)
        self._replace = False  # a session's job that replaces its dead ranks
        self._lost: dict[int, str] = {}  # the session's dead ranks waiting for replace_rank: {rank: why}
        self._gone: dict[int, str] = {}  # the session's ranks lost with their host: {rank: why}
        self.members: list[int] | None = None  # an elastic job's formation: indexes of self.conns, node order
        self._lost: dict[int, tuple[str, float]] = {}  # nodes lost in this attempt: {index of conns: (why, when)}
        self.membership = None  # an elastic job's elastic.Membership, while it runs
        self.preflight_missing: dict[int, str] = {}  # an elastic job's hosts that failed preflight: {index: why}
        self._respawning: dict[int, str] = {}  # ranks asked to start again: {rank: why}, until their pid comes
        supervise.Run.__init__(self, f"sdp-{spec.target}-{spec.name}")

    def nodes(self) -> list["Link"]:
        """The links of the nodes that run this attempt, in node order: every link, or an elastic
        job's formation (launch/kernel/elastic.py)."""
        return self.conns if self.members is None else [self.conns[i] for i in self.members]

    # ---------------------------------------------------------------- before the job exists
    def preflight(self) -> JobSpec:
        """Start every host's agent at once and check its hello; one SpecError naming every bad host."""
        self.conns = self.open_links()
        threading.Thread(target=self._keep_alive, daemon=True, name=f"sdp-{self.spec.target}-pings").start()
        spec = self.spec  # open_links may settle procs_per_node
        problems: dict[int, str] = {}
        waiting = set(range(len(self.conns)))
        opened = time.monotonic()
        reached: dict[int, float] = {}  # when each link was first seen connected
        # Two clocks per host: reaching it (the link's connect_timeout: an SSH login, a Ray actor that
        # Ray must first start a worker process for) and then the agent's hello (HELLO_TIMEOUT from
        # then). One clock for both let a slow Ray worker start eat the agent's time.
        while waiting:
            now = time.monotonic()
            for node in sorted(waiting):
                conn = self.conns[node]
                if conn.connected.is_set():
                    if now > reached.setdefault(node, now) + HELLO_TIMEOUT:
                        problems[node] = (f"connected, but the agent did not start within {HELLO_TIMEOUT} s "
                                          f"({'; '.join(conn.stderr) or 'no output'})")
                        waiting.discard(node)
                elif now > opened + conn.connect_timeout + 2:
                    problems[node] = conn.unreachable()
                    waiting.discard(node)
            try:
                node, message = self.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if node not in waiting:
                continue
            conn = self.conns[node]
            if message["type"] == "hello":
                conn.hello = message
                waiting.discard(node)
            elif message["type"] == "eof":
                problems[node] = conn.diagnose(message.get("code"), self.python)
                waiting.discard(node)
        ours = channel.version()
        for conn in self.conns:
            if conn.hello is None or conn.node in problems:
                continue
            if conn.hello.get("version") != ours:
                problems[conn.node] = (f"it has sdp_jupyter {conn.hello.get('version')}, this notebook {ours}. "
                                       "Fix: " + install_fix(ours, "there"))
        ppn = spec.procs_per_node
        if ppn is None:  # GPUs per host, as locally; 1 on CPU-only hosts
            ppn = min((max(1, int(c.hello.get("gpus") or 0)) for c in self.conns if c.hello and c.node not in problems),
                      default=1)
        for conn in self.conns:
            short = conn.hello and backends.gpu_shortfall(spec.backend, ppn, int(conn.hello.get("gpus") or 0), "it",
                                                          "--backend smddp")
            if short and conn.node not in problems:
                problems[conn.node] = short[1]
        if problems and spec.elastic and len(self.conns) - len(problems) >= spec.min_nodes:
            self.preflight_missing = problems  # an elastic job starts without them and tries them again
            problems = {}
        if problems:
            lines = "\n".join(f"  {self.hosts[n]}: {problems[n]}" for n in sorted(problems))
            raise SpecError(self.option, f"{len(problems)} of {len(self.hosts)} host(s) cannot run the job; "
                                       f"nothing was started:\n{lines}")
        self.spec = spec.replace(procs_per_node=ppn)
        return self.spec

    def attach(self, job: Job, push_bytes: bytes | None) -> None:
        self.job, self.spec, self.push_bytes = job, job.spec, push_bytes

    def open_links(self) -> list["Link"]:
        raise NotImplementedError

    def reopen(self, node: int, inbox: queue.Queue) -> "Link | None":
        """A new link to the host of conns[node] (its agent started again), its frames going to `inbox`;
        None where the target cannot reach a lost node again (an elastic job then goes on without it)."""
        return None

    def elastic_ended(self, state: str) -> None:
        """An elastic job's last formation ended with `state` (the Slurm target releases its allocation)."""

    def rejoined(self, node: int, link: "Link") -> None:
        """An elastic job's reopened link to conns[node] said hello and takes its place (a target whose
        new link may reach another machine names it here)."""

    def links_in_run(self) -> None:  # a target whose agents start in the run's thread (local) does it here
        pass

    def start_fields(self) -> dict:  # what this target adds to every start frame
        return {}

    def _spawned(self, rank: int, pid: int) -> None:
        """A rank's process started on its node; a replacement's log says so, with why."""
        why = self._respawning.pop(rank, None)
        if why is not None:
            self._out(rank, f"[sdp_jupyter] rank {rank} started again (pid {pid}) after: {why.splitlines()[0]}\n")

    def _keep_alive(self) -> None:
        """Ping every agent each HEARTBEAT_EVERY from the links' start to close_all: an agent that hears
        nothing for its heartbeat timeout stops, and the gaps are many (hellos from a slower host, the
        job directory, warm pools starting, the port)."""
        while not self._links_closed.wait(channel.HEARTBEAT_EVERY):
            for conn in self.conns:
                conn.send({"type": "ping"})

    def close_all(self) -> None:
        self._links_closed.set()
        for conn in self.conns:
            conn.send({"type": "bye"})
        for conn in self.conns:
            conn.close()

    # ---------------------------------------------------------------- the job
    def _supervise(self) -> None:
        job = self.job
        state, error, codes = "failed", None, []
        try:
            self.links_in_run()
            spec = self.spec

            def announce(text: str) -> None:
                for rank in range(spec.world_size):
                    self._out(rank, text)

            if spec.elastic:  # a lost node is left out and the job re-forms (launch/kernel/elastic.py)
                from sdp_jupyter.launch.kernel import elastic

                state, error, codes = elastic.Membership(self, announce).attempts()
            elif spec.heal:  # dead ranks are replaced in place (agent_run/heal_channel.py); --max-restarts counts them
                state, error, codes = self.attempt(0)
            else:  # a lost host is not restarted onto: the job names it and ends
                state, error, codes = supervise.with_restarts(job, self.attempt, announce, self._stop,
                                                              final=self.final_errors)
        except Exception as e:  # our own bug or an OS error: the job fails with it, nothing left running
            state, error = "failed", f"the launcher failed: {type(e).__name__}: {e}"
        finally:
            self.close_all()
            self._write_agent_logs()
            self._mirror_files.close()
            supervise.unregister(self)
            self._warm_after()
            job.update_status(state=state, error=error, exit_codes=codes, ended=time.time(),
                              **backend_verdict.verdict(job.dir, self.spec.backend, self.spec.world_size,
                                                        state))

    def attempt(self, attempt: int) -> tuple[str, str | None, list]:
        job, nodes = self.job, self.nodes()
        spec = self.spec if self.members is None else self.spec.replace(nodes=len(nodes))  # this formation's
        world = spec.world_size
        first = nodes[0]
        self._lost = {}
        port = self._ask_port(first)
        script = channel.b64((job.dir / jobdir.SCRIPT).read_bytes())
        self._starts = {}
        warm_fields = self._warm_fields()
        heal = self._heal_begin()  # a --heal job's first record, written on every host before its ranks start
        for position, conn in enumerate(nodes):
            # "slot": the host's folder of this job, the same whatever node number a re-formation gives it
            conn.send({"type": "start", "spec": spec.to_dict(), "node": position, "slot": conn.node,
                       "secret": self.secret,
                       "master_addr": first.hello["addr"], "master_port": port, "attempt": attempt,
                       "script": script, "push": channel.b64(self.push_bytes),
                       "heartbeat_timeout": HEARTBEAT_TIMEOUT, "session": self.session,
                       **heal, **warm_fields.get(conn.node, {}), **self.start_fields()})
        job.update_status(state="running", started=job.status.get("started") or time.time(), port=port,
                    master_addr=first.hello["addr"])
        started = time.monotonic()
        codes: list = [None] * world
        done: set[int] = set()  # indexes of self.conns whose node ended
        members = {conn.node: position for position, conn in enumerate(nodes)}
        failed: list[int] = []  # ranks that failed, in the order their exits came
        settled = 0.0  # when the first failure's peers have had supervise.SETTLE_S to end too
        next_check = 0.0
        while len(done) < len(nodes):
            now = time.monotonic()
            if failed and (now >= settled or None not in codes):
                return self._fail(supervise.job_error(self.job, failed, codes, self._who, self._host), codes, done)
            if now >= next_check:
                next_check = now + channel.HEARTBEAT_EVERY
                for conn in nodes:
                    if conn.node not in done and now - conn.last_heard > HEARTBEAT_TIMEOUT:
                        done.add(conn.node)  # lost: nobody to wait for there (its agent stops its own ranks)
                        why = self._silence(conn)
                        self._leave(conn.node, why)
                        if not self._host_gone(members[conn.node], why):
                            return self._fail(self._host_lost(conn.host, members[conn.node], why), codes, done)
                if self.members is not None and self.membership.grow_now(len(nodes)):
                    self._stop_all(done, codes)  # a host came back: the job re-forms with it (not a failure)
                    return "reform", self.membership.grow_reason(), codes
            if self._stop.is_set():
                self._stop_all(done, codes)
                return "stopped", self._stop_reason, codes
            if spec.timeout and now - started > spec.timeout and not failed:
                return self._fail(f"timed out after {spec.timeout:g} s (--timeout)", codes, done)
            self._heal_admit()
            try:
                node, message = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            kind = message["type"]
            if node not in members:  # a spare of an elastic job (or a link replaced since): only its end matters
                if kind == "eof" and self.members is not None:
                    self.membership.spare_lost(node, message)
                continue
            if self._mirror(message) or self._heal_answer(node, message):
                continue
            if kind == "started":
                self._started(node, message)
            elif kind == "spawned":
                self._spawned(int(message["rank"]), int(message["pid"]))
            elif kind == "exit":
                rank, code = int(message["rank"]), int(message["code"])
                codes[rank] = code
                if code != 0 and self._replace:  # the session replaces it (replace_rank)
                    self._lost[rank] = failure_message(self.job, rank, self._who(rank), code)
                    continue
                if code != 0 and self._heal_rank(rank, code):  # --heal: the others go on, it starts again
                    continue
                if code != 0:
                    settled = settled or time.monotonic() + supervise.SETTLE_S
                    failed.append(rank)
            elif kind == "result":
                self._mirror_files.replace(job.dir / jobdir.RESULT, channel.unb64(message["data"]))
            elif kind == "done":
                done.add(node)
            elif kind == "error":
                self._leave(node, f"its agent failed: {message.get('message')}")
                return self._fail(f"host {self.hosts[node]} (node {members[node]}): {message.get('message')}",
                                  codes, done)
            elif kind == "eof":
                done.add(node)
                self._leave(node, self.eof_reason(node, message))
                if not self._host_gone(members[node], self._lost[node][0]):
                    return self._fail(self._host_lost(self.hosts[node], members[node], self._lost[node][0]), codes, done)
        if failed:
            return self._fail(supervise.job_error(self.job, failed, codes, self._who, self._host), codes, done)
        return "succeeded", None, codes

    def _leave(self, node: int, why: str, first: bool = False) -> None:
        """conns[node] is lost in this attempt, found now (an elastic job's timeline says since when);
        `first`: unless it was found lost already (the earlier cause and time stand)."""
        if first and node in self._lost:
            return
        self._lost[node] = (why, time.time())

    def lost(self) -> dict[int, tuple[str, float]]:
        """The nodes lost in the attempt that ended last: {index of conns: (why, when it was found, time.time())}."""
        return dict(self._lost)

    def _silence(self, conn: Link) -> str:
        """Why a node that stopped answering is lost (the job's error, an elastic job's timeline)."""
        return f"has not answered for {HEARTBEAT_TIMEOUT:g} s: its link or the host is down"

    def eof_reason(self, node: int, message: dict) -> str:
        conn = self.conns[node]
        said = "; ".join(line for line in list(conn.stderr)[-3:] if line)
        return f"{message['why']} ({conn.kind} exit {message['code']}{': ' + said if said else ''})"

    def _ask_port(self, conn: Link) -> int:
        conn.send({"type": "port", "range": self.spec.env.get("SDP_PORT_RANGE")})  # None: the host's own
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT
        held = []
        try:
            while time.monotonic() < deadline:
                try:
                    node, message = self.inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                if node == conn.node and message["type"] == "port":
                    if "error" in message:
                        raise OSError(message["error"])
                    return int(message["port"])
                if message["type"] == "eof":
                    raise RuntimeError(f"host {self.hosts[node]} (node {node}): {message['why']}")
                if message["type"] != "ping":
                    held.append((node, message))
        finally:
            for item in held:
                self.inbox.put(item)
        raise RuntimeError(f"host {conn.host} did not give a port within {HEARTBEAT_TIMEOUT:g} s")

    def _fail(self, error: str, codes: list, done: set) -> tuple[str, str, list]:
        self._stop_all(done, codes)
        return "failed", error, codes

    def _stop_all(self, done: set, codes: list | None = None) -> None:
        """Every agent stops its ranks; wait (bounded) until each says done, keeping their last output and
        their exit codes (into `codes`). A node that ends its link or never says done is lost (`lost()`:
        an elastic job leaves it out)."""
        g1, g2 = self.launcher.sigint_grace, self.launcher.sigterm_grace
        nodes = {conn.node for conn in self.nodes()}
        for conn in self.nodes():
            if conn.node not in done:
                conn.send({"type": "stop", "sigint_grace": g1, "sigterm_grace": g2})
        deadline = time.monotonic() + g1 + g2 + 8
        while time.monotonic() < deadline and not nodes <= done:
            try:
                node, message = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if node not in nodes or self._mirror(message):
                continue
            if message["type"] == "eof":
                self._leave(node, self.eof_reason(node, message), first=True)
            if message["type"] == "exit" and codes is not None and int(message["rank"]) < len(codes):
                codes[int(message["rank"])] = int(message["code"])
            if message["type"] in ("done", "eof"):
                done.add(node)
        for node in nodes - done:
            self._leave(node, f"did not stop its ranks within {g1 + g2 + 8:g} s of being asked", first=True)

    def _host(self, rank: int) -> str:
        return self.nodes()[rank // self.spec.procs_per_node].host

    def _who(self, rank: int) -> str:
        node, local_rank = divmod(rank, self.spec.procs_per_node)
        return f"rank {rank} (node {node} on host {self.nodes()[node].host}, local rank {local_rank})"

    def kill_now(self) -> None:
        """At interpreter exit: close every connection at once; the agents stop their ranks."""
        self._stop.set()
        for conn in self.conns:
            conn.send({"type": "stop", "sigint_grace": 0.5, "sigterm_grace": 0.5})
        for conn in self.conns:
            conn.close(wait=2.0)
