"""The engine's Python face: collectives on numpy arrays and raw buffers, no torch needed.

    from sdp_jupyter import comm
    c = comm.init()                      # reads RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, SDP_JOB_SECRET
    c.all_reduce(array, op="sum")        # in place; returns when done
    w = c.all_reduce(array, async_op=True); ...; w.wait()

The torch backend (`sdp_jupyter.torch`) builds on the same `Communicator` with a torch store.
"""
from __future__ import annotations

import ipaddress
import json
import os
import secrets
import socket
import threading
from typing import Any, Callable, Sequence

import numpy as np

from sdp_jupyter import _engine

EngineError = _engine.EngineError

# Codes shared with native/include/sdp/common.h
COLL_ALLREDUCE, COLL_BROADCAST = 1, 2
DTYPES = {"float32": 0, "float64": 1, "float16": 2, "bfloat16": 3, "int32": 4, "int64": 5, "uint8": 6, "int8": 7}
OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3, "product": 4}
_NUMPY_DTYPES = {np.dtype(k): v for k, v in DTYPES.items() if k != "bfloat16"}

DEFAULT_TIMEOUT = 300.0
DEFAULT_CHUNK_BYTES = 4 << 20


class SmddpError(RuntimeError):
    """A collective failed on this rank: mismatch, dead or stalled peer, bad secret, timeout."""


def _env_number(name: str, default, kind=float):
    """`kind(os.environ[name])`, or `default` when unset; a bad value names the variable."""
    v = os.environ.get(name)
    if not v:
        return default
    try:
        return kind(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not {'an integer' if kind is int else 'a number'}") from None


def node_key() -> str:
    """What identifies this rank's node: GROUP_RANK as launchers set it, else the host name."""
    group = os.environ.get("GROUP_RANK")
    return f"group-{group}" if group is not None else f"host-{socket.gethostname()}"


def bind_address() -> str:
    """Address the engine listens on: SDP_BIND_ADDR, else loopback for a local job, else the
    interface that routes to MASTER_ADDR (never 0.0.0.0 unless asked for)."""
    explicit = os.environ.get("SDP_BIND_ADDR")
    if explicit:
        return explicit
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        if master == "localhost" or ipaddress.ip_address(master).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(master, 1, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])  # UDP connect sends nothing; it only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class Work:
    """Handle of an asynchronous collective. `wait()` re-raises the engine's error."""

    def __init__(self, comm: "Communicator", handle: int, keepalive: Any = None,
                 finish: Callable[[], None] | None = None):
        self._comm = comm
        self._handle = handle
        self._keepalive = keepalive
        self._finish = finish
        self._done = False
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> None:
        with self._lock:
            if self._done:
                return
            try:
                self._comm._engine.wait(self._handle, float(timeout or 0.0))
            except EngineError as exc:
                raise SmddpError(str(exc)) from None
            if self._finish is not None:
                self._finish()
            self._done = True
            self._keepalive = None

    def is_completed(self) -> bool:
        if self._done:
            return True
        try:
            return self._comm._engine.test(self._handle)
        except EngineError as exc:
            raise SmddpError(str(exc)) from None


