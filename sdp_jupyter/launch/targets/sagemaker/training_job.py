"""SageMakerJob: a SageMaker training job seen through its job directory, and SageMakerRun, the
background poller that mirrors DescribeTrainingJob, CloudWatch Logs and metrics into it."""
from __future__ import annotations

import tarfile
import threading
import time
from pathlib import Path
from typing import Any

from sdp_jupyter import jobdir
from sdp_jupyter.instances import host_counts
from sdp_jupyter.launch.kernel.job import Job, JobError
from sdp_jupyter.launch.targets.sagemaker.aws import boto_session
from sdp_jupyter.launch.targets.sagemaker.options import DEFAULT_POLL_INTERVAL, METRICS_POLL_INTERVAL, REQUEST_FILE


_FINAL_STATES = {"Completed": "succeeded", "Failed": "failed", "Stopped": "stopped"}
_STARTING = {"Starting", "Pending", "Downloading", "LaunchingMLInstances", "PreparingTrainingStack",
             "DownloadingTrainingImage"}


def job_state(status: str | None, secondary: str | None) -> str:
    """Our state for a (TrainingJobStatus, SecondaryStatus) pair."""
    if status in _FINAL_STATES:
        return _FINAL_STATES[status]
    if status == "InProgress" and (secondary is None or secondary in _STARTING):
        return "pending"
    return "running"


#: the line the container entry prints once the smddp backend is loaded (entry.load_smddp)
ENGINE_LINE = "[sdp_jupyter] smddp engine: "


def engine_line(sm: dict) -> str | None:
    """'smddp engine: ...' for a job's status.json `sagemaker` facts: the engine the hosts reported
    (their log line), else the one planned; None for gloo/nccl jobs."""
    from sdp_jupyter.instances import ENGINE_NAMES

    planned = sm.get("engine")
    if not planned:
        return None
    ran = sm.get("engine_ran")
    if ran:
        return f"smddp engine: {ran} (reported by the hosts)"
    return f"smddp engine: {ENGINE_NAMES.get(planned, planned)} (planned; the hosts have not reported yet)"


