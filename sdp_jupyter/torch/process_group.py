"""`ProcessGroupSMDDP`: torch.distributed's calls, turned into the communicator's (sdp_jupyter.comm) on
tensor pointers. Routing (shared memory, peer reads, messages) is the communicator's; here are only
torch's signatures, tensor staging and the shape checks torch's users expect."""
from __future__ import annotations

import datetime
import weakref

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from sdp_jupyter.comm import COLLS, DTYPES, OPS, Communicator, SmddpError
from sdp_jupyter.torch.tensors import (Staging, block, dtype_code, moved, op_code, send_buffer, stage_chunk_bytes_from_env,
                                       staged, staged_all)
from sdp_jupyter.torch.compiled import run_eagerly
from sdp_jupyter.torch.work import FutureCompleter, SmddpWork, backend_error, unsupported
from sdp_jupyter._env import env_str

#: the name this backend registers with torch.distributed (init_process_group(backend="smddp"))
BACKEND_NAME = "smddp"
_TORCH_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)
_LIVE: "weakref.WeakSet[ProcessGroupSMDDP]" = weakref.WeakSet()  # this process's groups (reconnect_all)
_GROUPS_MADE: list[str] = []  # the flight recorder names of the groups made so far (default first)
_GENERATION = [0]  # an interactive session's rendezvous generation (set_generation)