class Communicator:
    """One engine instance: a group of ranks, each on a node, talking through the native engine.

    `store` is anything with set(key, bytes) and blocking get(key) -> bytes (torch c10d stores
    or `TCPKeyValueStore`). Node membership comes from each rank's `node` key (GROUP_RANK by
    default); ranks with the same key share memory, different keys talk TCP.
    """

    def __init__(self, rank: int, world_size: int, store, *, node: str | None = None,
                 secret: bytes | str | None = None, prefix: str = "sdp", timeout: float | None = None,
                 chunk_bytes: int | None = None, bind_addr: str | None = None, close_store: bool = False):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a world of {world_size}")
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout if timeout is not None else _env_number("SDP_TIMEOUT", DEFAULT_TIMEOUT)
        chunk = chunk_bytes if chunk_bytes is not None else _env_number("SDP_CHUNK_BYTES", DEFAULT_CHUNK_BYTES, int)
        spin = _env_number("SDP_SPIN", -1, int)  # -1: the engine's default
        self._store = store
        self._close_store = close_store
        node = node if node is not None else node_key()
        key = lambda k: f"{prefix}/{k}"  # noqa: E731

        # Who lives where: every rank publishes its node key; nodes are numbered by first rank.
        store.set(key(f"node-of/{rank}"), node.encode())
        keys = [store.get(key(f"node-of/{r}")).decode() for r in range(world_size)]
        order: dict[str, int] = {}
        for k in keys:
            order.setdefault(k, len(order))
        self.node_of_rank = [order[k] for k in keys]

        secret = secret if secret is not None else os.environ.get("SDP_JOB_SECRET")
        if secret is None:
            # No launcher-provided secret (plain torchrun): rank 0 makes one and shares it
            # through the store, so only processes that took part in this rendezvous can connect.
            if rank == 0:
                store.set(key("secret"), secrets.token_hex(32).encode())
            secret = store.get(key("secret"))
        if isinstance(secret, str):
            secret = secret.encode()

        addr = bind_addr or bind_address()
        self._engine = _engine.Engine(rank, self.node_of_rank, secret, addr, self.timeout, chunk, spin)
        try:
            port, shm = self._engine.prepare()
            if self._engine.is_leader:
                store.set(key(f"leader/{self._engine.node}"),
                          json.dumps({"addr": addr, "port": port, "shm": shm}).encode())
            leaders = [json.loads(store.get(key(f"leader/{n}"))) for n in range(self._engine.num_nodes)]
            self._engine.connect([d["addr"] for d in leaders], [int(d["port"]) for d in leaders],
                                 leaders[self._engine.node]["shm"])
        except EngineError as exc:
            self._engine.shutdown()
            raise SmddpError(str(exc)) from None

    # ---- topology
    @property
    def node(self) -> int:
        return self._engine.node

    @property
    def num_nodes(self) -> int:
        return self._engine.num_nodes

    @property
    def local_rank(self) -> int:
        return self._engine.local_rank

    @property
    def local_size(self) -> int:
        return self._engine.local_size

    def stats(self) -> dict:
        return self._engine.stats()

    # ---- raw submission: the one door every face (numpy, torch) goes through
    def submit(self, coll: int, ptr: int, count: int, dtype: int, op: int = 0, root: int = 0,
               keepalive: Any = None, finish: Callable[[], None] | None = None) -> Work:
        try:
            h = self._engine.submit(coll, ptr, count, dtype, op, root)
        except EngineError as exc:
            raise SmddpError(str(exc)) from None
        return Work(self, h, keepalive, finish)

    # ---- numpy face
    @staticmethod
    def _buffer(arr) -> tuple[np.ndarray, int]:
        a = arr if isinstance(arr, np.ndarray) else np.asarray(memoryview(arr))
        if not a.flags.c_contiguous or not a.flags.writeable:
            raise ValueError("collectives need a C-contiguous, writable array (use np.ascontiguousarray)")
        code = _NUMPY_DTYPES.get(a.dtype)
        if code is None:
            raise TypeError(f"dtype {a.dtype} is not supported; use one of {', '.join(DTYPES)}")
        return a, code

    @staticmethod
    def _op(op: str) -> int:
        try:
            return OPS[op.lower()]
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}; use one of {', '.join(OPS)}") from None

    def _done(self, work: Work, async_op: bool):
        if async_op:
            return work
        work.wait()
        return None

    def all_reduce(self, arr, op: str = "sum", async_op: bool = False):
        a, code = self._buffer(arr)
        return self._done(self.submit(COLL_ALLREDUCE, a.ctypes.data, a.size, code, self._op(op), 0, a), async_op)

    def broadcast(self, arr, root: int = 0, async_op: bool = False):
        a, code = self._buffer(arr)
        self._check_root(root)
        return self._done(self.submit(COLL_BROADCAST, a.ctypes.data, a.size, code, 0, root, a), async_op)

    def reduce(self, arr, root: int = 0, op: str = "sum", async_op: bool = False):
        """Only `root` receives the result; other ranks' arrays are left unchanged."""
        a, code = self._buffer(arr)
        self._check_root(root)
        target = a if self.rank == root else a.copy()
        return self._done(self.submit(COLL_ALLREDUCE, target.ctypes.data, a.size, code, self._op(op), 0, target),
                          async_op)

    def all_gather(self, out, inp, async_op: bool = False):
        """out (world_size * n elements, or a list of world_size arrays) <- every rank's inp."""
        if isinstance(out, (list, tuple)):
            flat = np.empty((self.world_size,) + np.shape(inp), dtype=np.asarray(inp).dtype)
            work = self.all_gather(flat, inp, async_op=True)
            outs = list(out)

            def scatter_back():
                for r, o in enumerate(outs):
                    o[...] = flat[r]
            work._finish = _chain(work._finish, scatter_back)
            return self._done(work, async_op)
        o, code = self._buffer(out)
        i = np.ascontiguousarray(inp)
        if o.size != i.size * self.world_size or o.dtype != i.dtype:
            raise ValueError(f"all_gather output must hold world_size x input = {self.world_size} x {i.size} "
                             f"elements of {i.dtype}; got {o.size} of {o.dtype}")
        n = i.size
        flat_o = o.reshape(-1)
        flat_o[self.rank * n:(self.rank + 1) * n] = i.reshape(-1)
        work = None
        for r in range(self.world_size):
            seg = flat_o[r * n:(r + 1) * n]
            work = self.submit(COLL_BROADCAST, seg.ctypes.data, n, code, 0, r, o)
        return self._done(work, async_op)

    def reduce_scatter(self, out, inp, op: str = "sum", async_op: bool = False):
        """out (n elements) <- this rank's n-element block of the reduction of inp (world_size * n)."""
        o, code = self._buffer(out)
        tmp = np.array(inp, dtype=o.dtype, copy=True).reshape(-1)
        if tmp.size != o.size * self.world_size:
            raise ValueError(f"reduce_scatter input must hold world_size x output = {self.world_size} x {o.size} elements")
        n = o.size

        def take():
            o.reshape(-1)[:] = tmp[self.rank * n:(self.rank + 1) * n]
        return self._done(self.submit(COLL_ALLREDUCE, tmp.ctypes.data, tmp.size, code, self._op(op), 0,
                                      (tmp, o), take), async_op)

    def barrier(self, async_op: bool = False):
        token = np.zeros(1, dtype=np.uint8)
        return self._done(self.submit(COLL_ALLREDUCE, token.ctypes.data, 1, DTYPES["uint8"], OPS["max"], 0, token),
                          async_op)

    def _check_root(self, root: int) -> None:
        if not 0 <= root < self.world_size:
            raise ValueError(f"root {root} is not a rank of this group of {self.world_size}")

    def close(self) -> None:
        self._engine.shutdown()
        if self._close_store and hasattr(self._store, "close"):
            self._store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _chain(a: Callable[[], None] | None, b: Callable[[], None]) -> Callable[[], None]:
    def both():
        if a is not None:
            a()
        b()
    return both


_default: Communicator | None = None


def init(*, timeout: float | None = None, chunk_bytes: int | None = None) -> Communicator:
    """Join the job described by the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
    GROUP_RANK, SDP_JOB_SECRET), as torchrun, SageMaker or `sdp-train` set it."""
    global _default
    if _default is not None:
        return _default
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise RuntimeError(f"sdp_jupyter.comm.init() needs {', '.join(missing)} in the environment: "
                           "start this script with %%sdp_train, sdp-train or torchrun")
    from sdp_jupyter.comm.store import TCPKeyValueStore

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t = timeout if timeout is not None else _env_number("SDP_TIMEOUT", DEFAULT_TIMEOUT)
    store = TCPKeyValueStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), server=rank == 0, timeout=t)
    _default = Communicator(rank, world, store, timeout=t, chunk_bytes=chunk_bytes, close_store=True)
    return _default


def shutdown() -> None:
    global _default
    if _default is not None:
        _default.close()
        _default = None


__all__ = ["Communicator", "Work", "SmddpError", "EngineError", "init", "shutdown", "DTYPES", "OPS"]
