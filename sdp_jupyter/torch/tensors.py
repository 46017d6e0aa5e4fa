"""Tensors to what sdp_jupyter.comm takes: dtype and op codes, and buffers the engine can work on in
place (contiguous, on the CPU; CUDA tensors are staged through pinned host memory)."""
from __future__ import annotations

import torch
from torch.distributed import ReduceOp

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