class ProcessGroupSMDDP(dist.ProcessGroup):
    """A torch.distributed process group whose collectives run in the native engine."""

    def __init__(self, store, rank: int, world_size: int, timeout: datetime.timedelta):
        super().__init__(rank, world_size)
        self._rank, self._world = rank, world_size
        # SDP_TIMEOUT wins, then an explicit init_process_group(timeout=...); given None the
        # communicator reads SDP_TIMEOUT itself (default 300 s).
        seconds = None
        if not env_str("SDP_TIMEOUT") and timeout is not None and timeout != _TORCH_DEFAULT_TIMEOUT:
            seconds = timeout.total_seconds()
        self._seconds = seconds
        self._store = store  # kept: a reconnect rendezvouses again through it (under a new generation)
        self.comm = self._communicator(store)
        register_name_carrier(self, rank, world_size)
        self._completer = FutureCompleter()
        # how CUDA tensors are staged through host memory (large ones in chunks: tensors.Staging);
        # the tests set staging.chunk_cpu and staging.chunk_bytes to run the chunked path on CPU
        self.staging = Staging(stage_chunk_bytes_from_env())
        _LIVE.add(self)

    def _communicator(self, store) -> Communicator:
        try:
            comm = Communicator(self._rank, self._world, StoreAdapter(store), prefix=rendezvous_prefix(),
                                 timeout=self._seconds, error=backend_error)
        except SmddpError as exc:
            raise backend_error(exc) from None
        # the flight recorder's name for it: torch makes the default group first, then the others in order
        if not hasattr(self, "_flight_name"):
            self._flight_name = "default" if not _GROUPS_MADE else f"group {len(_GROUPS_MADE)}"
            _GROUPS_MADE.append(self._flight_name)
        comm.group_name = self._flight_name
        return comm

    def reconnect(self) -> None:
        """The engine's connections made anew through this group's own store, under the rendezvous
        generation set last (set_generation): what an interactive session does after a cell left a
        collective half done, or when a replaced rank joins. The group object stays, so whatever holds it
        (a DistributedDataParallel model) keeps working. Every member must call it."""
        self.comm = self._communicator(self._store)

    # torch asks for these
    def getBackendName(self) -> str:
        """"smddp" (BACKEND_NAME): the name torch.distributed knows this backend by."""
        return BACKEND_NAME

    def size(self) -> int:
        """The number of ranks in the group."""
        return self._world

    def rank(self) -> int:
        """This process's rank in the group."""
        return self._rank

    # ---- helpers
    def _work(self, work, result) -> SmddpWork:
        return SmddpWork(self._completer, work, result)

    def _allreduce_tensor(self, t: torch.Tensor, op):
        return self._staged_submit(COLLS["all_reduce"], t, op_code(op, t.dtype), 0)

    def _staged_submit(self, coll: int, t: torch.Tensor, op: int, root: int):
        """The engine's collective `coll` in place on t: a contiguous CPU tensor as it is, a large
        CUDA one in chunks through pinned host memory (Staging), any other through one host copy.
        Every rank must take the same branch (chunks are collectives): it depends on the device
        type and the size only."""
        if (not t.is_cpu or self.staging.chunk_cpu) and self.staging.takes(t):
            return self.staging.submit(self.comm, coll, t, dtype_code(t), op, root)
        buf, finish = staged(t)
        return self.comm.submit(coll, buf.data_ptr(), buf.numel(), dtype_code(t), op, root, buf, finish)

    def _joined(self, works, result) -> SmddpWork:
        """One work handle for several (the coalesced variants; one tensor: its own)."""
        return SmddpWork(self._completer, works[0] if len(works) == 1 else self.comm.join(works), result)

    # ---- collectives
    def allreduce(self, tensors, opts=None):
        """dist.all_reduce: reduce each tensor over the group in place (opts.reduceOp, default SUM). A
        sparse tensor is all-gathered and summed as gloo does it (SUM only, done before returning)."""
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        if len(tensors) == 1 and not tensors[0].is_sparse:  # the common case, without the list plumbing
            return SmddpWork(self._completer, self._allreduce_tensor(tensors[0], op), tensors)
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, op)
        return self._joined([self._allreduce_tensor(t, op) for t in tensors], tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        """dist.all_reduce_coalesced: `allreduce` of several tensors, one work for all."""
        return self.allreduce(tensors, opts)

    def _sparse_allreduce(self, tensors, op):
        # As gloo does it: every rank's indices and values are all-gathered and summed, so the
        # result is the same sparse tensor on every rank. Done before returning (blocking).
        if op_code(op, torch.float32) != OPS["sum"]:
            unsupported(f"all_reduce of sparse tensors with {op}", "use ReduceOp.SUM, or reduce `t.to_dense()`")
        for t in tensors:
            if not t.is_sparse:
                raise ValueError("all_reduce of several tensors needs them all sparse or all dense")
            c = t.detach().cpu().coalesce()
            idx, vals = c.indices(), c.values()
            counts = torch.empty(self._world, dtype=torch.int64)
            self._gather_flat(counts, torch.tensor([idx.shape[1]])).wait()
            top = int(counts.max())
            pad_i = torch.zeros((idx.shape[0], top), dtype=idx.dtype)
            pad_i[:, :idx.shape[1]] = idx
            pad_v = torch.zeros((top,) + tuple(vals.shape[1:]), dtype=vals.dtype)
            pad_v[:vals.shape[0]] = vals
            all_i = torch.empty((self._world,) + tuple(pad_i.shape), dtype=idx.dtype)
            all_v = torch.empty((self._world,) + tuple(pad_v.shape), dtype=vals.dtype)
            self.comm.join([self._gather_flat(all_i, pad_i), self._gather_flat(all_v, pad_v)]).wait()
            keep = [slice(0, int(n)) for n in counts]
            total = torch.sparse_coo_tensor(torch.cat([all_i[r][:, k] for r, k in enumerate(keep)], dim=1),
                                            torch.cat([all_v[r][k] for r, k in enumerate(keep)]),
                                            c.shape).coalesce()
            t.copy_(total.to(t.device))
        return self._work(self.comm.done(), tensors)

    def broadcast(self, tensors, opts=None):
        """dist.broadcast: copy rank opts.rootRank's tensors (default 0) into every rank's, in place."""
        root = opts.rootRank if opts is not None else 0
        return self._joined([self._staged_submit(COLLS["broadcast"], t, 0, root) for t in tensors], tensors)

    def reduce(self, tensors, opts=None):
        """dist.reduce: the reduction reaches the root's tensors only; other ranks' tensors are left
        unchanged."""
        root = opts.rootRank if opts is not None else 0
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        works = []
        for t in tensors:
            if self._rank == root:
                works.append(self._allreduce_tensor(t, op))
            else:  # non-root tensors are left as they were: the root's collective on a copy, staged alike
                tmp = t.detach().clone(memory_format=torch.contiguous_format)
                works.append(self._staged_submit(COLLS["all_reduce"], tmp, op_code(op, t.dtype), 0))
        return self._joined(works, tensors)

    def _gather_flat(self, flat: torch.Tensor, inp: torch.Tensor, finish=None):
        """flat (world x n, contiguous CPU) <- every rank's inp: the engine's all_gather, in place on
        world blocks of n elements (this rank's block filled first)."""
        n = inp.numel()
        flat.view(-1)[self._rank * n:(self._rank + 1) * n].copy_(inp.reshape(-1))
        return self.comm.submit(COLLS["all_gather"], flat.data_ptr(), n, dtype_code(inp), 0, 0, flat, finish)

    def allgather(self, output_tensors, input_tensors, opts=None):
        """dist.all_gather: output_tensors[0][r] receives rank r's input tensor."""
        outs, inp = output_tensors[0], input_tensors[0]
        flat = torch.empty((self._world,) + tuple(inp.shape), dtype=inp.dtype)

        def scatter_back():
            for r, o in enumerate(outs):
                o.copy_(flat[r])
        return self._work(self._gather_flat(flat, inp.detach().cpu(), scatter_back), output_tensors)

    def all_gather_single(self, output_tensor, input_tensor, opts=None):
        """dist.all_gather_into_tensor: output_tensor (world size x the input's elements) receives every
        rank's input, in rank order."""
        buf, finish = staged(output_tensor)
        return self._work(self._gather_flat(buf, input_tensor.detach().cpu(), finish), [output_tensor])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        """`all_gather_single` for each (output, input) pair, one work for all (also
        all_gather_single_coalesced)."""
        return self._joined([self.all_gather_single(o, i, opts).comm_work for o, i in zip(outputs, inputs)], outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        """dist.all_gather_coalesced: every rank's input tensors, gathered in one flat all-gather and cut
        into output_lists[r] per rank."""
        # one flat all-gather of the concatenated inputs, then cut per rank and per tensor
        inputs = [i.detach().reshape(-1).cpu() for i in input_tensors]
        cat = torch.cat(inputs) if inputs else torch.empty(0)
        flat = torch.empty((self._world, cat.numel()), dtype=cat.dtype)

        def cut():
            for r, outs in enumerate(output_lists):
                for o, piece in zip(outs, flat[r].split([i.numel() for i in inputs])):
                    o.copy_(piece.view_as(o))
        return self._work(self._gather_flat(flat, cat, cut), output_lists)

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        """dist.reduce_scatter: output_tensors[0] receives this rank's piece of the reduction of
        input_tensors[0] (one tensor per rank)."""
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        out, ins = output_tensors[0], input_tensors[0]
        flat = torch.cat([i.detach().reshape(-1).cpu() for i in ins])
        return self._reduce_scatter_flat(out, flat, op, output_tensors)

    def reduce_scatter_single(self, output_tensor, input_tensor, opts=None):
        """dist.reduce_scatter_tensor: input_tensor holds world size x output_tensor's elements;
        output_tensor receives this rank's block of their reduction."""
        op = opts.reduceOp if opts is not None else ReduceOp.SUM
        flat = input_tensor.detach().reshape(-1).to("cpu", copy=True).contiguous()
        return self._reduce_scatter_flat(output_tensor, flat, op, [output_tensor])

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_flat(self, out, flat, op, result):
        n = out.numel()
        if flat.numel() != n * self._world:
            raise ValueError(f"reduce_scatter input must hold world_size x output = {self._world} x {n} elements")

        def take():
            out.copy_(flat[self._rank * n:(self._rank + 1) * n].view_as(out))
        # the engine's reduce_scatter: in place on world blocks of n, this rank's block reduced
        return self._work(self.comm.submit(COLLS["reduce_scatter"], flat.data_ptr(), n, dtype_code(flat),
                                           op_code(op, flat.dtype), 0, flat, take), result)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        """`reduce_scatter_single` for each (output, input) pair, one work for all (also
        reduce_scatter_single_coalesced)."""
        return self._joined([self.reduce_scatter_single(o, i, opts).comm_work for o, i in zip(outputs, inputs)],
                            outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    # ---- point-to-point messages (the mailbox)
    def send(self, tensors, dst, tag=0):
        """dist.send: send tensors[0] to rank dst with `tag` (matched by that rank's recv with this rank or
        any, and the tag)."""
        buf = send_buffer(tensors[0])
        return self._work(self.comm.messages_work([self.comm.post_send(dst, tag, *block(buf))], buf), tensors)

    def recv(self, tensors, src, tag=0):
        """dist.recv: receive into tensors[0] from rank src (-1: any rank) with `tag`."""
        buf, finish = staged(tensors[0])
        return self._work(self.comm.messages_work([self.comm.post_recv(src, tag, *block(buf))], buf,
                                                  () if finish is None else (finish,)), tensors)

    def recv_anysource(self, tensors, tag=0):
        """dist.recv without a source: `recv` from any rank."""
        return self.recv(tensors, -1, tag)

    # ---- gather, scatter, all_to_all: routed by the communicator (shared memory within a node,
    # messages across nodes)
    def _check_blocks(self, what: str, tensors, like: torch.Tensor) -> None:
        if len(tensors) != self._world:
            raise ValueError(f"{what} needs {self._world} tensors (one per rank), got {len(tensors)}")
        for t in tensors:
            if t.numel() != like.numel() or t.dtype != like.dtype:
                raise ValueError(f"{what}: every tensor must have {like.numel()} elements of {like.dtype} "
                                 f"(got {t.numel()} of {t.dtype})")

    def gather(self, output_lists, input_tensors, opts=None):
        """dist.gather: the root (opts.rootRank, default 0) receives every rank's input_tensors[0] into
        output_lists[0], one tensor per rank."""
        root = opts.rootRank if opts is not None else 0
        src = send_buffer(input_tensors[0])
        outs, finish = [], ()
        if self._rank == root:
            self._check_blocks("gather on the root", output_lists[0], src)
            outs, finish = staged_all(output_lists[0])  # the engine writes straight into each output tensor
        count, code = moved(src)
        return self._work(self.comm.gather_buffers(src.data_ptr(), count, code, root, [o.data_ptr() for o in outs],
                                                   (src, outs), finish), output_lists)

    def scatter(self, output_tensors, input_lists, opts=None):
        """dist.scatter: every rank receives into output_tensors[0] its tensor of the root's input_lists[0]."""
        root = opts.rootRank if opts is not None else 0
        out = output_tensors[0]
        pieces = []
        if self._rank == root:
            self._check_blocks("scatter on the root", input_lists[0], out)
            pieces = [send_buffer(p) for p in input_lists[0]]  # read in place
        buf, finish = staged(out)
        count, code = moved(buf)
        return self._work(self.comm.scatter_buffers(buf.data_ptr(), count, code, root, [p.data_ptr() for p in pieces],
                                                    (buf, pieces), () if finish is None else (finish,)),
                          output_tensors)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """dist.all_to_all_single (also all_to_all_single): piece r of `input` (rows of dim 0, equal or as
        the split sizes say) goes to rank r, and piece r of `output` comes from rank r."""
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
        buf, finish = staged(output)
        src = send_buffer(input)
        finish = () if finish is None else (finish,)
        if not input_split_sizes and not output_split_sizes:
            # equal blocks (no split sizes on any rank: torch passes none when the caller gave
            # none; a rank that gives sizes where another gives none waits for the timeout)
            if src.numel() != buf.numel() or src.dtype != buf.dtype:
                raise ValueError(f"all_to_all_single: input ({src.numel()} x {src.dtype}) and output ({buf.numel()} x "
                                 f"{buf.dtype}) must match")
            count, code = moved(buf)
            return self._work(self.comm.all_to_all_buffers(buf.data_ptr(), src.data_ptr(), count // w, code,
                                                           (buf, src), finish), [output])
        return self._work(self.comm.all_to_all_blocks([block(p) for p in buf.split(s_out)],
                                                      [block(p) for p in src.split(s_in)], (buf, src), finish),
                          [output])

    all_to_all_single = alltoall_base

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """dist.all_to_all: input_tensors[r] goes to rank r, output_tensors[r] comes from rank r (one tensor
        per rank each)."""
        w = self._world
        if len(output_tensors) != w or len(input_tensors) != w:
            raise ValueError(f"all_to_all needs {w} input and {w} output tensors")
        outs, finish = staged_all(output_tensors)
        ins = [send_buffer(t) for t in input_tensors]
        return self._work(self.comm.all_to_all_blocks([block(o) for o in outs], [block(i) for i in ins], (outs, ins),
                                                      finish), output_tensors)

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        """Not supported (torch reserves it for gloo): raises SmddpUnsupportedError, which says to use
        dist.barrier(), whose deadline (SDP_TIMEOUT) names the ranks that did not arrive."""
        unsupported("monitored_barrier (torch reserves it for gloo)", "use dist.barrier(), which has a "
                    "deadline (SDP_TIMEOUT) and names the ranks that did not arrive")

    def barrier(self, opts=None):
        """dist.barrier: done once every rank has reached it (the engine's barrier)."""
        return self._work(self.comm.submit(COLLS["barrier"], 0, 0, DTYPES["uint8"]), [])

    def shutdown(self) -> None:
        """Close the group: stop completing its futures and close its communicator (the engine's
        connections)."""
        self._completer.close()
        self.comm.close()

    def __del__(self):
        try:
            self.comm.close()
        except Exception:  # noqa: BLE001
            pass


def rendezvous_prefix() -> str:
    """Where this group's rendezvous keys go in its store: "sdp", or under torchrun's elastic agent
    (TORCHELASTIC_USE_AGENT_STORE=True) "sdp/attempt-<restart count>-<world size>". That agent hands
    every attempt the same store, so an earlier attempt's keys (signed with an earlier one-host secret,
    or naming ports of dead ranks) are still there. A failure bumps the restart count; between
    failures only nodes joining re-form the group, and they grow the world: the pair names one attempt.
    An interactive session's reconnects add "/gen-<generation>" (set_generation)."""
    if env_str("TORCHELASTIC_USE_AGENT_STORE") != "True":
        base = "sdp"
    else:
        base = f"sdp/attempt-{env_str('TORCHELASTIC_RESTART_COUNT') or '0'}-{env_str('WORLD_SIZE') or '0'}"
    return base if not _GENERATION[0] else f"{base}/gen-{_GENERATION[0]}"


def set_generation(generation: int) -> None:
    """Rendezvous from now on under `generation` (rendezvous_prefix): every member of a group sets the
    same number before it connects, so keys an earlier generation left in the store are never read."""
    _GENERATION[0] = int(generation)


def reconnect_all(generation: int, default_only: bool = False) -> None:
    """Reconnect this process's smddp groups under rendezvous `generation`: all are closed first (a peer
    still waiting in a collective of the old engines gets its error and can join), then made anew in
    the order of their names, the same on every rank. `default_only`: only the default group is made
    again (a replaced rank, new in the group, has no other); the others stay closed, and using one raises."""
    set_generation(generation)
    groups = sorted(_LIVE, key=lambda pg: str(getattr(pg, "group_name", "") or ""))
    for pg in groups:
        try:
            pg.comm.close()
        except Exception:  # noqa: BLE001 - a broken engine is what we are replacing
            pass
    default = dist.distributed_c10d._get_default_group() if default_only else None
    for pg in groups:
        if default is None or pg is default:
            pg.reconnect()


def forget_groups() -> None:
    """Close every smddp group of this process and forget it (reconnect_all will not touch it again): what
    an interactive session does before it makes a group of fewer ranks (a host gone for good). A model that
    still holds an old group raises on its next collective."""
    for pg in list(_LIVE):
        try:
            pg.comm.close()
        except Exception:  # noqa: BLE001 - an engine the loss broke
            pass
    _LIVE.clear()


def register_name_carrier(pg: dist.ProcessGroup, rank: int, world_size: int) -> None:
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


class StoreAdapter:
    """c10d store -> the set/get interface of the communicator."""

    def __init__(self, store):
        self._store = store

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(key))


run_eagerly(ProcessGroupSMDDP, SmddpWork, FutureCompleter)  # torch.compile: never traced (torch/compiled.py)
