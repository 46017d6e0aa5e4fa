"""The Communicator: one group of ranks on the native engine (set-up, rendezvous, topology) and its
numpy face for the engine's own collectives and for messages; gather, scatter and all_to_all come
from `Routes` (routing.py), which picks shared memory, peer reads or messages by topology."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
from typing import Any, Callable

import numpy as np

from sdp_jupyter import _engine
from sdp_jupyter._env import env_float, env_int, env_str
from sdp_jupyter._net import port_range
from sdp_jupyter.comm import recorder, usage
from sdp_jupyter.comm.codes import (COLLS, DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT, DTYPES, NUMPY_DTYPES, OPS, EngineError,
                                    SmddpError)
from sdp_jupyter.comm.routing import Routes
from sdp_jupyter.comm.secret import (FROM_CALLER, FROM_ENV, FROM_FILE, JobSecret, SecretError, check_secret,
                                     group_secret, is_loopback)
from sdp_jupyter.comm.work import Channels, Work

_U8 = DTYPES["uint8"]


def node_key() -> str:
    """What identifies this rank's node: GROUP_RANK as launchers set it, else the host name."""
    group = (os.environ.get("GROUP_RANK") or "").strip()
    return f"group-{group}" if group else f"host-{socket.gethostname()}"


def bind_address() -> str:
    """Address the engine listens on: SDP_BIND_ADDR, else loopback for a local job, else the
    interface that routes to MASTER_ADDR (never 0.0.0.0 unless asked for)."""
    explicit = env_str("SDP_BIND_ADDR")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    if is_loopback(master):
        return "127.0.0.1"
    try:
        infos = socket.getaddrinfo(master, 1, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])  # UDP connect sends nothing; it only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class Communicator(Routes):
    """One engine instance: a group of ranks, each on a node, talking through the native engine.

    `store` is anything with set(key, bytes) and blocking get(key) -> bytes (torch c10d stores
    or `TCPKeyValueStore`). Node membership comes from each rank's `node` key (GROUP_RANK by
    default); ranks with the same key share memory, different keys talk TCP. `error` makes the
    exception a failed collective or message raises from its message (default SmddpError; the
    torch adapter passes one that makes torch's DistBackendError).
    """

    def __init__(self, rank: int, world_size: int, store, *, node: str | None = None,
                 secret: bytes | str | JobSecret | None = None, prefix: str = "sdp", timeout: float | None = None,
                 chunk_bytes: int | None = None, bind_addr: str | None = None, close_store: bool = False,
                 error: Callable[[str], BaseException] = SmddpError):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout if timeout is not None else env_float("SDP_TIMEOUT", DEFAULT_TIMEOUT, min=0.001)
        if not (0 < self.timeout < float("inf")):
            raise ValueError(f"timeout must be a positive finite number of seconds, not {self.timeout!r}")
        chunk = chunk_bytes if chunk_bytes is not None else env_int("SDP_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, min=4096)
        spin = env_int("SDP_SPIN", -1, min=-1)  # -1: the engine's default
        self._store = store
        self._close_store = close_store
        self._error = error
        node = node if node is not None else node_key()
        self._prefix = prefix
        self.group_name = "default" if prefix == "sdp" else prefix  # how the flight recorder names the group
        # No secret in the store, ever: it comes from the launcher (SDP_JOB_SECRET) or, on one
        # host, from a 0600 file that this group's rank 0 writes (sdp_jupyter.comm.secret).
        if isinstance(secret, JobSecret):
            self._job_secret = secret
        elif secret is not None:
            self._job_secret = JobSecret(check_secret(secret, "the job secret"), FROM_CALLER)
        else:
            try:
                self._job_secret = group_secret(rank, store, f"{prefix}/secret-file", self.timeout)
            except SecretError as exc:
                raise SmddpError(str(exc)) from None
        self._secret = self._job_secret.value
        try:
            self._connect(rank, world_size, store, node, bind_addr, chunk, spin)
        finally:
            self._job_secret.released()  # failed: the one-host file must not outlive the attempt
        self._channels = Channels(self._engine, self._mailbox, error, self._failed)
        usage.opened(self)
        recorder.watch(self)

    def _failed(self, message: str) -> None:
        """Every failed collective or message: the flight recorder's ring goes into the job directory."""
        recorder.failed(self, message)

    def flight(self, last: int = 0) -> list[list]:
        """The engine's flight recorder: its newest `last` collectives (all it keeps when 0), oldest
        first, each a list in sdp_jupyter.comm.recorder.FIELDS' order."""
        return recorder.ring(self, last)

    def _connect(self, rank, world_size, store, node, bind_addr, chunk, spin) -> None:
        secret = self._secret
        addr = bind_addr or bind_address()
        ports = port_range() or (0, 0)  # SDP_PORT_RANGE: both listeners below take their port from it
        # Point-to-point messages (send/recv, gather, scatter, all_to_all) go through the
        # mailbox: its listener is up before anyone learns its address. SDP_SPIN=0 also stops
        # its receives from polling before they sleep.
        self._mailbox = _engine.Mailbox(rank, world_size, secret, addr, self.timeout, spin != 0)
        self.messages = 0  # point-to-point operations posted (sends and receives)
        try:
            p2p_port = self._mailbox.listen(*ports)
        except EngineError as exc:
            self._mailbox.shutdown()
            raise SmddpError(str(exc)) from None

        # Who lives where: every rank publishes its node key (and its mailbox); nodes are
        # numbered by first rank. The secret's source rides along for the error message when
        # two ranks' secrets differ.
        self._put(f"node-of/{rank}", json.dumps({"node": node, "addr": addr, "port": p2p_port,
                                                 "secret": self._job_secret.source}).encode())
        try:
            ranks = [json.loads(self._take(f"node-of/{r}")) for r in range(world_size)]
        except SmddpError:
            self._mailbox.shutdown()
            raise
        self._job_secret.released()  # every rank signed its record: all of them have the secret
        keys = [str(d["node"]) for d in ranks]
        order: dict[str, int] = {}
        for k in keys:
            order.setdefault(k, len(order))
        self.node_of_rank = [order[k] for k in keys]
        self._mailbox.set_peers([str(d["addr"]) for d in ranks], [int(d["port"]) for d in ranks])

        self._engine = _engine.Engine(rank, self.node_of_rank, secret, addr, self.timeout, chunk, spin)
        try:
            port, _ = self._engine.prepare(*ports)
            if self._engine.is_leader:
                self._put(f"leader/{self._engine.node}", json.dumps({"addr": addr, "port": port}).encode())
            leaders = [json.loads(self._take(f"leader/{n}")) for n in range(self._engine.num_nodes)]
            self._engine.connect([str(d["addr"]) for d in leaders], [int(d["port"]) for d in leaders])
            # the topology, fixed for the group's life: plain attributes (read on every routed call)
            e = self._engine
            self.node, self.num_nodes, self.local_rank, self.local_size = e.node, e.num_nodes, e.local_rank, e.local_size
            self._finish_setup()
        except (EngineError, SmddpError) as exc:
            self._engine.shutdown()
            self._mailbox.shutdown()
            raise SmddpError(str(exc)) from None

    # ---- the rendezvous: every value is signed with the job secret, so a store that is not
    # ours (torch's TCPStore under plain torchrun) cannot be used to redirect a rank
    def _sign(self, key: str, value: bytes) -> bytes:
        return hmac.new(self._secret, f"{self._prefix}/{key}".encode() + b"\0" + value, hashlib.sha256).digest()

    def _put(self, key: str, value: bytes) -> None:
        self._store.set(f"{self._prefix}/{key}", self._sign(key, value) + value)

    def _take(self, key: str) -> bytes:
        raw = bytes(self._store.get(f"{self._prefix}/{key}"))
        mac, value = raw[:32], raw[32:]
        if len(raw) < 32 or not hmac.compare_digest(mac, self._sign(key, value)):
            raise SmddpError(f"the rendezvous value '{self._prefix}/{key}' was not written by a rank of this job "
                             f"(wrong signature): {self._why_unsigned(value)}")
        return value

    def _why_unsigned(self, value: bytes) -> str:
        """Which case a signature mismatch is, from what the other rank says its secret was (its
        words are not trusted for anything but this message)."""
        mine = self._job_secret.source
        try:
            theirs = str(json.loads(value)["secret"])
        except (ValueError, KeyError, TypeError):
            theirs = None
        if theirs is None:
            return ("another program wrote it, or a rank of another version of sdp_jupyter; "
                    "if this is your job, SDP_JOB_SECRET differs between ranks")
        if theirs != mine:
            return (f"that rank's secret came from {theirs}, this rank's from {mine}. Fix: set the same "
                    "SDP_JOB_SECRET on every rank, or on none of them (one host)")
        if mine == FROM_ENV:
            return ("SDP_JOB_SECRET differs between ranks (fix: the same value on every rank), or another job "
                    "uses the same rendezvous (MASTER_ADDR:MASTER_PORT or init_method)")
        if mine == FROM_FILE:
            return ("the ranks read different one-host secrets: another job on this machine uses the same "
                    "rendezvous (init_method file or MASTER_PORT), or an earlier job's record was left in it. "
                    "Fix: a fresh init_method, or the same SDP_JOB_SECRET on every rank")
        return "the ranks were given different secrets"

    def _finish_setup(self) -> None:
        """Every rank says it is connected; then rank 0 stops serving the store (nobody needs it
        any more, and a store that is closed can be reached by nobody)."""
        if not self._close_store:
            return  # the caller owns the store (and may set up more groups through it)
        self._put(f"ready/{self.rank}", b"1")
        if self.rank == 0:
            for r in range(self.world_size):
                self._take(f"ready/{r}")
            if self._close_store and hasattr(self._store, "close_server"):
                self._store.close_server()
        if self._close_store and hasattr(self._store, "close") and self.rank != 0:
            self._store.close()
            self._close_store = False

    def stats(self) -> dict:
        """The engine's counters (collectives, bytes, busy_s, peer_read_bytes: bytes read straight
        from local peers' memory by large gather, scatter and all_to_all) and `messages`, the point-to-point
        operations posted."""
        return {**self._engine.stats(), "messages": self.messages}

    # ---- raw buffers (pointers): what the numpy face below, routing.py and the torch adapter build on
    def submit(self, coll: int, ptr: int, count: int, dtype: int, op: int = 0, root: int = 0,
               keepalive: Any = None, finish: Callable[[], None] | None = None, *, src: int = 0,
               blocks=()) -> Work:
        """Queue one engine collective (a code of codes.COLLS) on the buffer at `ptr`. `src`:
        all_to_all's input; `blocks`: the root's one buffer per rank of gather and scatter."""
        if src or blocks:
            h = self.submit_handle(coll, ptr, count, dtype, op, root, src, blocks)
        else:  # the common call, one frame less (microseconds count at 4 KiB)
            try:
                h = self._engine.submit(coll, ptr, count, dtype, op, root)
            except EngineError as exc:
                raise self._error(str(exc)) from None
        return Work(self._channels, (h,), (), keepalive, () if finish is None else (finish,))

    def submit_handle(self, coll: int, ptr: int, count: int, dtype: int, op: int = 0, root: int = 0, src: int = 0,
                      blocks=()) -> int:
        """`submit`'s engine handle alone. The common call has a binding of its own (nothing for
        pybind to convert per call: microseconds count at 4 KiB)."""
        try:
            if src or blocks:
                return self._engine.submit_buffers(coll, ptr, count, dtype, op, root, src, list(blocks))
            return self._engine.submit(coll, ptr, count, dtype, op, root)
        except EngineError as exc:
            raise self._error(str(exc)) from None

    def post_send(self, dst: int, tag: int, ptr: int, nbytes: int) -> int:
        """Post a message of `nbytes` at `ptr` to rank dst; returns its mailbox handle (see `messages_work`)."""
        return self._post_message(self._mailbox.isend, dst, tag, ptr, nbytes)

    def post_recv(self, src: int, tag: int, ptr: int, nbytes: int) -> int:
        """Post a receive of `nbytes` into `ptr` from rank src (-1: any rank); returns its mailbox handle."""
        return self._post_message(self._mailbox.irecv, src, tag, ptr, nbytes)

    def _post_message(self, post, peer: int, tag: int, ptr: int, nbytes: int) -> int:
        try:
            h = post(peer, tag, ptr, nbytes)
        except EngineError as exc:
            raise self._error(str(exc)) from None
        self.messages += 1
        return h

    def messages_work(self, handles, keepalive: Any = None, finish=(), engine_handles=()) -> Work:
        """One work for posted messages (and engine collectives that run beside them); the
        sequences are kept as given."""
        return Work(self._channels, engine_handles, handles, keepalive, finish)

    def handles_work(self, handles, keepalive: Any = None, finish=(), after=None) -> Work:
        """One work for engine handles from `submit_handle` (one collective submitted in pieces,
        e.g. the torch adapter's staged chunks); `after`: a step per handle, run once it is done
        (see `Work`)."""
        return Work(self._channels, tuple(handles), (), keepalive, finish, after)

    def finished(self, handle: int) -> bool:
        """Whether the engine has completed `handle`, without waiting; a failed group raises."""
        try:
            return self._engine.test(handle)
        except EngineError as exc:
            raise self._error(str(exc)) from None

    def join(self, works) -> Work:
        """One work for several (the coalesced calls)."""
        return Work.joined(self._channels, works)

    def done(self, keepalive: Any = None) -> Work:
        """A work that is already complete (an operation finished before it returned)."""
        return Work(self._channels, (), (), keepalive)

    @staticmethod
    def copy(dst: int, src: int, nbytes: int) -> None:
        """Copy between two raw buffers that do not overlap (the same one is fine), the GIL released (the engine's copy:
        0.15 us for 4 KiB where ctypes.memmove takes 0.38 and torch's copy_ 0.87)."""
        _engine.copy_scaled(_U8, dst, src, nbytes, 1.0)

    # ---- numpy face
    @staticmethod
    def _buffer(arr, writable: bool = True) -> tuple[np.ndarray, int]:
        a = arr if isinstance(arr, np.ndarray) else np.asarray(memoryview(arr))
        if not a.flags.c_contiguous or (writable and not a.flags.writeable):
            raise ValueError("collectives need a C-contiguous" + (", writable" if writable else "")
                             + " array (use np.ascontiguousarray)")
        code = NUMPY_DTYPES.get(a.dtype)
        if code is None:
            raise TypeError(f"dtype {a.dtype} is not supported; use one of {', '.join(DTYPES)}")
        return a, code

    @staticmethod
    def _op(op: str) -> int:
        try:
            return OPS[op.lower()]
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(OPS)}") from None

    @staticmethod
    def _done(work: Work, async_op: bool):
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, arr, op: str = "sum", async_op: bool = False):
        """Reduce `arr` over every rank, in place: `op` is a key of OPS (sum, avg, max, min, product).
        `arr` is a C-contiguous, writable numpy array (or buffer) of a dtype in DTYPES. Returns None once
        done, or with async_op the Work to wait on."""
        a, code = self._buffer(arr)
        return self._done(self.submit(COLLS["all_reduce"], a.ctypes.data, a.size, code, self._op(op), 0, a), async_op)

    def broadcast(self, arr, root: int = 0, async_op: bool = False):
        """Copy rank `root`'s `arr` into every rank's `arr`, in place. Returns None once done, or with
        async_op the Work to wait on."""
        a, code = self._buffer(arr)
        self._check_root(root)
        return self._done(self.submit(COLLS["broadcast"], a.ctypes.data, a.size, code, 0, root, a), async_op)

    def reduce(self, arr, root: int = 0, op: str = "sum", async_op: bool = False):
        """Only `root` receives the result; other ranks' arrays are left unchanged."""
        a, code = self._buffer(arr)
        self._check_root(root)
        target = a if self.rank == root else a.copy()
        return self._done(self.submit(COLLS["all_reduce"], target.ctypes.data, a.size, code, self._op(op), 0, target),
                          async_op)

    def all_gather(self, out, inp, async_op: bool = False):
        """out (world_size * n elements, or a list of world_size arrays) <- every rank's inp."""
        if isinstance(out, (list, tuple)):
            flat = np.empty((self.world_size,) + np.shape(inp), dtype=np.asarray(inp).dtype)
            outs = list(out)

            def scatter_back():
                for r, o in enumerate(outs):
                    o[...] = flat[r]
            return self._done(self.all_gather(flat, inp, async_op=True).then(scatter_back), async_op)
        o, code = self._buffer(out)
        i = np.ascontiguousarray(inp)
        if o.size != i.size * self.world_size or o.dtype != i.dtype:
            raise ValueError(f"all_gather output must hold world_size x input = {self.world_size} x {i.size} "
                             f"elements of {i.dtype}; got {o.size} of {o.dtype}")
        n = i.size
        o.reshape(-1)[self.rank * n:(self.rank + 1) * n] = i.reshape(-1)
        return self._done(self.submit(COLLS["all_gather"], o.ctypes.data, n, code, 0, 0, o), async_op)

    def reduce_scatter(self, out, inp, op: str = "sum", async_op: bool = False):
        """out (n elements) <- this rank's n-element block of the reduction of inp (world_size * n)."""
        o, code = self._buffer(out)
        tmp = np.array(inp, dtype=o.dtype, copy=True).reshape(-1)
        if tmp.size != o.size * self.world_size:
            raise ValueError(f"reduce_scatter input must hold world_size x output = {self.world_size} x {o.size} elements")
        n = o.size

        def take():
            o.reshape(-1)[:] = tmp[self.rank * n:(self.rank + 1) * n]
        return self._done(self.submit(COLLS["reduce_scatter"], tmp.ctypes.data, n, code, self._op(op), 0,
                                      (tmp, o), take), async_op)

    def send(self, arr, dst: int, tag: int = 0, async_op: bool = False):
        """Sends arr to rank dst; matched by the receive on dst with this rank (or any) and tag."""
        a = self._message_buffer(arr)
        self._check_peer(dst, "destination")
        return self._done(self.messages_work([self.post_send(dst, tag, a.ctypes.data, a.nbytes)], a), async_op)

    def recv(self, arr, src: int | None = None, tag: int = 0, async_op: bool = False):
        """Receives into arr from rank src (None: any rank); returns the sender's rank, or with
        async_op the Work whose wait() returns it."""
        a = self._message_buffer(arr, writable=True)
        if src is not None:
            self._check_peer(src, "source")
        work = self.messages_work([self.post_recv(-1 if src is None else src, tag, a.ctypes.data, a.nbytes)], a)
        return work if async_op else work.wait()

    @staticmethod
    def _message_buffer(arr, writable: bool = False) -> np.ndarray:
        a = arr if isinstance(arr, np.ndarray) else np.asarray(memoryview(arr))
        if not a.flags.c_contiguous or (writable and not a.flags.writeable):
            raise ValueError("messages need a C-contiguous" + (", writable" if writable else "") + " array")
        return a

    def _check_peer(self, r: int, what: str) -> None:
        if not 0 <= r < self.world_size:
            raise ValueError(f"{what} rank {r} is not a rank of this group of {self.world_size}")

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(f"root {root} is not a rank of this group of {self.world_size}")

    def barrier(self, async_op: bool = False):
        """Return once every rank has called it; with async_op, the Work."""
        return self._done(self.submit(COLLS["barrier"], 0, 0, DTYPES["uint8"]), async_op)

    def close(self) -> None:
        """Shut this rank's engine and message mailbox down, and close the store when this communicator
        owns it (comm.init's does). Leaving a `with Communicator(...)` block calls it."""
        usage.closing(self)
        recorder.forget(self)
        self._engine.shutdown()
        self._mailbox.shutdown()
        if self._close_store and hasattr(self._store, "close"):
            self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
