"""Tensors to what sdp_jupyter.comm takes: dtype and op codes, and buffers the engine can work on in
place (contiguous, on the CPU; CUDA tensors are staged through pinned host memory, the large ones in
chunks: `Staging`)."""
from __future__ import annotations

import functools

import torch
from torch.distributed import ReduceOp

from sdp_jupyter._env import env_int
from sdp_jupyter.comm import DTYPES, OPS
from sdp_jupyter.torch.work import unsupported

# The engine's codes come from sdp_jupyter.comm (one table); torch's names map onto them by name.
DTYPE_CODES = {getattr(torch, name): code for name, code in DTYPES.items()}
DTYPE_CODES[torch.bool] = DTYPES["uint8"]  # reduced as bytes, with logical ops (see op_code)
_OPS = {getattr(ReduceOp, name.upper()): code for name, code in OPS.items()}
_OP_TYPES = {getattr(ReduceOp.RedOpType, name.upper()): code for name, code in OPS.items()}
_LOGICAL = {OPS["sum"]: OPS["max"], OPS["product"]: OPS["min"]}  # bool: SUM is OR, PRODUCT is AND
_AVG = OPS["avg"]


def op_code(op, dtype) -> int:
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


def dtype_code(t: torch.Tensor) -> int:
    code = DTYPE_CODES.get(t.dtype)
    if code is None:
        raise TypeError(f"smddp cannot reduce {t.dtype} tensors; supported: "
                        + ", ".join(str(d).replace("torch.", "") for d in DTYPE_CODES))
    return code


def moved(t: torch.Tensor) -> tuple[int, int]:
    """(count, dtype code) of a tensor that gather, scatter or all_to_all only move: any dtype
    (one the engine has no code for travels as its bytes)."""
    code = DTYPE_CODES.get(t.dtype)
    return (t.numel(), code) if code is not None else (t.numel() * t.element_size(), DTYPES["uint8"])


def block(t: torch.Tensor) -> tuple[int, int]:
    """(pointer, bytes) of a contiguous CPU tensor."""
    return t.data_ptr(), t.numel() * t.element_size()


def staged(t: torch.Tensor):
    """(buffer the engine works on in place, copy-back callable or None): no object at all for
    the common case of a contiguous CPU tensor (t.is_cpu: 0.27 us with is_contiguous(), t.device.type 0.46)."""
    if t.is_cpu and t.is_contiguous():
        return t, None
    s = _Staged(t)
    return s.buf, s.finish


class _Staged:
    """A tensor the engine can work on in place: contiguous, on the CPU. Copies back at the end."""

    def __init__(self, t: torch.Tensor):
        self.orig = t
        if t.is_cpu:
            self.buf = t.contiguous()
        else:  # CUDA (or another device): through pinned host memory
            self.buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
            self.buf.copy_(t)

    def finish(self) -> None:
        if self.buf is not self.orig:
            self.orig.copy_(self.buf)


def staged_all(tensors) -> tuple[list[torch.Tensor], list]:
    """staged() of each: the buffers and their copy-back steps."""
    bufs, finish = [], []
    for t in tensors:
        if t.is_cpu and t.is_contiguous():
            bufs.append(t)
        else:
            s = _Staged(t)
            bufs.append(s.buf)
            finish.append(s.finish)
    return bufs, finish


def send_buffer(t: torch.Tensor) -> torch.Tensor:
    """What a message or a block that is only read is sent from: the tensor itself when it is a
    contiguous CPU tensor, else a contiguous CPU copy."""
    if t.is_sparse:
        unsupported("send/recv of sparse tensors", "send t.indices() and t.values() as two messages")
    if t.is_cpu and t.is_contiguous():
        return t  # only its memory is read: no detach() (a new tensor object per call)
    return t.detach().to("cpu").contiguous()


DEFAULT_STAGE_CHUNK_BYTES = 4 << 20


def stage_chunk_bytes_from_env(default: int = DEFAULT_STAGE_CHUNK_BYTES) -> int:
    """SDP_STAGE_CHUNK_BYTES: bytes per chunk when a CUDA tensor is staged through host memory (at least 4096)."""
    return env_int("SDP_STAGE_CHUNK_BYTES", default, min=4096)


