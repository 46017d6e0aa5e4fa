"""The engine's own DistributedDataParallel: gradients are reduced while backward still runs.

    from sdp_jupyter.torch import DistributedDataParallel as DDP
    model = DDP(model)                   # after dist.init_process_group("smddp")

How it works. Parameters are laid out, in the reverse of their registration order (roughly the
order backward produces their gradients), in per-dtype fusion buffers of at most
`fusion_threshold` bytes, allocated once. Each parameter's `.grad` becomes a view into its buffer,
so autograd accumulates straight into the buffer and nothing is copied back at the end. When the
last gradient of a buffer is ready (a post-accumulate-grad hook), the buffer is handed to the
engine's progress thread as an asynchronous all-reduce (AVG on smddp, so the division happens
inside the engine's final copy), in buffer order on every rank, while backward goes on. At the end
of backward one callback waits for the buffers still in flight: only that wait is exposed
communication. 16-bit gradients stay 16-bit on the wire and are summed in float32.

Works with any process group (gloo too, for comparison); with smddp it uses the engine directly.
"""
from __future__ import annotations

import contextlib

from sdp_jupyter._env import env_int, env_str
import time
from typing import Iterator

import torch
import torch.distributed as dist

DEFAULT_FUSION_THRESHOLD = 4 << 20  # bytes; the sweep behind it is in docs/benchmarks.md (section 5)
FIRST_BUCKET_BYTES = 1 << 20        # a small first buffer starts communication early


def fusion_threshold_from_env(default: int = DEFAULT_FUSION_THRESHOLD) -> int:
    """SDP_FUSION_THRESHOLD in bytes (a whole number, at least 1024)."""
    return env_int("SDP_FUSION_THRESHOLD", default, min=1024)


