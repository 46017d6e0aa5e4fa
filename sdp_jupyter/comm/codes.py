"""The engine's codes and numbers, as its module binds them (native/python/module.cpp): no copy to drift.

dtype, op and collective codes (native/include/sdp/common.h), the bytes per element of each dtype,
the engine's defaults (EngineConfig) and SMALL_BYTES, the block size up to which an engine call
moves a block through the node's small slots (shm_node.h's kSmallBytes).
"""
from __future__ import annotations

import numpy as np

from sdp_jupyter import _engine

EngineError = _engine.EngineError

DTYPES = {name: int(v) for name, v in _engine.DType.__members__.items()}
OPS = {name: int(v) for name, v in _engine.ReduceOp.__members__.items()}
COLLS = {name: int(v) for name, v in _engine.Coll.__members__.items()}
COLL_ALLREDUCE, COLL_BROADCAST, COLL_ALLGATHER, COLL_REDUCE_SCATTER = (
    COLLS["all_reduce"], COLLS["broadcast"], COLLS["all_gather"], COLLS["reduce_scatter"])
COLL_GATHER, COLL_SCATTER, COLL_ALLTOALL = COLLS["gather"], COLLS["scatter"], COLLS["all_to_all"]
DTYPE_SIZES = {code: _engine.dtype_size(code) for code in DTYPES.values()}
NUMPY_DTYPES = {np.dtype(k): v for k, v in DTYPES.items() if k != "bfloat16"}

SMALL_BYTES: int = _engine.SMALL_BYTES
DEFAULT_TIMEOUT: float = _engine.DEFAULT_TIMEOUT
DEFAULT_CHUNK_BYTES: int = _engine.DEFAULT_CHUNK_BYTES

# Collectives built on messages use this tag; messages between two ranks keep their order, so
# successive collectives never take each other's pieces (nor a user's: a tag nobody picks).
COLL_TAG = -(1 << 62)


class SmddpError(RuntimeError):
    """A collective failed on this rank: mismatch, dead or stalled peer, bad secret, timeout."""
