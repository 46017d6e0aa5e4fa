"""Worker-side reporter, per-node system sampler, and the kernel-side reader of job metrics.

Worker side: `report(step=..., samples=..., loss=...)`, `timed(iterable)` (data wait per step).
Kernel side: `sdp_jupyter.monitor.reader` (events in, frames out). See docs/monitoring.md.
"""
from sdp_jupyter.monitor.reporter import report, timed

__all__ = ["report", "timed"]
