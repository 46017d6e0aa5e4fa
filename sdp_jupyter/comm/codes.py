"""The engine's codes and numbers, as its module binds them (native/python/module.cpp): no copy to drift.

dtype and op codes (native/include/sdp/common.h), the collectives' records (coll_records.h: name, code,
whether it reduces or has a root, what the engine covers by layout), the bytes per element of each dtype,
the engine's defaults (EngineConfig) and SMALL_BYTES, the block size up to which an engine call
moves a block through the node's small slots (shm_node.h's kSmallBytes).
"""
from __future__ import annotations

import numpy as np

from sdp_jupyter import _engine

EngineError = _engine.EngineError
EngineError.__doc__ = ("The native engine's own error (a RuntimeError raised by its C++ side); the communicator's "
                       "calls raise SmddpError instead, with the same message.")

#: the engine's dtype codes by name (the numpy dtypes of the same names, except bfloat16, work as arrays)
DTYPES = {name: int(v) for name, v in _engine.DType.__members__.items()}
#: the reduce operations by name, as `op=` takes them, and their engine codes
OPS = {name: int(v) for name, v in _engine.ReduceOp.__members__.items()}
#: the engine's record of each collective by name (native/include/sdp/coll_records.h): code, reduces, rooted,
#: root_blocks (the root gives a buffer per rank), needs_src, span ("all": the engine moves every byte;
#: "one_node": only when the group is one node; "node_part": the blocks between ranks of one node) and doc
COLLECTIVES: dict[str, dict] = {r["name"]: r for r in _engine.collectives()}
#: the engine's collective codes by name, as Communicator.submit takes them (``COLLS["all_reduce"]``): a new
#: collective's record (native/src/coll_records.cpp) is here with no edit
COLLS = {name: r["code"] for name, r in COLLECTIVES.items()}
#: bytes per element, by dtype code
DTYPE_SIZES = {code: _engine.dtype_size(code) for code in DTYPES.values()}
NUMPY_DTYPES = {np.dtype(k): v for k, v in DTYPES.items() if k != "bfloat16"}

#: the block size (bytes) up to which an engine call moves a block through the node's small slots
SMALL_BYTES: int = _engine.SMALL_BYTES
#: seconds a collective waits for its peers before failing, when neither timeout= nor SDP_TIMEOUT says
DEFAULT_TIMEOUT: float = _engine.DEFAULT_TIMEOUT
#: the engine chunk (bytes): the pipeline grain and each shared-memory slot, unless chunk_bytes= or SDP_CHUNK_BYTES says
DEFAULT_CHUNK_BYTES: int = _engine.DEFAULT_CHUNK_BYTES

# Collectives built on messages use this tag; messages between two ranks keep their order, so
# successive collectives never take each other's pieces (nor a user's: a tag nobody picks).
#: the message tag of the collectives built on messages (gather, scatter, all_to_all): a tag no user picks
COLL_TAG = -(1 << 62)


class SmddpError(RuntimeError):
    """A collective failed on this rank: mismatch, dead or stalled peer, bad secret, timeout."""