class SageMakerJob(Job):
    """A SageMaker training job seen through its job directory. Output is per host: `logs(i)` is
    host algo-(i+1)'s CloudWatch stream (all of its ranks)."""

    @classmethod
    def open(cls, name_or_dir, root=None, mirror: bool = False) -> "SageMakerJob":
        """Reopen from the job directory; with mirror, keep following the remote job if it still runs."""
        job = super().open(name_or_dir, root)  # Job.open builds a cls (it dispatches only for Job itself)
        if mirror:
            job.mirror()
        return job

    # ---------------------------------------------------------------- facts
    @property
    def sagemaker(self) -> dict:
        return dict(self.status.get("sagemaker") or {})

    @property
    def training_job_name(self) -> str | None:
        return self.sagemaker.get("training_job_name")

    @property
    def hosts(self) -> int:
        return self.spec.nodes

    @property
    def engine(self) -> str | None:
        """Who serves --backend smddp, as the hosts reported it, else as planned (engine_line);
        None for gloo/nccl jobs."""
        return engine_line(self.sagemaker)

    @property
    def request(self) -> dict | None:
        """The CreateTrainingJob request as it was sent."""
        return jobdir.read_json(self.dir / REQUEST_FILE)

    @property
    def rehearsal(self) -> dict | None:
        """What a rehearsal (--rehearse) checked and ran; None for a job on AWS."""
        return self.sagemaker.get("rehearsal")

    def _boto(self):
        if self.rehearsal:  # the local stand-in that played AWS, never AWS itself
            from sdp_jupyter.testing.sagemaker_standin import MotoAWS

            return MotoAWS(endpoint=self.rehearsal["endpoint"], env={})
        return boto_session(self.sagemaker.get("region"))

    # ---------------------------------------------------------------- following the remote job
    def mirror(self) -> None:
        """Mirror the remote job into the job directory from a background thread until it ends."""
        if self.supervisor is None and not self.done and self.training_job_name:
            self.supervisor = SageMakerRun(self)
            self.supervisor.start()

    def describe(self) -> dict:
        return self._boto().client("sagemaker").describe_training_job(TrainingJobName=self.training_job_name)

    # ---------------------------------------------------------------- control
    def stop(self, wait: bool = True) -> str:
        """StopTrainingJob; with wait, block until SageMaker reports the job Stopped."""
        if self.done:
            return self.state
        if not self.training_job_name:
            raise JobError(f"job {self.name} has no SageMaker training job to stop")
        client = self._boto().client("sagemaker")
        try:
            client.stop_training_job(TrainingJobName=self.training_job_name)
        except client.exceptions.ClientError as e:
            # already stopping or ended between our last poll and now: the poller will see it
            if "status" not in str(e).lower():
                raise JobError(f"job {self.name}: StopTrainingJob failed: {e}", self) from e
        self.update_status(stop_requested=time.time())
        if self.supervisor is None:
            self.mirror()
        if wait:
            self.wait()
        return self.state

    # ---------------------------------------------------------------- outputs
    def logs(self, rank: int = 0, tail: int | None = None) -> str:
        """Host `rank`'s log (host algo-(rank+1), all its ranks); the last `tail` lines if given."""
        host = int(rank)
        if not 0 <= host < self.hosts:
            raise JobError(f"host {host} does not exist: job {self.name} has hosts 0..{self.hosts - 1} "
                           f"(algo-1..algo-{self.hosts})")
        try:
            text = jobdir.host_log_path(self.dir, host).read_text(errors="replace")
        except FileNotFoundError:
            return ""
        if tail is not None:
            lines = text.splitlines(keepends=True)
            text = "".join(lines[-int(tail):]) if int(tail) > 0 else ""
        return text

    def subscribe(self, listener) -> dict[int, list[str]]:
        with self._lock:
            self._listeners.append(listener)
            snapshot = {host: list(lines) for host, lines in self._tails.items()}
        if not snapshot:
            snapshot = {h: self.logs(h, tail=2000).splitlines(keepends=True) for h in range(self.hosts)}
        return snapshot

    def result(self):
        """Rank 0's result: fetched from the job's output.tar.gz (sdp_job/result.pkl) when needed."""
        if not (self.dir / jobdir.RESULT).is_file() and self.state == "succeeded":
            self.fetch_output()
        return super().result()

    def fetch_output(self) -> Path:
        """Download output.tar.gz and unpack its sdp_job/ into the job directory (result, metrics)."""
        desc = self.describe()
        root = desc["OutputDataConfig"]["S3OutputPath"].rstrip("/")
        uri = f"{root}/{self.training_job_name}/output/output.tar.gz"
        bucket, _, key = uri[len("s3://"):].partition("/")
        target = self.dir / jobdir.OUTPUT / "output.tar.gz"
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._boto().client("s3").download_file(bucket, key, str(target))
        except Exception as e:
            raise JobError(f"job {self.name}: cannot fetch {uri}: {e}", self) from e
        mirror = jobdir.Mirror()
        with tarfile.open(target) as tar:
            for member in tar.getmembers():
                parts = Path(member.name).parts
                if not member.isfile() or len(parts) < 2 or parts[0] != jobdir.CONTAINER_JOB_DIR or ".." in parts:
                    continue
                dest = self.dir.joinpath(*parts[1:])
                if dest.parent.name == jobdir.METRICS and dest.exists():
                    continue  # the mirror from the log lines is already there
                with tar.extractfile(member) as src:
                    mirror.replace(dest, src)
        return target

    def view(self):
        from sdp_jupyter.ui.sagemaker_view import SageMakerJobView

        return SageMakerJobView(self)

    def summary(self, error: bool = True) -> str:
        """Job.summary, then the SageMaker job, the engine it used and, for a rehearsal, what it did not check."""
        sm = self.sagemaker
        line = super().summary(error)
        extra = (f"\nSageMaker: {sm.get('training_job_name')} in {sm.get('region')}, "
                 f"{self.spec.nodes} x {sm.get('instance_type')}, status {sm.get('status', '?')}"
                 f"/{sm.get('secondary_status', '?')}")
        engine = self.engine
        if engine:
            extra += f"\n{engine}"
        if self.rehearsal:
            from sdp_jupyter.launch.targets.sagemaker.rehearse import describe

            extra += "\n" + describe(self.rehearsal)
        return line + extra


