"""The `smddp` backend for torch.distributed, served by the native engine.

    import sdp_jupyter.torch            # registers the backend "smddp"
    import torch.distributed as dist
    dist.init_process_group("smddp")    # under torchrun, sdp-train, %%sdp_train or SageMaker
    model = torch.nn.parallel.DistributedDataParallel(model)   # stock DDP works unchanged

CPU tensors are reduced in place. CUDA tensors are staged through pinned host memory (the
engine reduces on the CPUs of the training hosts). fp16/bf16 tensors travel as 16-bit and are
summed in float32.
"""
from __future__ import annotations

import datetime
import os
import queue
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from sdp_jupyter.comm import (COLL_ALLGATHER, COLL_ALLREDUCE, COLL_ALLTOALL, COLL_BROADCAST, COLL_GATHER,
                              COLL_REDUCE_SCATTER, COLL_SCATTER, DTYPES, OPS, Communicator, EngineError, SmddpError,
                              submit_to)

BACKEND_NAME = "smddp"

# The engine's codes come from sdp_jupyter.comm (one table); torch's names map onto them by name.
_DTYPES = {getattr(torch, name): code for name, code in DTYPES.items()}
_DTYPES[torch.bool] = DTYPES["uint8"]  # reduced as bytes, with logical ops (see _op_code)
_OPS = {getattr(ReduceOp, name.upper()): code for name, code in OPS.items()}
_OP_TYPES = {getattr(ReduceOp.RedOpType, name.upper()): code for name, code in OPS.items()}
_LOGICAL = {OPS["sum"]: OPS["max"], OPS["product"]: OPS["min"]}  # bool: SUM is OR, PRODUCT is AND
_AVG = OPS["avg"]
_TORCH_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


class SmddpBackendError(SmddpError, dist.DistBackendError):
    """A collective failed (peer lost, timeout, mismatch): torch's `DistBackendError`, so
    torchelastic, Ray and user code that catch torch's type catch ours; `except SmddpError`
    keeps working."""


def _backend_error(exc: BaseException) -> SmddpBackendError:
    msg = str(exc)
    # torch's tools look for " Timed out " (gloo and NCCL say it that way)
    if "timed out" in msg and " Timed out " not in msg:
        msg = "smddp: " + msg.replace("timed out", "Timed out", 1)
    return SmddpBackendError(msg)


class SmddpUnsupportedError(NotImplementedError):
    """An operation the smddp engine does not do yet; the message names it and the way around."""


def _unsupported(op: str, instead: str):
    raise SmddpUnsupportedError(f"smddp does not implement {op} yet; {instead}")


def _op_code(op, dtype) -> int:
    # opts.reduceOp is a ReduceOp wrapping a hashable RedOpType: one dict look-up per call
    code = _OP_TYPES.get(getattr(op, "op", op))
    if code is None:
        code = next((c for o, c in _OPS.items() if op == o), None)
    if code is None:
        raise ValueError(f"smddp supports SUM, AVG, MAX, MIN and PRODUCT, not {op}")
    if dtype == torch.bool:
        code = _LOGICAL.get(code, code)
    elif code == _AVG and not dtype.is_floating_point:
        raise ValueError(f"ReduceOp.AVG needs a floating-point tensor, got {dtype}")
    return code


def _dtype_code(t: torch.Tensor) -> int:
    code = _DTYPES.get(t.dtype)
    if code is None:
        raise TypeError(f"smddp cannot reduce {t.dtype} tensors; supported: "
                        + ", ".join(str(d).replace("torch.", "") for d in _DTYPES))
    return code


def _staged(t: torch.Tensor):
    """(buffer the engine works on in place, copy-back callable or None): no object at all for
    the common case of a contiguous CPU tensor."""
    if t.device.type == "cpu" and t.is_contiguous():
        return t, None
    s = _Staged(t)
    return s.buf, s.finish


class _Staged:
    """A tensor the engine can work on in place: contiguous, on the CPU. Copies back at the end."""

    def __init__(self, t: torch.Tensor):
        self.orig = t
        if t.device.type == "cpu" and t.is_contiguous():
            self.buf = t
        elif t.device.type == "cpu":
            self.buf = t.contiguous()
        else:  # CUDA (or another device): through pinned host memory
            self.buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            self.buf.copy_(t)

    def finish(self) -> None:
        if self.buf is not self.orig:
            self.orig.copy_(self.buf)


