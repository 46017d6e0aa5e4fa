"""gather, scatter and all_to_all, routed by topology and by each collective's record (its `span`,
native/include/sdp/coll_records.h: what the engine covers in which layout): the part of a collective
between ranks of one node goes through the engine (the node's shared memory; blocks over SMALL_BYTES read
straight from the peers' memory where the node allows it), the blocks for other nodes' ranks as messages
(the mailbox, on the collectives' tag) at the same time.

- gather: one node, the engine; several nodes, every rank sends its block to the root as a message,
  also from the root's node (the root's node through the engine measured no faster: 4 ranks on 2
  nodes, 64 MiB, 16-19 ms either way; docs/benchmarks.md §11).
- scatter: one node, the engine. Several nodes, blocks over SMALL_BYTES and other ranks on the
  root's node: those ranks read their blocks through the engine while the root sends the other
  nodes' blocks as messages, and the other nodes' ranks submit the engine's scatter too (which keeps
  every rank's engine sequence in step; it returns at once there). Otherwise across nodes all
  messages: an engine call that moves a few KiB, or nothing, costs more than it saves.
- all_to_all with equal blocks: the engine moves the blocks between ranks of this node while the
  blocks for other nodes' ranks go as messages. With blocks of any sizes: all messages.

`Routes` is a part of `Communicator` (communicator.py supplies submit_handle, post_send/post_recv,
messages_work and copy). Its methods on raw buffers (`*_buffers`, `all_to_all_blocks`: pointers,
counts, dtype codes) are what the torch adapter calls; the numpy face is below them.
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Any, Callable, Sequence

import numpy as np

from sdp_jupyter.comm.codes import COLL_TAG, COLLECTIVES, COLLS, DTYPE_SIZES, DTYPES, SMALL_BYTES

_SPAN = {r["code"]: r["span"] for r in COLLECTIVES.values()}

Block = tuple[int, int]  # (pointer, bytes)


def moved_as(code: int | None, count: int, itemsize: int) -> tuple[int, int]:
    """(count, dtype code) for a collective that only moves data (gather, scatter, all_to_all): the
    data's own, or its bytes as uint8 where the engine has no code for its dtype."""
    return (count, code) if code is not None else (count * itemsize, DTYPES["uint8"])


def overlapping(blocks: Sequence[Block], others: Sequence[Block]) -> list[int]:
    """The indices of `blocks` that share a byte with any of `others` (in-place calls: a block a
    peer reads must not be written before it is read)."""
    merged: list[list[int]] = []
    for s, e in sorted((p, p + n) for p, n in others if n):
        if merged and s <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], e)
        else:
            merged.append([s, e])
    starts = [s for s, _ in merged]
    hits = []
    for i, (p, n) in enumerate(blocks):
        k = bisect_right(starts, p + n - 1) - 1 if n else -1
        if k >= 0 and merged[k][1] > p:
            hits.append(i)
    return hits