class Staging:
    """How a process group stages the tensors of all_reduce (and reduce on its root) and broadcast that
    the engine cannot work on in place.

    A CUDA tensor of more than `chunk_bytes` goes in chunks (`takes`, `submit`): every chunk's
    device-to-host copy is queued at once on a side stream, each chunk is handed to the engine as its
    own collective as soon as its copy is done (an event), and copied back on a second side stream as
    soon as the engine has finished it. So chunk k+1 crosses to the host while the engine reduces
    chunk k and chunk k-1 goes back to the GPU. A smaller one is staged whole (`staged`). Whether a
    tensor is chunked depends only on its device type and its size, never on its strides (a
    non-contiguous one is chunked from a contiguous copy on its device), so every rank splits one
    collective alike. `chunk_cpu` sends CPU tensors through the chunked path as well, with plain
    copies in place of the streams: copies the engine does not need, there only so that tests without
    a GPU run the chunked path (every rank must set it alike, as chunk_bytes)."""

    def __init__(self, chunk_bytes: int, chunk_cpu: bool = False):
        self.chunk_bytes = chunk_bytes
        self.chunk_cpu = chunk_cpu
        self._streams: dict = {}  # CUDA device index -> (device-to-host, host-to-device) side streams

    def takes(self, t: torch.Tensor) -> bool:
        """Whether `t` goes through the chunked path (the caller checked `t.is_cpu` and `chunk_cpu` first)."""
        return (t.is_cuda or self.chunk_cpu and t.is_cpu) and t.numel() * t.element_size() > self.chunk_bytes

    def submit(self, comm, coll: int, t: torch.Tensor, dtype: int, op: int, root: int):
        """One collective on `t`, in place, as one engine collective per chunk of a host copy; returns
        the communicator's Work, whose wait() copies back what is left and waits for the copies."""
        orig = t.detach()
        into = None if orig.is_contiguous() else orig  # else chunked from a contiguous copy, copied into it
        flat = orig.view(-1) if into is None else orig.contiguous().view(-1)
        n, size = flat.numel(), flat.element_size()
        step = max(1, self.chunk_bytes // size)
        bounds = [(a, min(a + step, n)) for a in range(0, n, step)]
        host = torch.empty(n, dtype=t.dtype, pin_memory=t.is_cuda)
        copies = _CudaCopies(flat, host, bounds, into, self._side_streams(t.device)) if t.is_cuda \
            else _Copies(flat, host, bounds, into)
        ptr, handles = host.data_ptr(), []
        try:
            for k, (a, b) in enumerate(bounds):
                copies.host_ready(k)
                handles.append(comm.submit_handle(coll, ptr + a * size, b - a, dtype, op, root))
                copies.back_done(comm.finished, handles)  # chunks the engine already finished: back now
        except BaseException:
            # nothing may be freed while the engine still works on a chunk that was submitted
            try:
                comm.handles_work(handles).wait()
            except Exception:  # noqa: BLE001 - the first error is the one raised
                pass
            raise
        return comm.handles_work(handles, (t, host, copies), (copies.finish,),
                                 tuple(functools.partial(copies.back_through, k) for k in range(len(bounds))))

    def _side_streams(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        streams = self._streams.get(index)
        if streams is None:
            streams = self._streams[index] = (torch.cuda.Stream(index), torch.cuda.Stream(index))
        return streams


class _Copies:
    """A tensor's chunks to a host buffer and back. These are plain copies in the calling thread
    (CPU tensors, for the tests); `_CudaCopies` queues them on side streams."""

    def __init__(self, flat: torch.Tensor, host: torch.Tensor, bounds: list[tuple[int, int]], into=None):
        self.flat, self.host, self.bounds = flat, host, bounds
        self.into = into  # a non-contiguous tensor: flat is its contiguous copy, copied into it at the end
        self.back = 0  # chunks copied back so far (in order: the engine finishes them in order)

    def host_ready(self, k: int) -> None:
        """Returns once chunk k is in the host buffer."""
        a, b = self.bounds[k]
        self.host[a:b].copy_(self.flat[a:b])

    def to_device(self, k: int) -> None:
        a, b = self.bounds[k]
        self.flat[a:b].copy_(self.host[a:b])

    def back_through(self, k: int) -> None:
        """Copies back every chunk up to k not copied yet (k is done in the engine)."""
        while self.back <= k:
            self.to_device(self.back)
            self.back += 1

    def back_done(self, finished, handles: list[int]) -> None:
        """Copies back the chunks whose engine handle is already done, without waiting."""
        while self.back < len(handles) and finished(handles[self.back]):
            self.to_device(self.back)
            self.back += 1

    def finish(self) -> None:
        """After the last chunk's copy back: the tensor holds the result."""
        if self.into is not None:
            self.into.copy_(self.flat.view(self.into.shape))


class _CudaCopies(_Copies):
    """Every chunk's device-to-host copy queued at once on one side stream (after the work already
    queued on the tensor's current stream), an event each; copies back on another side stream, so
    both directions move at once."""

    def __init__(self, flat, host, bounds, into, streams):
        super().__init__(flat, host, bounds, into)
        self.d2h, self.h2d = streams
        self.d2h.wait_stream(torch.cuda.current_stream(flat.device))
        # the tensor's memory is not reused before the side streams are done with it (after an error, too)
        flat.record_stream(self.d2h)
        flat.record_stream(self.h2d)
        self.ready = []
        with torch.cuda.stream(self.d2h):
            for a, b in bounds:
                host[a:b].copy_(flat[a:b], non_blocking=True)
                self.ready.append(self.d2h.record_event())

    def host_ready(self, k: int) -> None:
        self.ready[k].synchronize()  # the GIL released

    def to_device(self, k: int) -> None:
        a, b = self.bounds[k]
        with torch.cuda.stream(self.h2d):
            self.flat[a:b].copy_(self.host[a:b], non_blocking=True)

    def finish(self) -> None:
        # the last copy back is done before wait() returns, as a blocking copy would be: the tensor
        # can be read on any stream afterwards, and the host buffer is free
        with torch.cuda.stream(self.h2d):
            super().finish()
        self.h2d.record_event().synchronize()
