"""The job view of a SageMaker job: one output pane per host (its CloudWatch stream), the
SageMaker status and status transitions in the header, FailureReason as the error.

It is the launcher's JobView (sdp_jupyter.ui.jobview) over an adapter whose panes are hosts
instead of ranks; everything else (Stop button -> job.stop -> StopTrainingJob, dashboard button,
bounded redraw) is JobView's own.
"""
from __future__ import annotations

import html

from sdp_jupyter.ui.jobview import JobView


class _HostPanes:
    """The job as JobView sees it: `world_size` panes = hosts; everything else is the job's."""

    def __init__(self, job):
        object.__setattr__(self, "_job", job)

    @property
    def world_size(self) -> int:
        return self._job.hosts

    def __getattr__(self, name):
        return getattr(self._job, name)


def host_title(job, host: int) -> str:
    per_node = job.spec.procs_per_node or 1
    first = host * per_node
    ranks = f"rank {first}" if per_node == 1 else f"ranks {first}-{first + per_node - 1}"
    return f"algo-{host + 1} ({ranks})"


class SageMakerJobView(JobView):
    def __init__(self, job):
        self.sagemaker_job = job
        super().__init__(_HostPanes(job))
        self._titles()

    def _titles(self) -> None:
        for h in range(self.sagemaker_job.hosts):
            closed = "" if h in self._live else " (opens its log)"
            self.ranks.set_title(h, host_title(self.sagemaker_job, h) + closed)

    def _on_open_rank(self, change) -> None:
        super()._on_open_rank(change)
        self._titles()

    def _redraw(self) -> None:
        super()._redraw()
        sm = self.sagemaker_job.sagemaker
        status = " / ".join(s for s in (sm.get("status"), sm.get("secondary_status")) if s) or "creating"
        last = (sm.get("transitions") or [{}])[-1].get("message") or ""
        where = "Rehearsal on this machine (not AWS) of SageMaker" if sm.get("rehearsal") else "SageMaker"
        engine = self.sagemaker_job.engine
        self.header.value += (
            f"<br><span style='font-size:90%'>{where} <code>{html.escape(str(sm.get('training_job_name')))}</code>"
            f" · {html.escape(str(sm.get('instance_type')))} · <b>{html.escape(status)}</b>"
            f"{' · ' + html.escape(last) if last else ''}"
            f"{'<br>' + html.escape(engine) if engine else ''}</span>")