class SmddpWork(dist._Work):
    """Work handle: wait() blocks (GIL released) until the engine is done; get_future() for DDP.

    It holds the engine's integer handles directly (no per-collective Python objects below
    it) and the buffers the engine writes into, until the collective is done.
    """

    _via = "_engine"  # whose handles these are: the engine's (collectives) or the mailbox's (messages)

    def __init__(self, pg: "ProcessGroupSMDDP", handles, result, keep=None, finish=()):
        super().__init__()
        self._handles = handles
        self._keep = keep
        self._result = result
        self._finish = [f for f in finish if f is not None]
        self._lock = threading.Lock()
        self._done = False
        self._error: BaseException | None = None
        self._future: torch.futures.Future | None = None
        self._pg = pg

    def _complete(self, timeout_s: float = 0.0) -> None:
        with self._lock:
            if self._done:
                if self._error is not None:
                    raise self._error
                return
            try:
                self._wait_handles(timeout_s)
                for f in self._finish:
                    f()
            except (EngineError, SmddpError) as exc:
                self._error = _backend_error(exc)
                raise self._error from None
            finally:
                self._done = True
                self._keep = None

    def _wait_handles(self, timeout_s: float) -> None:
        # a collective runs to its end or to the group's deadline (SDP_TIMEOUT): the engine
        # cannot withdraw one that other ranks take part in
        wait = self._pg._engine.wait
        for h in self._handles:
            wait(h, 0.0)

    def wait(self, timeout=None) -> bool:
        if timeout is None:  # what torch passes for a blocking call: the short way (small calls are us)
            self._complete()
            return True
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout or 0.0)
        self._complete(seconds if seconds > 0 else 0.0)
        return True

    def is_completed(self) -> bool:
        if self._done:
            return True
        try:
            test = getattr(self._pg, self._via).test
            return all(test(h) for h in self._handles)
        except (EngineError, SmddpError) as exc:
            raise _backend_error(exc) from None

    def is_success(self) -> bool:
        return self._done and self._error is None

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is not None:
                return self._future
            self._future = torch.futures.Future()
        try:
            done = self.is_completed()
        except SmddpError:
            done = True
        if done:  # no hand-off to the completer thread when the engine has already finished
            self._settle_future()
        else:
            self._pg._completer.put(self)
        return self._future

    def _settle_future(self) -> None:
        try:
            self._complete()
        except BaseException as exc:  # noqa: BLE001 - delivered through the future
            self._future.set_exception(exc)
        else:
            self._future.set_result(self._result)

    def result(self):
        return self._result


class SmddpMessageWork(SmddpWork):
    """Work of point-to-point messages (and the collectives built on them): the mailbox's
    handles. A receive from any source knows its sender once done (`_source_rank()`)."""

    _via = "_mailbox"
    _source = -1

    def _wait_handles(self, timeout_s: float) -> None:
        # wait(timeout) bounds a message (0: the group's timeout); one that times out is withdrawn
        wait = self._pg._mailbox.wait
        handles = list(self._handles)
        deadline = time.monotonic() + timeout_s
        try:
            while handles:
                left = max(deadline - time.monotonic(), 1e-3) if timeout_s else 0.0
                self._source = wait(handles[0], left)
                handles.pop(0)
        except (EngineError, SmddpError):
            for h in handles[1:]:  # withdraw the others before their buffers go
                try:
                    wait(h, 1e-3)
                except (EngineError, SmddpError):
                    pass
            raise

    def _source_rank(self) -> int:
        self._complete()
        return self._source


class SmddpSplitWork(SmddpMessageWork):
    """A collective split between the engine (the node's part, through shared memory) and messages
    (the parts for other nodes), running at once: done when both are."""

    def __init__(self, pg, handles, engine_handle: int, result, keep=None, finish=()):
        super().__init__(pg, handles, result, keep, finish)
        self._engine_handle = engine_handle

    def _wait_handles(self, timeout_s: float) -> None:
        # The engine's part always runs to its end before the buffers may go (peers read them),
        # even when a message failed; the first error is the one raised.
        try:
            super()._wait_handles(timeout_s)
        finally:
            self._pg._engine.wait(self._engine_handle, 0.0)

    def is_completed(self) -> bool:
        if not super().is_completed():
            return False
        try:
            return self._pg._engine.test(self._engine_handle)
        except (EngineError, SmddpError) as exc:
            raise _backend_error(exc) from None


