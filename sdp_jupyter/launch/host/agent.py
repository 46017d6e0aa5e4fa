"""The node agent: `python -m sdp_jupyter.launch.host.agent`, one per node of every job but SageMaker's.

Each target reaches it over a byte channel, the agent's stdin and stdout: the local target through a
pipe to a child of the kernel (launch/targets/local/launcher.py), the SSH target through `ssh -T host python -m
sdp_jupyter.launch.host.agent`, the Ray target through an actor on the node that starts the agent as
its child and relays the frames (launch/targets/ray/launcher.py), the Slurm target through srun. On its host the
agent writes the job's files into a private folder, starts the node's ranks with the same bootstrap
and environment (launch/host/ranks.py), runs the node's utilization sampler, watches, stops and starts
again its ranks, and streams everything back: each rank's output, metrics lines, exit codes, rank 0's
result. A local job's agents work in the kernel's job folder itself (`shared_dir` in the start frame):
they send back only output (for the views), pids, exits and answers to the launcher's frames.

Channel: frames of a 4-byte big-endian length and a UTF-8 JSON object with a "type". Binary values
(the script, --push data, the result) travel base64-encoded. The job secret arrives in the `start`
frame, so it is never on a command line, in the host's environment or in a file.

    agent -> launcher   hello {version, python, hostname, addr, gpus, pid}   once, at start
                        port {port} or {error}      answer to `port`: a free port on this host, or why none
                        out {rank, text}            a piece of a rank's output (at most LINE_CAP bytes)
                        metrics {file, lines}       new complete lines of a metrics/*.jsonl file
                        spawned {rank, pid}         a rank's process started (at start, or a respawn)
                        exit {rank, code}           a rank ended
                        result {data}               rank 0's result.pkl (after rank 0 exited)
                        started {warm, reason}      how this attempt's ranks started (warm: forked
                                                    from the kernel's pool on this host, launch/host/warm.py)
                        done {codes}                every rank of the attempt has ended
                        ping {}                     every HEARTBEAT_EVERY seconds
                        error {message}             the agent cannot go on (bad frame, cannot start)
                        answer {kind, rank, n, data}  a session's rank said it is ready, or answered
                                                    cell n (launch/host/session_relay.py)
    launcher -> agent   start {...}  port {range}  stop {}  ping {}  bye {}   (range: the job's SDP_PORT_RANGE or None;
                                                    start's shared_dir, ranks_here, split_gpus: a local job's)
                        session {}                  this job is a session: a dead rank waits for its
                                                    respawn (or "session": true in the start frame)
                        cell {n, data}              a session's cell for the node's ranks
                        interrupt {}                interrupt the cell the node's ranks run
                        stacks {id, ranks, wait}    the ranks' (None: all) Python stacks; answered by
                                                    stacks {id, dumps, errors} (launch/host/rank_stacks.py)
                        respawn {rank, join}        start a session's dead rank again (SDP_SESSION_JOIN=join);
                                                    in a session, a node whose rank died waits for this or `stop`

The agent stops its ranks (SIGINT, SIGTERM, SIGKILL to their process groups) on `stop`, and on its
own when the channel closes (the SSH connection dropped, the notebook died) or when no frame came
from the launcher for the heartbeat timeout (a closed laptop, a cut link): no orphans. Its ranks
and sampler also die with it (parent-death signal). Files live under
`$SDP_AGENT_DIR` (default `~/.cache/sdp_jupyter/jobs`)/<job name>/node-<N>, 0700; a job's checkpoints stay
there between restarts; the rest is removed when the launcher says `bye`.
"""
from __future__ import annotations

import os
import queue
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

from sdp_jupyter.launch.channel import (HEARTBEAT_EVERY, HEARTBEAT_TIMEOUT, ChannelClosed, b64, decode,
                                        encode, unb64, version)
from sdp_jupyter._env import env_str


