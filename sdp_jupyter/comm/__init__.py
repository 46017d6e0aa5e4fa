"""The engine's Python face: collectives on numpy arrays and raw buffers, no torch needed.

    from sdp_jupyter import comm
    c = comm.init()                      # reads RANK, WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, SDP_JOB_SECRET
    c.all_reduce(array, op="sum")        # in place; returns when done
    w = c.all_reduce(array, async_op=True); ...; w.wait()
    c.gather(outs, array, root=0); c.scatter(array, ins, root=0); c.all_to_all_single(out, array)

Every collective the `smddp` backend runs is here, routed by topology (routing.py): the node's
shared memory, reads straight from the peers' memory, or messages between nodes. The torch backend
(`sdp_jupyter.torch`) is a thin adapter over the same `Communicator`: it passes tensor pointers.

Rooms: codes.py (the engine's codes and numbers, bound from C++), work.py (`Work`),
communicator.py (set-up, rendezvous, the engine's own collectives, messages), routing.py (gather,
scatter, all_to_all), usage.py (what this process's engines did), store.py, secret.py.
"""
from __future__ import annotations

import os

from sdp_jupyter._env import env_float, env_int
from sdp_jupyter.comm.codes import (COLL_TAG, COLLECTIVES, COLLS, DEFAULT_CHUNK_BYTES, DEFAULT_TIMEOUT, DTYPE_SIZES,
                                    DTYPES, OPS, SMALL_BYTES, EngineError, SmddpError)
from sdp_jupyter.comm.communicator import Communicator, bind_address, node_key
from sdp_jupyter.comm.secret import JobSecret, SecretError, env_secret
from sdp_jupyter.comm.usage import live as _live  # noqa: F401 - the tests' view of the open communicators
from sdp_jupyter.comm.usage import usage
from sdp_jupyter.comm.work import Work

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

    rank, world = env_int("RANK", 0, min=0), env_int("WORLD_SIZE", 1, min=1)
    t = timeout if timeout is not None else env_float("SDP_TIMEOUT", DEFAULT_TIMEOUT, min=0.001)
    try:
        secret = env_secret(t)
    except SecretError as exc:
        raise SmddpError(str(exc)) from None
    store = TCPKeyValueStore(os.environ["MASTER_ADDR"], env_int("MASTER_PORT", 0, min=1), server=rank == 0, timeout=t,
                             secret=secret.value)
    _default = Communicator(rank, world, store, timeout=t, chunk_bytes=chunk_bytes, close_store=True, secret=secret)
    return _default


def shutdown() -> None:
    """Close the communicator `init()` made (its engine, mailbox and store), if any; the next `init()`
    makes a new one."""
    global _default
    if _default is not None:
        _default.close()
        _default = None


__all__ = ["Communicator", "Work", "SmddpError", "EngineError", "JobSecret", "init", "shutdown", "usage", "DTYPES",
           "OPS", "DTYPE_SIZES", "SMALL_BYTES", "DEFAULT_TIMEOUT", "DEFAULT_CHUNK_BYTES", "COLL_TAG", "COLLS",
           "COLLECTIVES", "node_key", "bind_address"]