# Up to this a block of scatter across nodes goes as a message also to the root's node: an engine
# call for a few KiB costs more than it saves (the engine's kSmallBytes, native/include/sdp/shm_node.h).
_SPLIT_MIN_BYTES = 64 << 10

# Collectives built on messages use this tag; messages between two ranks keep their order, so
# successive collectives never take each other's pieces.
_COLL_TAG = -(1 << 62)


class ProcessGroupSMDDP(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run in the native engine."""

    def __init__(self, store, rank: int, world_size: int, timeout: datetime.timedelta):
        super().__init__(rank, world_size)
        self._rank, self._world = rank, world_size
        # SDP_TIMEOUT wins, then an explicit init_process_group(timeout=...); given None the
        # communicator reads SDP_TIMEOUT itself (default 300 s).
        seconds = None
        if not os.environ.get("SDP_TIMEOUT") and timeout is not None and timeout != _TORCH_DEFAULT_TIMEOUT:
            seconds = timeout.total_seconds()
        try:
            self.comm = Communicator(rank, world_size, _StoreAdapter(store), timeout=seconds)
        except SmddpError as exc:
            raise _backend_error(exc) from None
        self._engine = self.comm._engine
        self._mailbox = self.comm._mailbox
        _register_name_carrier(self, rank, world_size)
        self._completer: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._complete_futures, name="smddp-futures", daemon=True)
        self._thread.start()

    # torch asks for these
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def size(self) -> int:
        return self._world

    def rank(self) -> int:
        return self._rank

    def _complete_futures(self) -> None:
        while True:
            work = self._completer.get()
            if work is None:
                return
            work._settle_future()

    # ---- helpers
    def _submit(self, coll: int, ptr: int, count: int, dtype: int, op: int = 0, root: int = 0, src: int = 0,
                blocks=()) -> int:
        try:
            return submit_to(self._engine, coll, ptr, count, dtype, op, root, src, blocks)
        except (EngineError, SmddpError) as exc:
            raise _backend_error(exc) from None

    def _allreduce_tensor(self, t: torch.Tensor, op):
        buf, finish = _staged(t)
        h = self._submit(COLL_ALLREDUCE, buf.data_ptr(), buf.numel(), _dtype_code(t), _op_code(op, t.dtype), 0)
        return h, buf, finish

    def _broadcast_tensor(self, t: torch.Tensor, root: int):
        buf, finish = _staged(t)
        return self._submit(COLL_BROADCAST, buf.data_ptr(), buf.numel(), _dtype_code(t), 0, root), buf, finish

    def _merged(self, works, result):
        """One work handle for several (the coalesced variants)."""
        return SmddpWork(self, [h for sw in works for h in sw._handles], result, [sw._keep for sw in works],
                         [f for sw in works for f in sw._finish])

    def _work(self, triples, result):
        return SmddpWork(self, [h for h, _, _ in triples], result, [b for _, b, _ in triples],
                         [f for _, _, f in triples])

    # ---- collectives
    def allreduce(self, tensors, opts=None):
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        if len(tensors) == 1 and not tensors[0].is_sparse:  # the common case, without the list plumbing
            h, buf, finish = self._allreduce_tensor(tensors[0], op)
            return SmddpWork(self, [h], tensors, buf, (finish,))
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, op)
        return self._work([self._allreduce_tensor(t, op) for t in tensors], tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def _sparse_allreduce(self, tensors, op):
        # As gloo does it: every rank's indices and values are all-gathered and summed, so the
        # result is the same sparse tensor on every rank. Done before returning (blocking).
        if _op_code(op, torch.float32) != OPS["sum"]:
            _unsupported(f"all_reduce of sparse tensors with {op}", "use ReduceOp.SUM, or reduce `t.to_dense()`")
        for t in tensors:
            if not t.is_sparse:
                raise ValueError("all_reduce of several tensors needs them all sparse or all dense")
            c = t.detach().cpu().coalesce()
            idx, vals = c.indices(), c.values()
            counts = torch.empty(self._world, dtype=torch.int64)
            self._wait_now(self._gather_flat(counts, torch.tensor([idx.shape[1]])))
            top = int(counts.max())
            pad_i = torch.zeros((idx.shape[0], top), dtype=idx.dtype)
            pad_i[:, :idx.shape[1]] = idx
            pad_v = torch.zeros((top,) + tuple(vals.shape[1:]), dtype=vals.dtype)
            pad_v[:vals.shape[0]] = vals
            all_i = torch.empty((self._world,) + tuple(pad_i.shape), dtype=idx.dtype)
            all_v = torch.empty((self._world,) + tuple(pad_v.shape), dtype=vals.dtype)
            self._wait_now(self._gather_flat(all_i, pad_i) + self._gather_flat(all_v, pad_v))
            keep = [slice(0, int(n)) for n in counts]
            total = torch.sparse_coo_tensor(torch.cat([all_i[r][:, k] for r, k in enumerate(keep)], dim=1),
                                            torch.cat([all_v[r][k] for r, k in enumerate(keep)]),
                                            c.shape).coalesce()
            t.copy_(total.to(t.device))
        return SmddpWork(self, [], tensors)

    def _wait_now(self, handles) -> None:
        SmddpWork(self, handles, None).wait()

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        return self._work([self._broadcast_tensor(t, root) for t in tensors], tensors)

    def reduce(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        triples = []
        for t in tensors:
            if self._rank == root:
                triples.append(self._allreduce_tensor(t, op))
            else:  # non-root tensors are left as they were
                tmp = t.detach().to("cpu", copy=True).contiguous()
                h = self._submit(COLL_ALLREDUCE, tmp.data_ptr(), tmp.numel(), _dtype_code(t), _op_code(op, t.dtype), 0)
                triples.append((h, tmp, None))
        return self._work(triples, tensors)

    def _gather_flat(self, flat: torch.Tensor, inp: torch.Tensor) -> list[int]:
        """flat (world x n, contiguous CPU) <- every rank's inp: the engine's all_gather, in place on
        world blocks of n elements (this rank's block filled first)."""
        n = inp.numel()
        flat.view(-1)[self._rank * n:(self._rank + 1) * n].copy_(inp.reshape(-1))
        return [self._submit(COLL_ALLGATHER, flat.data_ptr(), n, _dtype_code(inp), 0, 0)]

    def allgather(self, output_tensors, input_tensors, opts=None):
        outs, inp = output_tensors[0], input_tensors[0]
        flat = torch.empty((self._world,) + tuple(inp.shape), dtype=inp.dtype)
        handles = self._gather_flat(flat, inp.detach().cpu())

        def scatter_back():
            for r, o in enumerate(outs):
                o.copy_(flat[r])
        return SmddpWork(self, handles, output_tensors, flat, [scatter_back])

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        buf, finish = _staged(output_tensor)
        handles = self._gather_flat(buf, input_tensor.detach().cpu())
        return SmddpWork(self, handles, [output_tensor], buf, [finish])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._merged([self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        out, ins = output_tensors[0], input_tensors[0]
        flat = torch.cat([i.detach().reshape(-1).cpu() for i in ins])
        return self._reduce_scatter_flat(out, flat, op, output_tensors)

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        flat = input_tensor.detach().reshape(-1).to("cpu", copy=True).contiguous()
        return self._reduce_scatter_flat(output_tensor, flat, op, [output_tensor])

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_flat(self, out, flat, op, result):
        n = out.numel()
        if flat.numel() != n * self._world:
            raise ValueError(f"reduce_scatter input must hold world_size x output = {self._world} x {n} elements")
        # the engine's reduce_scatter: in place on world blocks of n, this rank's block reduced
        h = self._submit(COLL_REDUCE_SCATTER, flat.data_ptr(), n, _dtype_code(flat), _op_code(op, flat.dtype), 0)

        def take():
            out.copy_(flat[self._rank * n:(self._rank + 1) * n].view_as(out))
        return SmddpWork(self, [h], result, flat, [take])

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._merged([self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)], outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        # one flat all-gather of the concatenated inputs, then cut per rank and per tensor
        inputs = [i.detach().reshape(-1).cpu() for i in input_tensors]
        cat = torch.cat(inputs) if inputs else torch.empty(0)
        flat = torch.empty((self._world, cat.numel()), dtype=cat.dtype)
        handles = self._gather_flat(flat, cat)

        def cut():
            for r, outs in enumerate(output_lists):
                for o, piece in zip(outs, flat[r].split([i.numel() for i in inputs])):
                    o.copy_(piece.view_as(o))
        return SmddpWork(self, handles, output_lists, flat, [cut])

    # ---- point-to-point messages (the mailbox), and the collectives that are messages
    def _post(self, post, peer: int, tag: int, buf: torch.Tensor) -> int:
        try:
            h = post(peer, tag, buf.data_ptr(), buf.numel() * buf.element_size())
        except (EngineError, SmddpError) as exc:
            raise _backend_error(exc) from None
        self.comm.messages += 1
        return h

    def _send_buffer(self, t: torch.Tensor) -> torch.Tensor:
        if t.is_sparse:
            _unsupported("send/recv of sparse tensors", "send t.indices() and t.values() as two messages")
        t = t.detach()
        return t if t.device.type == "cpu" and t.is_contiguous() else t.to("cpu").contiguous()

    def _messages(self, sends, recvs, result, local=None):
        """One work for several messages: sends (peer, tensor) and receives (peer, tensor), the
        receives written back into their tensors when done. The receives are posted first, so
        the peers' messages land straight in their tensors instead of being kept and copied;
        `local` (this rank's own piece, a (destination, source) pair) is copied right after, while
        the I/O thread moves them."""
        handles, keep, finish = [], [], []
        for peer, t in recvs:
            buf, fin = _staged(t)
            handles.append(self._post(self._mailbox.irecv, peer, _COLL_TAG, buf))
            keep.append(buf)
            finish.append(fin)
        for peer, t in sends:
            buf = self._send_buffer(t)
            handles.append(self._post(self._mailbox.isend, peer, _COLL_TAG, buf))
            keep.append(buf)
        work = SmddpMessageWork(self, handles, result, keep, finish)
        if local is not None:
            self._after_posting(work, lambda: local[0].copy_(local[1]))
        return work

    @staticmethod
    def _after_posting(work: SmddpWork, step):
        """step() once `work`'s messages are posted; if it fails, the messages (which belong to the
        peers' collective too) finish before its error is raised, so no buffer goes while in use."""
        try:
            return step()
        except BaseException:
            try:
                work.wait()
            except Exception:  # noqa: BLE001 - step's error is the one to report
                pass
            raise

    def send(self, tensors, dst, tag=0):
        buf = self._send_buffer(tensors[0])
        return SmddpMessageWork(self, [self._post(self._mailbox.isend, dst, tag, buf)], tensors, buf)

    def recv(self, tensors, src, tag=0):
        buf, finish = _staged(tensors[0])
        return SmddpMessageWork(self, [self._post(self._mailbox.irecv, src, tag, buf)], tensors, buf, (finish,))

    def recv_anysource(self, tensors, tag=0):
        return self.recv(tensors, -1, tag)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        # every rank sends piece r of its input to rank r and receives piece r of its output from
        # rank r; the pieces are rows of dim 0, even or as the split sizes say
        w = self._world
        rows_in, rows_out = (input.shape[0] if input.dim() else 0), (output.shape[0] if output.dim() else 0)

        def splits(given, rows, what):
            if given:
                if len(given) != w or sum(given) != rows:
                    raise ValueError(f"all_to_all_single: {what}_split_sizes {list(given)} must have {w} entries "
                                     f"summing to the first dimension {rows}")
                return list(given)
            if rows % w:
                raise ValueError(f"all_to_all_single: the {what} tensor's first dimension {rows} is not divisible by "
                                 f"the world size {w} (or pass {what}_split_sizes)")
            return [rows // w] * w
        s_in, s_out = splits(input_split_sizes, rows_in, "input"), splits(output_split_sizes, rows_out, "output")
        src = input.detach()
        if src.data_ptr() == output.data_ptr() and src.numel():  # in place: peers read it while it is written
            src = src.clone()
        if not input_split_sizes and not output_split_sizes:
            # equal blocks (no split sizes on any rank: torch passes none when the caller gave
            # none; a rank that gives sizes where another gives none waits for the timeout)
            return self._node_all_to_all(output, src)
        ins, outs = src.split(s_in), output.split(s_out)
        me = self._rank
        return self._messages([(r, ins[r]) for r in range(w) if r != me], [(r, outs[r]) for r in range(w) if r != me],
                              [output], (outs[me], ins[me]))

    all_to_all_single = alltoall_base

    # ---- gather, scatter, all_to_all_single: the engine's shared memory within a node, messages across nodes
    def _check_blocks(self, what: str, tensors, like: torch.Tensor) -> None:
        if len(tensors) != self._world:
            raise ValueError(f"{what} needs {self._world} tensors (one per rank), got {len(tensors)}")
        for t in tensors:
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ValueError(f"{what}: every tensor must have {like.numel()} elements of {like.dtype} "
                                 f"(got {t.numel()} of {t.dtype})")

    def _remote(self, ranks) -> list[int]:
        """Those of `ranks` on another node than this rank (their blocks go as messages)."""
        nodes, me = self.comm.node_of_rank, self._rank
        return [r for r in ranks if nodes[r] != nodes[me]]

    def _split(self, sends, recvs, submit, result, keep, finish):
        """The engine's part (`submit()`: the blocks between ranks of this node) and the messages
        for other nodes' ranks (sends and receives as in _messages) at once; the engine alone when
        there are none."""
        if not sends and not recvs:
            return SmddpWork(self, [submit()], result, keep, finish)
        messages = self._messages(sends, recvs, result)
        h = self._after_posting(messages, submit)
        return SmddpSplitWork(self, messages._handles, h, result, [keep, messages._keep], finish)

    def gather(self, output_lists, input_tensors, opts=None):
        """One node: the engine's gather (shared memory; large blocks read by the root from each
        rank's memory). Several nodes: every rank sends its block to the root as a message, also
        from the root's node (the root's node through the engine measured no faster: 4 ranks on 2
        nodes, 64 MiB, 16-19 ms either way; docs/benchmarks.md §11)."""
        root = opts.rootRank if opts is not None else 0
        src = self._send_buffer(input_tensors[0])
        code, n = _dtype_code(src), src.numel()
        if self._rank == root:
            outs = output_lists[0]
            self._check_blocks("gather on the root", outs, src)
        if self._engine.num_nodes > 1:
            if self._rank != root:
                return self._messages([(root, src)], [], output_lists)
            return self._messages([], [(r, o) for r, o in enumerate(outs) if r != root], output_lists,
                                  (outs[root], src))
        if self._rank != root:
            return SmddpWork(self, [self._submit(COLL_GATHER, src.data_ptr(), n, code, 0, root)], output_lists, src)
        staged = [_staged(o) for o in outs]  # the engine writes straight into each output tensor
        h = self._submit(COLL_GATHER, src.data_ptr(), n, code, 0, root, blocks=[b.data_ptr() for b, _ in staged])
        return SmddpWork(self, [h], output_lists, [src, staged], [f for _, f in staged])

    def scatter(self, output_tensors, input_lists, opts=None):
        """One node: the engine's scatter. Several nodes, blocks over 64 KiB and other ranks on the
        root's node: those ranks read their blocks from the root's memory through the engine while
        the root sends the other nodes' blocks as messages, and the other nodes' ranks submit the
        engine's scatter too (which keeps every rank's engine sequence in step; it returns at once
        there). Otherwise across nodes all messages: an engine call that moves a few KiB, or
        nothing, costs more than it saves. Every rank takes the same path (equal blocks)."""
        root = opts.rootRank if opts is not None else 0
        out = output_tensors[0]
        if self._rank == root:
            self._check_blocks("scatter on the root", input_lists[0], out)
        nodes = self.comm.node_of_rank
        if self._engine.num_nodes > 1 and (out.numel() * out.element_size() <= _SPLIT_MIN_BYTES
                                           or nodes.count(nodes[root]) == 1):
            if self._rank != root:
                return self._messages([], [(root, out)], output_tensors)
            pieces = input_lists[0]
            return self._messages([(r, p) for r, p in enumerate(pieces) if r != root], [], output_tensors,
                                  (out, pieces[root]))
        buf, fin = _staged(out)
        code, n = _dtype_code(buf), buf.numel()
        if self._rank == root:
            pieces = [self._send_buffer(p) for p in input_lists[0]]  # read in place
            sends, recvs = [(r, pieces[r]) for r in self._remote(range(self._world))], []
        else:
            pieces, sends, recvs = [], [], [(r, buf) for r in self._remote([root])]
        return self._split(sends, recvs, lambda: self._submit(COLL_SCATTER, buf.data_ptr(), n, code, 0, root,
                                                              blocks=[p.data_ptr() for p in pieces]),
                           output_tensors, [buf, pieces], (fin,))

    def _node_all_to_all(self, output, input):
        """Equal blocks: the blocks between ranks of one node through the engine's shared memory;
        across nodes the blocks for other nodes' ranks go as messages at the same time."""
        buf, fin = _staged(output)
        src = self._send_buffer(input)
        if src.numel() != buf.numel() or src.dtype != buf.dtype:
            raise ValueError(f"all_to_all_single: input ({src.numel()} x {src.dtype}) and output ({buf.numel()} x "
                             f"{buf.dtype}) must match")
        n = buf.numel() // self._world
        remote = self._remote(range(self._world))
        flat_in, flat_out = src.reshape(-1), buf.reshape(-1)
        return self._split([(r, flat_in[r * n:(r + 1) * n]) for r in remote],
                           [(r, flat_out[r * n:(r + 1) * n]) for r in remote],
                           lambda: self._submit(COLL_ALLTOALL, buf.data_ptr(), n, _dtype_code(buf), 0, 0, src.data_ptr()),
                           [output], [buf, src], (fin,))

    def alltoall(self, output_tensors, input_tensors, opts=None):
        w, me = self._world, self._rank
        if len(output_tensors) != w or len(input_tensors) != w:
            raise ValueError(f"all_to_all needs {w} input and {w} output tensors")
        ins = [t.detach().clone() if t.data_ptr() == o.data_ptr() else t
               for t, o in zip(input_tensors, output_tensors)]
        return self._messages([(r, ins[r]) for r in range(w) if r != me],
                              [(r, output_tensors[r]) for r in range(w) if r != me], output_tensors,
                              (output_tensors[me], ins[me]))

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        _unsupported("monitored_barrier (torch reserves it for gloo)", "use dist.barrier(), which has a "
                     "deadline (SDP_TIMEOUT) and names the ranks that did not arrive")

    def barrier(self, opts=None):
        token = torch.zeros(1, dtype=torch.uint8)
        h = self._submit(COLL_ALLREDUCE, token.data_ptr(), 1, DTYPES["uint8"], OPS["max"], 0)
        return SmddpWork(self, [h], [token], token)

    def shutdown(self) -> None:
        self._completer.put(None)
        self.comm.close()

    def __del__(self):
        try:
            self.comm.close()
        except Exception:  # noqa: BLE001
            pass


def _register_name_carrier(pg: dist.ProcessGroup, rank: int, world_size: int) -> None:
    # torch keeps a group's name (and answers pg.group_name, _resolve_process_group, DeviceMesh)
    # through the group's per-device backend objects, which must be C++ `c10d::Backend`s; that
    # class has no Python constructor. A FakeProcessGroup with error_on_collective carries the
    # name and the device map and refuses any collective that ever reaches it; every operation
    # is overridden on this class, so torch calls ours first.
    from torch._C._distributed_c10d import FakeProcessGroup

    opts = FakeProcessGroup.Options()
    opts.error_on_collective = True
    carrier = FakeProcessGroup._create_internal(rank, world_size, opts)
    for device in ("cpu", "cuda"):
        pg._register_backend(torch.device(device), dist.ProcessGroup.BackendType.CUSTOM, carrier)
    pg._set_default_backend(dist.ProcessGroup.BackendType.CUSTOM)


class _StoreAdapter:
    """c10d store -> the set/get interface of the communicator."""

    def __init__(self, store):
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(key))


def create_process_group(store, rank, world_size, timeout):
    """torch.distributed's creator for "smddp" (also called by sdp_jupyter.torch_plugin, the entry
    point torch loads at `import torch`)."""
    return ProcessGroupSMDDP(store, rank, world_size, timeout)


def register() -> None:
    """Register "smddp" with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(BACKEND_NAME, create_process_group, devices=["cpu", "cuda"])


register()


def init(backend: str | None = None, **kwargs) -> None:
    """`dist.init_process_group` with the job's backend (SDP_BACKEND, default smddp) and env://."""
    backend = backend or os.environ.get("SDP_BACKEND", BACKEND_NAME)
    if not dist.is_initialized():
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing and "init_method" not in kwargs:
            raise RuntimeError(f"sdp_jupyter.torch.init() needs {', '.join(missing)} in the environment: "
                               "start the script with %%sdp_train, sdp-train or torchrun")
        dist.init_process_group(backend, **kwargs)


from sdp_jupyter.torch.ddp import DistributedDataParallel  # noqa: E402

__all__ = ["ProcessGroupSMDDP", "SmddpWork", "SmddpError", "SmddpBackendError", "SmddpUnsupportedError", "DistributedDataParallel", "init", "register",
           "BACKEND_NAME"]