def connection_address() -> str:
    """The address the other hosts of the job reach this one on: SDP_AGENT_ADDR (set by the Ray
    target: the Ray node's address), else the address this host was reached on over SSH (the server
    side of $SSH_CONNECTION), else what the host name resolves to, else loopback."""
    if env_str("SDP_AGENT_ADDR"):
        return os.environ["SDP_AGENT_ADDR"]
    parts = os.environ.get("SSH_CONNECTION", "").split()
    if len(parts) == 4:
        return parts[2]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def rank_environment(spec, m: dict, rank: int, job_dir: Path, addr: str, gpus: int) -> dict:
    """The environment of `rank`, started by the agent of start frame `m` (launch/host/ranks.py)."""
    from sdp_jupyter import jobdir
    from sdp_jupyter.launch.host import ranks

    env = ranks.environment(spec, rank=rank, world_size=spec.world_size, job_dir=str(job_dir), job_name=spec.name,
                            secret=m["secret"], master_addr=m["master_addr"], master_port=int(m["master_port"]),
                            bind_addr=addr, attempt=int(m.get("attempt", 0)), gpus=gpus,
                            ranks_here=int(m.get("ranks_here") or spec.procs_per_node),
                            split_gpus=bool(m.get("split_gpus")))
    env["SDP_SCRIPT"] = str(job_dir / jobdir.SCRIPT)
    return env


def agent_root() -> Path:
    return Path(env_str("SDP_AGENT_DIR") or Path.home() / ".cache" / "sdp_jupyter" / "jobs")