class _Bucket:
    def __init__(self, index: int, params: list[torch.nn.Parameter], dtype: torch.dtype):
        self.index = index
        self.params = params
        self.dtype = dtype
        numel = sum(p.numel() for p in params)
        self.flat = torch.zeros(numel, dtype=dtype)
        self.views: dict[int, torch.Tensor] = {}
        off = 0
        for p in params:
            self.views[id(p)] = self.flat[off:off + p.numel()].view_as(p)
            off += p.numel()
        self.pending = len(params)
        self.work = None
        self.ready_params: set[int] = set()

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class DistributedDataParallel(torch.nn.Module):
    """Data-parallel wrapper over the smddp engine (or any process group).

    fusion_threshold: bytes per fusion buffer (default SDP_FUSION_THRESHOLD or 4 MiB).
    broadcast_buffers: broadcast module buffers (BatchNorm statistics) from rank 0 every forward.
    find_unused_parameters: allow parameters that get no gradient in a step (one extra small
    all-reduce per step finds the globally unused ones, whose .grad then stays None).
    process_group: the group to reduce over (default: the default group).
    batch_size: samples per step on this rank, for the automatic samples/s metric.
    report_metrics: write a "step" metrics line per synced step (its timings, and samples with
    batch_size) when running in a job (SDP_JOB_DIR set); False writes none.

    Parameters must live on the CPU (ValueError otherwise): for a CUDA model use torch's own
    DistributedDataParallel with the smddp backend.
    """

    def __init__(self, module: torch.nn.Module, process_group=None, fusion_threshold: int | None = None,
                 broadcast_buffers: bool = True, find_unused_parameters: bool = False,
                 batch_size: int | None = None, report_metrics: bool = True):
        super().__init__()
        if not dist.is_initialized():
            raise RuntimeError("call dist.init_process_group('smddp') (or sdp_jupyter.torch.init()) before "
                               "wrapping the model in DistributedDataParallel")
        self.module = module
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.fusion_threshold = fusion_threshold or fusion_threshold_from_env()
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters
        self.batch_size = batch_size
        self.report_metrics = report_metrics
        self._sync = True
        self._native_avg = dist.get_backend(process_group) == "smddp"
        self.params = [p for p in module.parameters() if p.requires_grad]
        for p in self.params:
            if p.device.type != "cpu":
                raise ValueError("sdp_jupyter.torch.DistributedDataParallel reduces CPU-resident gradients; "
                                 "for CUDA models use stock torch DDP with the smddp backend")
        self._sync_module_state()
        self.buckets = self._build_buckets()
        self._bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self._next_launch = 0
        self._callback_queued = False
        self._step_t0 = None
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]
        self.last_step: dict = {}

    # ---- construction
    def _sync_module_state(self) -> None:
        """Every rank starts from rank 0's parameters and buffers (one coalesced broadcast per dtype)."""
        tensors = [p.data for p in self.module.parameters()] + [b for b in self.module.buffers()]
        self._broadcast_coalesced(tensors)

    def _broadcast_coalesced(self, tensors: list[torch.Tensor]) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, ts in by_dtype.items():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            dist.broadcast(flat, src=dist.get_global_rank(self.process_group, 0) if self.process_group else 0,
                           group=self.process_group)
            off = 0
            with torch.no_grad():
                for t in ts:
                    t.copy_(flat[off:off + t.numel()].view_as(t))
                    off += t.numel()

    def _build_buckets(self) -> list[_Bucket]:
        buckets: list[_Bucket] = []
        current: dict[torch.dtype, list] = {}
        sizes: dict[torch.dtype, int] = {}
        for p in reversed(self.params):
            cap = min(FIRST_BUCKET_BYTES, self.fusion_threshold) if not buckets else self.fusion_threshold
            lst = current.setdefault(p.dtype, [])
            nbytes = p.numel() * p.element_size()
            if lst and sizes[p.dtype] + nbytes > cap:
                buckets.append(_Bucket(len(buckets), lst, p.dtype))
                current[p.dtype] = lst = []
                sizes[p.dtype] = 0
            lst.append(p)
            sizes[p.dtype] = sizes.get(p.dtype, 0) + nbytes
        for dtype, lst in current.items():
            if lst:
                buckets.append(_Bucket(len(buckets), lst, dtype))
        return buckets

    # ---- forward
    def forward(self, *args, **kwargs):
        """The wrapped module's forward. Before it, with broadcast_buffers and outside `no_sync`, rank
        0's buffers (BatchNorm statistics) are broadcast to every rank; the step's timer starts."""
        if self.broadcast_buffers and self._sync:
            bufs = list(self.module.buffers())
            if bufs:
                self._broadcast_coalesced(bufs)
        self._step_t0 = time.perf_counter()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (gradient accumulation); the next synced backward reduces the sum."""
        old = self._sync
        self._sync = False
        try:
            yield
        finally:
            self._sync = old

    # ---- backward
    def _on_grad_ready(self, p: torch.nn.Parameter) -> None:
        b = self._bucket_of[id(p)]
        view = b.views[id(p)]
        if p.grad is not view:
            # First step, or zero_grad(set_to_none=True): put the gradient into the buffer once and
            # make .grad a view of it, so later steps accumulate in place.
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad)
            p.grad = view
        if not self._sync:
            return
        if not self._callback_queued:
            self._callback_queued = True
            self._backward_t0 = time.perf_counter()
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if id(p) not in b.ready_params:
            b.ready_params.add(id(p))
            b.pending -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        # Launch strictly in buffer order so every rank issues the same collectives in the same order.
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].pending == 0:
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, b: _Bucket) -> None:
        op = dist.ReduceOp.AVG if self._native_avg else dist.ReduceOp.SUM
        b.launched_at = time.perf_counter()
        b.work = dist.all_reduce(b.flat, op=op, group=self.process_group, async_op=True)

    def _finish_backward(self) -> None:
        t_end_backward = time.perf_counter()
        unused: set[int] = set()
        if any(b.pending for b in self.buckets):
            if not self.find_unused_parameters:
                missing = [n for n, p in self.module.named_parameters()
                           if p.requires_grad and id(p) not in self._bucket_of[id(p)].ready_params]
                self._reset()
                raise RuntimeError(
                    f"{len(missing)} parameter(s) got no gradient this step (e.g. {', '.join(missing[:3])}); "
                    "pass find_unused_parameters=True to DistributedDataParallel")
            for b in self.buckets:
                for p in b.params:
                    if id(p) not in b.ready_params:
                        b.views[id(p)].zero_()
                        unused.add(id(p))
                b.pending = 0
            self._launch_ready()
        if self.find_unused_parameters:
            # One small all-reduce finds which parameters no rank used: their .grad stays None.
            used = torch.tensor([0 if id(p) in unused else 1 for p in self.params], dtype=torch.uint8)
            dist.all_reduce(used, op=dist.ReduceOp.MAX, group=self.process_group)
        t0 = time.perf_counter()
        for b in self.buckets:
            b.work.wait()
        t_done = time.perf_counter()
        if not self._native_avg:
            for b in self.buckets:
                b.flat.div_(self.world_size)
        if self.find_unused_parameters:
            for p, u in zip(self.params, used.tolist()):
                if u == 0:
                    p.grad = None
                elif id(p) in unused:
                    p.grad = self._bucket_of[id(p)].views[id(p)]
        first = min((b.launched_at for b in self.buckets), default=t0)
        self.last_step = {
            "backward_time": t_end_backward - self._backward_t0,
            "comm_time": t_done - first,            # first launch to last completion
            "exposed_comm": t_done - t0,            # what backward could not hide
            "bytes_reduced": sum(b.nbytes for b in self.buckets),
        }
        if self._step_t0 is not None:
            self.last_step["step_time"] = t_done - self._step_t0
        if self.report_metrics and env_str("SDP_JOB_DIR"):
            fields = dict(self.last_step)
            if self.batch_size:
                fields["samples"] = self.batch_size
            from sdp_jupyter.monitor.reporter import emit
            emit("step", **fields)
        self._reset()

    def _reset(self) -> None:
        for b in self.buckets:
            b.pending = len(b.params)
            b.ready_params.clear()
            b.work = None
        self._next_launch = 0
        self._callback_queued = False

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)