class SageMakerRun:
    """Background poller of one SageMaker job: DescribeTrainingJob, CloudWatch Logs and metrics,
    mirrored into the job directory and the job's views."""

    def __init__(self, job: SageMakerJob):
        self.job = job
        self.world_size = job.world_size
        self.interval = float(job.sagemaker.get("poll_interval") or DEFAULT_POLL_INTERVAL)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"sdp-sagemaker-{job.name}", daemon=True)
        self._mirror = jobdir.Mirror()  # host logs and metrics, written into the job directory
        self._last_t: dict = {}
        self.errors = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.job.stop(wait=False)

    def close(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- loop
    def _loop(self) -> None:
        from sdp_jupyter.monitor.cloudwatch import LINE_PREFIX, HostMetrics, LogFollower, parse_log_line

        job = self.job
        sm = job.sagemaker
        self._parse, self._prefix = parse_log_line, LINE_PREFIX.strip()
        client = logs = metrics = None
        next_metrics = 0.0
        try:
            while not self._stop.is_set():
                try:
                    if client is None:
                        # Set up inside the retried block: a failure here (the network, or boto
                        # reading os.environ while another thread changes it, as a rehearsal's
                        # submit does) is retried like a poll, never a dead poller and a job
                        # left pending for good.
                        boto = job._boto()
                        client = boto.client("sagemaker")
                        logs = LogFollower(job.training_job_name, session=boto)
                        metrics = HostMetrics(job.training_job_name, job.hosts, sm.get("instance_type"),
                                              session=boto, start=job.status.get("created"))
                        metrics.counts = host_counts(sm.get("instance_type") or "", sm.get("region")) or metrics.counts
                    desc = client.describe_training_job(TrainingJobName=job.training_job_name)
                    final = desc.get("TrainingJobStatus") in _FINAL_STATES
                    self._lines(logs.poll())
                    if final or time.monotonic() >= next_metrics:
                        self._system(metrics.poll(final=final))
                        next_metrics = time.monotonic() + max(self.interval, METRICS_POLL_INTERVAL)
                    if final:
                        time.sleep(min(self.interval, 5.0))  # CloudWatch lags the status a little
                        self._lines(logs.poll())
                    self._status(desc)
                    self.errors = 0
                    if final:
                        return
                except Exception as e:  # throttling, network: the remote job is not affected
                    self.errors += 1
                    job.update_status(sagemaker=dict(job.sagemaker, poll_error=f"{type(e).__name__}: {e}"))
                self._stop.wait(self.interval * min(2 ** self.errors, 30))
        finally:
            self._mirror.close()
            if job.supervisor is self:
                job.supervisor = None

    def _lines(self, lines) -> None:
        for host, text, t in lines:
            text = text.rstrip("\n")
            self._mirror.append(jobdir.host_log_path(self.job.dir, host), text + "\n", flush=False)
            self.job.emit_output(host, text + "\n")
            if ENGINE_LINE in text and not self.job.sagemaker.get("engine_ran"):
                ran = text.split(ENGINE_LINE, 1)[1].strip()
                self.job.update_status(sagemaker=dict(self.job.sagemaker, engine_ran=ran))
            if self._prefix in text:
                ev = self._parse(text, host, t)
                if ev is not None:
                    self._mirror.append_record(jobdir.rank_metrics_path(self.job.dir, ev.get("rank", host)), ev,
                                               flush=False)
        self._mirror.flush()

    def _system(self, events) -> None:
        for ev in events:
            self._mirror.append_record(jobdir.node_metrics_path(self.job.dir, ev["node"]), ev, flush=False)
        self._mirror.flush()

    def _status(self, desc: dict) -> None:
        job = self.job
        status, secondary = desc.get("TrainingJobStatus"), desc.get("SecondaryStatus")
        sm = job.sagemaker
        transitions = [{"status": t.get("Status"), "message": t.get("StatusMessage"),
                        "start": _ts(t.get("StartTime")), "end": _ts(t.get("EndTime"))}
                       for t in desc.get("SecondaryStatusTransitions") or []]
        seen = len(sm.get("transitions") or [])
        for t in transitions[seen:]:
            job.emit_output(0, f"[sagemaker] {t['status']}: {t['message'] or ''}\n")
        changes = {"status": status, "secondary_status": secondary, "transitions": transitions,
                   "failure_reason": desc.get("FailureReason"), "arn": desc.get("TrainingJobArn"),
                   "billable_seconds": desc.get("BillableTimeInSeconds"), "poll_error": None}
        if sm.get("status") == status and sm.get("secondary_status") == secondary \
                and len(transitions) == seen and not sm.get("poll_error"):
            return
        fields: dict[str, Any] = {"sagemaker": dict(sm, **changes)}
        state = job_state(status, secondary)
        fields["state"] = state
        if state != "pending" and not job.status.get("started"):
            fields["started"] = _ts(desc.get("TrainingStartTime")) or time.time()
        if state in jobdir.FINAL_STATES:
            fields["ended"] = _ts(desc.get("TrainingEndTime")) or time.time()
            if state == "failed":
                fields["error"] = desc.get("FailureReason") or "the training job failed (no reason given)"
            elif state == "stopped":
                fields["error"] = "stopped (StopTrainingJob)"
        job.update_status(**fields)


def _ts(value) -> float | None:
    if value is None:
        return None
    if hasattr(value, "timestamp"):
        return value.timestamp()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