class Agent:
    def __init__(self, inp, out):
        self.inp, self.out = inp, out
        self._send_lock = threading.Lock()
        self._last_heard = time.monotonic()
        self._node = None  # this attempt's NodeRanks
        self._samplers: list = []
        self._attempt_thread: threading.Thread | None = None
        self.job_dir: Path | None = None
        self.addr = connection_address()
        self.timeout = HEARTBEAT_TIMEOUT
        self.closed = threading.Event()
        self._relay = None  # a session's SessionRelay: cells to the node's ranks, answers back
        self._heal_sent: set[str] = set()  # heal files not to send (again): received, or `finished` sent
        self._envs: dict[int, dict] = {}  # each rank's environment in this attempt (for respawn)
        self._live: set[int] = set()  # the ranks of this attempt whose process runs
        self._stopping = threading.Event()  # set by stop: a session's node stops waiting for respawns
        self._session_job = False
        self._heal_job = False  # a --heal job: a dead rank's node waits for its respawn; heal files relayed
        self._store = None  # a session's store process on node 0 (launch/host/session_store.py)
        # the local target's agents work in the kernel's job folder, which the launcher reads itself:
        # no files are written for it, sent back, relayed or removed (only output for the views, exits)
        self._shared = False

    def send(self, message: dict) -> None:
        data = encode(message)
        with self._send_lock:
            try:
                self.out.write(data)
                self.out.flush()
            except (BrokenPipeError, OSError, ValueError):
                self.closed.set()

    # ---------------------------------------------------------------- main loop
    def serve(self) -> int:
        from sdp_jupyter.launch.host.ranks import gpu_count

        self.send({"type": "hello", "version": version(), "python": sys.executable, "hostname": socket.gethostname(),
                   "addr": self.addr, "gpus": gpu_count(), "pid": os.getpid()})
        threading.Thread(target=self._heartbeat, daemon=True, name="sdp-agent-heartbeat").start()
        try:
            while not self.closed.is_set():
                message = decode(self.inp)
                self._last_heard = time.monotonic()
                kind = message["type"]
                if kind == "start":
                    self._start(message)
                elif kind == "port":
                    from sdp_jupyter._net import free_port

                    try:
                        self.send({"type": "port", "port": free_port(self.addr, message.get("range"))})
                    except OSError as e:  # (a full SDP_PORT_RANGE): the launcher's error, the agent goes on
                        self.send({"type": "port", "error": str(e)})
                elif kind == "session":  # (cells come as `cell` frames)
                    self._session_job = True
                elif kind == "cell":
                    if self._relay is None:
                        raise ValueError("a cell came for a job that is not a session")
                    self._relay.cell(message)
                elif kind == "interrupt":
                    self._interrupt()
                elif kind == "respawn":
                    self._respawn(int(message["rank"]), message)
                elif kind == "heal":
                    self._heal_file(message)
                elif kind == "flight":  # Job.flight(): this host's ranks write their flight recorders' rings
                    if self.job_dir is not None:
                        from sdp_jupyter import jobdir

                        jobdir.write_private(jobdir.flight_request_path(self.job_dir), str(time.time()))
                elif kind == "stacks":
                    self._stacks(message)
                elif kind == "stop":
                    self._stop_ranks(float(message.get("sigint_grace", 3)), float(message.get("sigterm_grace", 2)))
                elif kind == "bye":
                    self._stop_ranks(0.5, 0.5)
                    self._remove_files()
                    return 0
        except ChannelClosed:
            pass
        except Exception as e:  # a bad frame, a folder we may not use: said, then the ranks are stopped
            self.send({"type": "error", "message": f"{type(e).__name__}: {e}"})
        finally:
            self.closed.set()
            self._stop_ranks(1.0, 1.0)
            if self._relay is not None:
                self._relay.close()
        return 0

    def _heartbeat(self) -> None:
        while not self.closed.wait(HEARTBEAT_EVERY):
            self.send({"type": "ping"})
            if time.monotonic() - self._last_heard > self.timeout:
                # the launcher is gone (a cut link, a closed laptop): stop the ranks, then leave
                self.closed.set()
                self._stop_ranks(1.0, 1.0)
                os._exit(3)

    # ---------------------------------------------------------------- one attempt
    def _start(self, m: dict) -> None:
        from sdp_jupyter import jobdir
        from sdp_jupyter.launch.host import ranks
        from sdp_jupyter.launch.host.node import NodeRanks
        from sdp_jupyter.launch.spec import JobSpec

        if self._attempt_thread is not None and self._attempt_thread.is_alive():
            raise ValueError("a start came while the previous attempt still runs")
        self.timeout = float(m.get("heartbeat_timeout", HEARTBEAT_TIMEOUT))
        from sdp_jupyter.launch.targets import DEFAULT_TARGET, TARGETS

        data = m["spec"]
        if data.get("target") not in TARGETS:  # registered in the notebook's process only: a node runs the same
            data = {**data, "target": DEFAULT_TARGET}
        spec = JobSpec.from_dict(data)
        name = spec.name
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"bad job name {name!r}")
        node = int(m["node"])
        # per host of the job ("slot": an elastic job renumbers its nodes; a host keeps its folder and
        # checkpoints); per node, not per job: a home on shared storage serves many hosts
        job_dir = agent_root() / name / f"node-{int(m.get('slot', node))}"
        if m.get("shared_dir"):
            job_dir, self._shared = Path(m["shared_dir"]), True
        elif self.job_dir is None:  # first attempt: fresh files; checkpoints of an earlier run of the name kept
            jobdir.ensure_private_dir(agent_root())
            jobdir.ensure_private_dir(job_dir.parent)
            jobdir.prepare(job_dir)
            jobdir.write_private(job_dir / jobdir.SCRIPT, unb64(m["script"]))
            jobdir.write_private(job_dir / jobdir.SPEC, spec.to_json())
            if m.get("push") is not None:
                jobdir.write_private(job_dir / jobdir.PUSH, unb64(m["push"]))
            (job_dir / jobdir.CHECKPOINTS).mkdir(exist_ok=True)
            if spec.checkpoint_dir:
                Path(spec.checkpoint_dir).expanduser().mkdir(parents=True, exist_ok=True)
        self.job_dir = job_dir
        if not self._shared:  # (a shared folder's result is the launcher's to clear)
            (job_dir / jobdir.RESULT).unlink(missing_ok=True)
        ppn = spec.procs_per_node
        gpus = ranks.gpu_count()
        pool, reason = m.get("warm"), m.get("cold_reason")
        if pool:
            from sdp_jupyter.launch.host import warm

            if pool.get("fingerprint") != warm.fingerprint():
                pool, reason = None, "the installed code changed since the pool on this host started"
        if node == 0 and (spec.env.get("SDP_SESSION_STORE") or spec.heal) and self._store is None:
            from sdp_jupyter.launch.host import session_store

            self._store = session_store.start(job_dir, self.addr, int(m["master_port"]))
        self._heal_job = spec.heal
        if spec.heal and not self._shared:  # the membership record its ranks read first (sdp_jupyter.heal)
            jobdir.ensure_private_dir(job_dir / jobdir.HEAL)
            self._heal_file(m["heal"])
            threading.Thread(target=self._relay_heal, daemon=True, name="sdp-agent-heal").start()
        node_ranks = NodeRanks(job_dir, lambda rank, raw: self.send(
            {"type": "out", "rank": rank, "text": raw.decode("utf-8", errors="replace")}), name="sdp-agent",
            job_env=spec.env)
        if spec.env.get("SDP_SESSION_CHANNEL") and self._relay is None:  # a session: its ranks connect here
            from sdp_jupyter.launch.host.session_relay import SessionRelay

            self._relay = SessionRelay(self.send, m["secret"])
        # this attempt's ranks only: an elastic job renumbers its nodes, and a rank this host ran before
        # (its number now another host's) would be waited for forever
        self._envs = {}
        for local_rank in range(ppn):
            rank = node * ppn + local_rank
            env = self._envs[rank] = rank_environment(spec, m, rank, job_dir, self.addr, gpus)
            if self._relay is not None:
                env["SDP_SESSION_CHANNEL"] = self._relay.name
            proc = warm.fork_rank(pool["socket"], ranks.WORKER, env, owned=True) if pool else None
            if isinstance(proc, str):  # one cold rank makes the node cold
                pool, reason = None, proc
            proc = ranks.spawn(env) if proc is None or isinstance(proc, str) else proc
            node_ranks.add(rank, proc)
            self.send({"type": "spawned", "rank": rank, "pid": proc.pid})
        self._live = set(self._envs)
        self._stopping.clear()
        self._session_job = self._session_job or bool(m.get("session"))
        if self._store is not None:  # awaited aside: this loop must go on reading (the launcher's pings)
            threading.Thread(target=self._store_ready, daemon=True, name="sdp-agent-store").start()
        self.send({"type": "started", "warm": pool is not None, "reason": reason})
        self._node = node_ranks
        if not self._samplers:
            sampler = ranks.start_sampler(job_dir, node)
            if sampler is not None:
                self._samplers.append(sampler)
        self._attempt_thread = threading.Thread(target=self._watch, args=(node_ranks,), daemon=True, name="sdp-agent-watch")
        self._attempt_thread.start()

    def _store_ready(self) -> None:
        """The session's store listens, or the launcher hears why not (the job then fails)."""
        from sdp_jupyter.launch.host import session_store

        store = self._store
        try:
            session_store.ready(store)
        except RuntimeError as e:
            if self._store is store:
                self.send({"type": "error", "message": str(e)})

    def _watch(self, node_ranks) -> None:
        tailer_stop = threading.Event()
        tailer = threading.Thread(target=self._tail_metrics, args=(tailer_stop,), daemon=True)
        tailer.start()
        codes = {}
        # a session's or --heal job's node whose rank died stays up for the launcher's respawn (or stop);
        # read each time: the `session {}` frame may come after the start
        while self._live or ((self._session_job or self._heal_job) and any(codes.values())
                             and not self._stopping.is_set()):
            try:
                rank, code = node_ranks.exits.get(timeout=0.2)
            except queue.Empty:
                continue
            self._live.discard(rank)
            node_ranks.last_lines(rank)  # its last lines go out before its exit
            codes[rank] = code
            self.send({"type": "exit", "rank": rank, "code": code})
        from sdp_jupyter import jobdir

        node_ranks.kill_groups()
        tailer_stop.set()
        tailer.join(timeout=5)
        result = self.job_dir / jobdir.RESULT
        # the rank that saved the result ran here (rank 0; in a --heal job maybe another) and ended well
        if codes and not any(codes.values()) and result.is_file() and not self._shared:
            self.send({"type": "result", "data": b64(result.read_bytes())})
        self.send({"type": "done", "codes": codes})

    # ---------------------------------------------------------------- an interactive session
    def _respawn(self, rank: int, m: dict) -> None:
        """A rank that died, started again (cold): a session's, to join the group at m["join"]
        (generation:cell:members), or a --heal job's (m["heal"]), to join the others at a step boundary."""
        from sdp_jupyter.launch.host import ranks

        if rank not in self._envs or rank in self._live or self._node is None:
            raise ValueError(f"respawn of rank {rank}: not a dead rank of this node")
        extra = {"SDP_HEAL_JOIN": "1"} if m.get("heal") else {"SDP_SESSION_JOIN": str(m["join"])}
        proc = ranks.spawn({**self._envs[rank], **extra})
        self._live.add(rank)
        self._node.add(rank, proc)
        self.send({"type": "spawned", "rank": rank, "pid": proc.pid})

    # ---------------------------------------------------------------- a --heal job's files
    def _heal_file(self, m: dict) -> None:
        """The launcher's membership record, or the word that training ended (`finished`), for this host's ranks."""
        from sdp_jupyter import jobdir

        name = str(m["name"])
        if not (jobdir.is_heal_record(name) or name == jobdir.HEAL_FINISHED) or self.job_dir is None:
            raise ValueError(f"bad heal file {name!r}")
        if self._shared:  # the launcher wrote it where the ranks read it
            return
        self._heal_sent.add(name)  # never sent back
        jobdir.write_private(self.job_dir / jobdir.HEAL / name, unb64(m["data"]))

    def _relay_heal(self) -> None:
        """Send the files this host's ranks write for the launcher (ready, formed, finished) as they appear:
        ready and formed are removed once sent (a replacement writes its ready file again), finished stays
        (a replacement waiting here reads it)."""
        from sdp_jupyter import jobdir

        folder = self.job_dir / jobdir.HEAL
        while not self.closed.is_set() and not self._stopping.is_set():
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                names = []
            for name in names:
                if name in self._heal_sent or not jobdir.is_heal_answer(name):
                    continue
                try:
                    data = (folder / name).read_bytes()
                except OSError:
                    continue
                self.send({"type": "heal", "name": name, "data": b64(data)})
                if name == jobdir.HEAL_FINISHED:
                    self._heal_sent.add(name)
                else:
                    (folder / name).unlink(missing_ok=True)
            time.sleep(0.005)

    def _interrupt(self) -> None:
        from sdp_jupyter.launch.host.ranks import signal_rank
        from sdp_jupyter.launch.rank.cell_loop import INTERRUPT

        for proc in (self._node.procs if self._node is not None else []):
            signal_rank(proc, INTERRUPT)

    def _stacks(self, m: dict) -> None:
        """Job.stacks(): the Python stacks of the node's ranks asked for (None: all), answered from a thread
        of its own (up to m["wait"] s) while this loop goes on reading (launch/host/rank_stacks.py)."""
        from sdp_jupyter.launch.host import rank_stacks

        node, asked = self._node, m.get("ranks")
        procs = {r: node.proc(r) for r in self._envs if node is not None and (asked is None or r in asked)}
        threading.Thread(target=lambda: self.send({"type": "stacks", "id": m["id"], **rank_stacks.collect(
            procs, self.job_dir, float(m.get("wait", 3.0)))}), daemon=True, name="sdp-agent-stacks").start()

    def _tail_metrics(self, stop: threading.Event) -> None:
        """Send every complete new line of the metrics files, a frame per bounded read (jobdir's
        tailer: over-long lines are dropped, as the reader would); one last sweep after `stop`,
        which also sends a last line its rank left without a newline."""
        from sdp_jupyter import jobdir

        tails: dict[str, jobdir.JsonLinesTail] = {}
        while not self._shared:
            last = stop.wait(0.5)
            for path in jobdir.metrics_paths(self.job_dir, flight=True):
                if jobdir.is_metrics_name(path.name) and path.name not in tails:
                    tails[path.name] = jobdir.JsonLinesTail(path)
            for name, tail in tails.items():
                while True:
                    lines = tail.read(final=last)
                    if lines:
                        text = b"".join(line + b"\n" for line in lines).decode("utf-8", "replace")
                        self.send({"type": "metrics", "file": name, "lines": text})
                    if not tail.behind:
                        break
            if last:
                return

    def _stop_ranks(self, sigint_grace: float, sigterm_grace: float) -> None:
        from sdp_jupyter.launch.host import ranks

        self._stopping.set()
        if self._node is not None:
            self._node.stop(sigint_grace, sigterm_grace)
        if self._attempt_thread is not None:
            self._attempt_thread.join(timeout=10)
        ranks.stop_samplers(self._samplers)
        self._samplers = []
        if self._store is not None:
            from sdp_jupyter.launch.host import session_store

            session_store.stop(self._store)
            self._store = None

    def _remove_files(self) -> None:
        """After the job: everything but the checkpoints (a later job of the name may resume from them)."""
        if self.job_dir is None or self._shared:
            return
        from sdp_jupyter import jobdir

        for entry in list(self.job_dir.iterdir()) if self.job_dir.is_dir() else []:
            if entry.name == jobdir.CHECKPOINTS and any(entry.iterdir()):
                continue
            shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
        for folder in (self.job_dir, self.job_dir.parent):
            try:
                folder.rmdir()
            except OSError:
                pass


def main() -> int:
    import signal

    from sdp_jupyter.launch.process import arm_parent_death_signal

    os.environ.pop("SDP_LAUNCHER_PID", None)
    arm_parent_death_signal(signal.SIGTERM)  # the ssh session's shell or sshd went away: so do we
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # runs `finally`: the ranks are stopped
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(0))
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb", buffering=0)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print() cannot corrupt the channel
    return Agent(sys.stdin.buffer, out).serve()


if __name__ == "__main__":
    sys.exit(main())