class Routes:
    rank: int
    world_size: int
    node_of_rank: list[int]
    num_nodes: int
    submit_handle: Callable[..., int]
    post_send: Callable[..., int]
    post_recv: Callable[..., int]
    messages_work: Callable[..., Any]
    copy: Callable[[int, int, int], None]
    _buffer: Callable[..., Any]
    _done: Callable[..., Any]
    _check_root: Callable[[int], None]

    # ---- raw buffers
    def gather_buffers(self, src: int, count: int, dtype: int, root: int, outs: Sequence[int] = (),
                       keepalive: Any = None, finish=()):
        """The root's `outs` (one buffer of `count` elements per rank) <- every rank's `src`."""
        self._check_root(root)
        nbytes = count * DTYPE_SIZES[dtype]
        if self.rank == root:
            self._check_count("gather on the root", outs)
        if self._engine_part(COLLS["gather"]) == "none":
            if self.rank != root:
                return self._exchange([(root, src, nbytes)], [], keepalive, finish)
            return self._exchange([], [(r, o, nbytes) for r, o in enumerate(outs) if r != root], keepalive, finish,
                                  (outs[root], src, nbytes))
        h = self.submit_handle(COLLS["gather"], src, count, dtype, 0, root, blocks=outs if self.rank == root else ())
        return self.messages_work((), keepalive, finish, (h,))

    def scatter_buffers(self, out: int, count: int, dtype: int, root: int, ins: Sequence[int] = (),
                        keepalive: Any = None, finish=()):
        """`out` (`count` elements) <- block `rank` of the root's `ins` (one buffer per rank)."""
        self._check_root(root)
        nbytes = count * DTYPE_SIZES[dtype]
        me, nodes = self.rank, self.node_of_rank
        if me == root:
            self._check_count("scatter on the root", ins)
        if self._engine_part(COLLS["scatter"]) == "node" and (nbytes <= SMALL_BYTES or nodes.count(nodes[root]) == 1):
            if me != root:
                return self._exchange([], [(root, out, nbytes)], keepalive, finish)
            return self._exchange([(r, p, nbytes) for r, p in enumerate(ins) if r != root], [], keepalive, finish,
                                  (out, ins[root], nbytes))
        if me == root:
            sends, recvs = [(r, ins[r], nbytes) for r in self._remote(range(self.world_size))], []
        else:
            sends, recvs = [], [(r, out, nbytes) for r in self._remote([root])]
        return self._split(sends, recvs, lambda: self.submit_handle(COLLS["scatter"], out, count, dtype, 0, root,
                                                                    blocks=ins if me == root else ()),
                           keepalive, finish)

    def all_to_all_buffers(self, out: int, src: int, count: int, dtype: int, keepalive: Any = None, finish=()):
        """Equal blocks: block r of `out` (world_size blocks of `count` elements) <- block `rank` of
        rank r's `src`. Give every rank equal blocks or none (`all_to_all_blocks`): a rank here and
        one there wait for each other until the timeout."""
        nb = count * DTYPE_SIZES[dtype]
        if overlapping([(src, nb * self.world_size)], [(out, nb * self.world_size)]):
            src, keepalive = self._copied(src, nb * self.world_size, keepalive)  # peers read it while it is written
        remote = self._remote(range(self.world_size))
        return self._split([(r, src + r * nb, nb) for r in remote], [(r, out + r * nb, nb) for r in remote],
                           lambda: self.submit_handle(COLLS["all_to_all"], out, count, dtype, 0, 0, src=src),
                           keepalive, finish)

    def all_to_all_blocks(self, outs: Sequence[Block], ins: Sequence[Block], keepalive: Any = None, finish=()):
        """Blocks of any sizes, as (pointer, bytes): outs[r] <- rank r's ins[rank]; all messages
        (a size that differs from the sender's fails the receive, naming both)."""
        w, me = self.world_size, self.rank
        if len(outs) != w or len(ins) != w:
            raise ValueError(f"all_to_all needs {w} input and {w} output blocks (one per rank)")
        if outs[me][1] != ins[me][1]:
            raise ValueError(f"all_to_all: this rank's own block has {ins[me][1]} bytes in and {outs[me][1]} out")
        ins = list(ins)
        for i in overlapping(ins, outs):
            p, keepalive = self._copied(ins[i][0], ins[i][1], keepalive)
            ins[i] = (p, ins[i][1])
        return self._exchange([(r, *ins[r]) for r in range(w) if r != me], [(r, *outs[r]) for r in range(w) if r != me],
                              keepalive, finish, (outs[me][0], ins[me][0], ins[me][1]))

    # ---- how they are put together
    def _engine_part(self, coll: int) -> str:
        """What the engine moves of `coll` in this group, from its record's span: "all" (every block: its
        span is "all", or the group is one node), "node" (the blocks between ranks of this node; the rest
        go as messages meanwhile) or "none" (it runs on one node only, and this group has several)."""
        span = _SPAN[coll]
        if span == "all" or self.num_nodes == 1:
            return "all"
        return "node" if span == "node_part" else "none"

    def _check_count(self, what: str, buffers: Sequence) -> None:
        if len(buffers) != self.world_size:
            raise ValueError(f"{what} needs {self.world_size} buffers (one per rank), got {len(buffers)}")

    def _remote(self, ranks) -> list[int]:
        """Those of `ranks` on another node than this rank (their blocks go as messages)."""
        nodes, me = self.node_of_rank, self.rank
        return [r for r in ranks if nodes[r] != nodes[me]]

    def _copied(self, ptr: int, nbytes: int, keepalive: Any) -> tuple[int, Any]:
        tmp = np.empty(nbytes, dtype=np.uint8)
        self.copy(tmp.ctypes.data, ptr, nbytes)
        return tmp.ctypes.data, (keepalive, tmp)

    def _post(self, sends, recvs) -> list[int]:
        """Receives first, so the peers' messages land straight in place instead of being kept and
        copied; then the sends."""
        handles = [self.post_recv(peer, COLL_TAG, p, n) for peer, p, n in recvs]
        handles += [self.post_send(peer, COLL_TAG, p, n) for peer, p, n in sends]
        return handles

    def _exchange(self, sends, recvs, keepalive, finish, local=None):
        """Messages (peer, pointer, bytes) on the collectives' tag; `local` (this rank's own block:
        destination, source, bytes) is copied right after posting, while the I/O thread moves them."""
        work = self.messages_work(self._post(sends, recvs), keepalive, finish)
        if local is not None:
            try:
                self.copy(*local)
            except BaseException:
                self._finish_posted(work)
                raise
        return work

    def _split(self, sends, recvs, submit: Callable[[], int], keepalive, finish):
        """The engine's part (`submit()`: the blocks between ranks of this node) and the messages
        for other nodes' ranks at once; the engine alone when there are none."""
        if not sends and not recvs:
            return self.messages_work((), keepalive, finish, (submit(),))
        handles = self._post(sends, recvs)
        try:
            h = submit()
        except BaseException:
            self._finish_posted(self.messages_work(handles))
            raise
        return self.messages_work(handles, keepalive, finish, (h,))

    @staticmethod
    def _finish_posted(work) -> None:
        """When a step after posting fails, the messages (which belong to the peers' collective
        too) finish before its error is raised, so no buffer goes while in use."""
        try:
            work.wait()
        except Exception:  # noqa: BLE001 - the step's error is the one to report
            pass

    # ---- numpy face
    def gather(self, out, inp, root: int = 0, async_op: bool = False):
        """On the root, out (a list of world_size arrays like inp, or one array of world_size x
        inp's elements) <- every rank's inp; other ranks pass out=None."""
        i, code = self._buffer(inp, writable=False)
        self._check_root(root)
        outs = self._blocks(out, i, "gather's output") if self.rank == root else []
        count, code = moved_as(code, i.size, i.itemsize)
        return self._done(self.gather_buffers(i.ctypes.data, count, code, root, [o.ctypes.data for o in outs],
                                              (i, outs)), async_op)

    def scatter(self, out, inp, root: int = 0, async_op: bool = False):
        """out <- block `rank` of the root's inp (a list of world_size arrays like out, or one array
        of world_size x out's elements); other ranks pass inp=None."""
        o, code = self._buffer(out)
        self._check_root(root)
        ins = self._blocks(inp, o, "scatter's input", writable=False) if self.rank == root else []
        count, code = moved_as(code, o.size, o.itemsize)
        return self._done(self.scatter_buffers(o.ctypes.data, count, code, root, [b.ctypes.data for b in ins],
                                               (o, ins)), async_op)

    def all_to_all_single(self, out, inp, out_splits: Sequence[int] | None = None,
                          in_splits: Sequence[int] | None = None, async_op: bool = False):
        """Block r of out <- block `rank` of rank r's inp. Blocks are rows of the first dimension:
        equal (world_size of them) or as the split sizes say (give them on every rank or on none)."""
        o, code = self._buffer(out)
        i, _ = self._buffer(inp, writable=False)
        if i.dtype != o.dtype:
            raise ValueError(f"all_to_all_single: input ({i.dtype}) and output ({o.dtype}) dtypes differ")
        if out_splits is None and in_splits is None:
            if i.size != o.size or o.size % self.world_size:
                raise ValueError(f"all_to_all_single: input ({i.size}) and output ({o.size}) must have the same "
                                 f"number of elements, divisible by the world size {self.world_size}")
            count, code = moved_as(code, o.size // self.world_size, o.itemsize)
            return self._done(self.all_to_all_buffers(o.ctypes.data, i.ctypes.data, count, code, (o, i)), async_op)
        return self._done(self.all_to_all_blocks(self._rows(o, out_splits, "output"), self._rows(i, in_splits, "input"),
                                                  (o, i)), async_op)

    def all_to_all(self, outs, ins, async_op: bool = False):
        """outs[r] <- rank r's ins[rank]: lists of world_size arrays of any sizes; all messages."""
        outs = [self._buffer(a)[0] for a in outs]
        ins = [self._buffer(a, writable=False)[0] for a in ins]
        return self._done(self.all_to_all_blocks([(a.ctypes.data, a.nbytes) for a in outs],
                                                 [(a.ctypes.data, a.nbytes) for a in ins], (outs, ins)), async_op)

    def _blocks(self, arrs, like: np.ndarray, what: str, writable: bool = True) -> list[np.ndarray]:
        """world_size arrays of like's size and dtype: a list of them, or the blocks of one array."""
        if isinstance(arrs, (list, tuple)):
            blocks = [self._buffer(a, writable)[0] for a in arrs]
            self._check_count(what, blocks)
        else:
            a = self._buffer(arrs, writable)[0]
            if a.size != like.size * self.world_size:
                raise ValueError(f"{what} must hold world_size x {like.size} = {like.size * self.world_size} "
                                 f"elements, not {a.size}")
            flat = a.reshape(-1)
            blocks = [flat[r * like.size:(r + 1) * like.size] for r in range(self.world_size)]
        for b in blocks:
            if b.size != like.size or b.dtype != like.dtype:
                raise ValueError(f"{what}: every block must have {like.size} elements of {like.dtype} "
                                 f"(got {b.size} of {b.dtype})")
        return blocks

    def _rows(self, a: np.ndarray, splits: Sequence[int] | None, what: str) -> list[tuple[int, int]]:
        """(pointer, bytes) of each rank's rows of a."""
        rows = a.shape[0] if a.ndim else 0
        if splits is None:
            if rows % self.world_size:
                raise ValueError(f"all_to_all_single: the {what}'s first dimension {rows} is not divisible by the "
                                 f"world size {self.world_size} (or pass split sizes)")
            splits = [rows // self.world_size] * self.world_size
        if len(splits) != self.world_size or sum(splits) != rows:
            raise ValueError(f"all_to_all_single: {what} split sizes {list(splits)} must have {self.world_size} "
                             f"entries summing to the first dimension {rows}")
        row_bytes = a.nbytes // rows if rows else 0
        starts = np.concatenate([[0], np.cumsum(splits)]).astype(int)
        return [(a.ctypes.data + int(starts[r]) * row_bytes, int(splits[r]) * row_bytes) for r in range(self.world_size)]
