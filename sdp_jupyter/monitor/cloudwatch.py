"""A SageMaker training job's metrics and output, read from CloudWatch (a `MetricsSource`).

Where SageMaker puts things (docs/sagemaker.md):

- Logs: group ``/aws/sagemaker/TrainingJobs``, one stream per host, ``<job>/algo-<N>-<epoch>``.
  Every rank on a host prints into its host's stream.
- Instance metrics: namespace ``/aws/sagemaker/TrainingJobs``, dimension ``Host=<job>/algo-<N>``,
  1-minute resolution. ``GPUUtilization`` and ``GPUMemoryUtilization`` run 0-100 x the number of
  GPUs of the instance and ``CPUUtilization`` 0-100 x its vCPUs; `HostMetrics` divides them by
  those counts (from the instance catalogue) so that every figure is a percent of the whole host,
  like the local sampler's.
- Training metrics: inside the job, `sdp_jupyter.report()` writes its JSON line to the rank's
  metrics file as usual, and the job's entry point (sdp_jupyter.launch.targets.sagemaker.entry) prints
  each line to stdout as ``[sdp-metrics] {json}`` (see `format_log_line`). This module parses
  those lines back into the same events a local job's metrics files hold, and declares them to
  SageMaker as MetricDefinitions (`METRIC_DEFINITIONS`) so that the console graphs them too.

`CloudWatchSource(job_name, ...)` implements the reader's `MetricsSource` (poll / done / info), so
`Reader(CloudWatchSource("my-job-20261121233324"))` feeds the dashboard for any training job, also
one not started from this notebook. `LogFollower` and `HostMetrics` are its two halves; the
SageMaker job handle uses them directly to mirror logs and metrics into its job directory.
"""
from __future__ import annotations

import datetime as _dt
import json
import re
import time
from typing import Any, Callable

from sdp_jupyter import instances

__all__ = ["LOG_GROUP", "METRIC_NAMESPACE", "LINE_PREFIX", "METRIC_DEFINITIONS", "format_log_line",
           "parse_log_line", "host_index", "LogFollower", "HostMetrics", "CloudWatchSource"]

LOG_GROUP = "/aws/sagemaker/TrainingJobs"
METRIC_NAMESPACE = "/aws/sagemaker/TrainingJobs"
PERIOD_S = 60  # SageMaker publishes instance metrics at 1-minute resolution

# ---------------------------------------------------------------------------------------------
# The log-line format (the door between report() inside the container and the notebook)
# ---------------------------------------------------------------------------------------------
LINE_PREFIX = "[sdp-metrics] "
# Keys printed first, in this order, so that a MetricDefinition regex can anchor on them.
_LEADING_KEYS = ("kind", "rank", "step")
_NUMBER = r"(-?[0-9]+(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)"
_LINE_RE = re.compile(r"\[sdp-metrics\] (\{.*\})\s*$")

#: What SageMaker extracts from the log lines (rank 0's steps), as CreateTrainingJob's
#: AlgorithmSpecification.MetricDefinitions. `throughput` is rank 0's samples/s.
METRIC_DEFINITIONS = (
    {"Name": "sdp:loss", "Regex": r'\[sdp-metrics\] \{"kind":"step","rank":0,.*"loss":' + _NUMBER},
    {"Name": "sdp:throughput", "Regex": r'\[sdp-metrics\] \{"kind":"step","rank":0,.*"throughput":' + _NUMBER},
    {"Name": "sdp:step_time", "Regex": r'\[sdp-metrics\] \{"kind":"step","rank":0,.*"step_time":' + _NUMBER},
)


def format_log_line(record: dict, previous_t: float | None = None) -> str:
    """The stdout line for one metrics record: ``[sdp-metrics] {"kind":..,"rank":..,"step":..,...}``.

    Adds ``throughput`` (samples/s of this rank) for a step with `samples`, from `step_time` or
    else from the time since the rank's previous step (`previous_t`). Compact JSON, one line.
    """
    out = {k: record[k] for k in _LEADING_KEYS if k in record}
    out.update((k, v) for k, v in record.items() if k not in out)
    samples = record.get("samples")
    if record.get("kind") == "step" and isinstance(samples, (int, float)) and "throughput" not in out:
        span = record.get("step_time")
        if not isinstance(span, (int, float)) and previous_t is not None and isinstance(record.get("t"), (int, float)):
            span = record["t"] - previous_t
        if isinstance(span, (int, float)) and span > 0:
            out["throughput"] = samples / span
    return LINE_PREFIX + json.dumps(out, separators=(",", ":"), default=str)


def parse_log_line(line: str, host: int | None = None, timestamp: float | None = None) -> dict | None:
    """The metrics event in a log line, or None. `host` (0-based) is added as `node`; an event
    without `t` gets the log event's `timestamp`."""
    m = _LINE_RE.search(line)
    if m is None:
        return None
    try:
        event = json.loads(m.group(1))
    except ValueError:
        return None
    if not isinstance(event, dict) or "kind" not in event:
        return None
    if not isinstance(event.get("t"), (int, float)):
        if timestamp is None:
            return None
        event["t"] = timestamp
    if host is not None:
        event.setdefault("node", host)
    return event


_HOST_RE = re.compile(r"/algo-(\d+)(?:-|$)")


def host_index(stream_or_host: str) -> int | None:
    """0-based host index of a log stream (``job/algo-2-1700000000``) or Host dimension (``job/algo-2``)."""
    m = _HOST_RE.search(stream_or_host)
    return int(m.group(1)) - 1 if m else None


def _session(session=None, region: str | None = None):
    if session is not None:
        return session
    import boto3

    return boto3.Session(region_name=region)


# ---------------------------------------------------------------------------------------------
# Logs
# ---------------------------------------------------------------------------------------------
class LogFollower:
    """Follows every host's log stream of one training job; `poll()` returns the new lines as
    ``(host, text, unix_time)`` in each stream's order. Streams that appear later (hosts start at
    different times, a spot restart opens new ones) are picked up on the next poll."""

    def __init__(self, job_name: str, *, session=None, region: str | None = None, client=None,
                 log_group: str = LOG_GROUP):
        self.job_name = job_name
        self.log_group = log_group
        self.client = client or _session(session, region).client("logs")
        self.tokens: dict[str, str | None] = {}   # stream -> next forward token
        self.streams: dict[str, int] = {}         # stream -> host index

    def _discover(self) -> None:
        kwargs: dict[str, Any] = {"logGroupName": self.log_group, "logStreamNamePrefix": f"{self.job_name}/"}
        while True:
            try:
                page = self.client.describe_log_streams(**kwargs)
            except self.client.exceptions.ResourceNotFoundException:
                return  # no group yet: the job has not logged anything
            for s in page.get("logStreams", []):
                name = s["logStreamName"]
                if name not in self.streams:
                    host = host_index(name)
                    self.streams[name] = host if host is not None else len(self.streams)
                    self.tokens[name] = None
            token = page.get("nextToken")
            if not token or token == kwargs.get("nextToken"):
                return
            kwargs["nextToken"] = token

    def poll(self) -> list[tuple[int, str, float]]:
        self._discover()
        out: list[tuple[int, str, float]] = []
        for stream in sorted(self.streams, key=lambda s: (self.streams[s], s)):
            host = self.streams[stream]
            while True:
                kwargs: dict[str, Any] = {"logGroupName": self.log_group, "logStreamName": stream,
                                          "startFromHead": True}
                if self.tokens[stream]:
                    kwargs["nextToken"] = self.tokens[stream]
                page = self.client.get_log_events(**kwargs)
                for ev in page.get("events", []):
                    out.append((host, ev.get("message", ""), ev.get("timestamp", 0) / 1000.0))
                token = page.get("nextForwardToken")
                unchanged = token == self.tokens[stream]
                self.tokens[stream] = token
                if unchanged or not page.get("events"):
                    break
        return out


# ---------------------------------------------------------------------------------------------
# Instance metrics
# ---------------------------------------------------------------------------------------------
#: CloudWatch metric -> (device, field, scale): scale "gpus"/"vcpus" divides by that count.
HOST_METRICS = {
    "GPUUtilization": ("gpu", "util", "gpus"),
    "GPUMemoryUtilization": ("gpu", "mem_util", "gpus"),
    "CPUUtilization": ("cpu", "util", "vcpus"),
    "MemoryUtilization": ("cpu", "mem_util", None),
}


class HostMetrics:
    """Reads the instance metrics of a job's hosts; `poll()` returns new `system` events, one per
    (host, device, minute), normalised to percent of the host (see the module docstring)."""

    def __init__(self, job_name: str, hosts: int, instance_type: str | None = None, *, session=None,
                 region: str | None = None, client=None, start: float | None = None,
                 lag_s: float = 3 * PERIOD_S):
        self.job_name = job_name
        self.hosts = hosts
        self.counts = instances.host_counts(instance_type, sdk=False)
        self.client = client or _session(session, region).client("cloudwatch")
        self.start = start if start is not None else time.time() - 3600
        self.lag_s = lag_s     # minutes this recent may still change: re-read, emit once complete
        self.seen: set[tuple] = set()

    def _queries(self) -> list[dict]:
        queries = []
        for h in range(self.hosts):
            for i, metric in enumerate(HOST_METRICS):
                queries.append({
                    "Id": f"m{i}h{h}",
                    "MetricStat": {"Metric": {"Namespace": METRIC_NAMESPACE, "MetricName": metric,
                                              "Dimensions": [{"Name": "Host",
                                                              "Value": f"{self.job_name}/algo-{h + 1}"}]},
                                   "Period": PERIOD_S, "Stat": "Average"},
                    "ReturnData": True,
                })
        return queries

    def poll(self, now: float | None = None, final: bool = False) -> list[dict]:
        now = time.time() if now is None else now
        start = _dt.datetime.fromtimestamp(self.start - 2 * PERIOD_S, _dt.timezone.utc)
        end = _dt.datetime.fromtimestamp(now + PERIOD_S, _dt.timezone.utc)
        values: dict[tuple, dict] = {}
        queries = self._queries()
        names = list(HOST_METRICS)
        for lo in range(0, len(queries), 500):
            kwargs: dict[str, Any] = {"MetricDataQueries": queries[lo:lo + 500], "StartTime": start,
                                      "EndTime": end, "ScanBy": "TimestampAscending"}
            while True:
                page = self.client.get_metric_data(**kwargs)
                for res in page.get("MetricDataResults", []):
                    m, h = res["Id"][1:].split("h")
                    metric = names[int(m)]
                    for ts, v in zip(res.get("Timestamps", []), res.get("Values", [])):
                        t = ts.timestamp() if hasattr(ts, "timestamp") else float(ts)
                        values.setdefault((int(h), t), {})[metric] = float(v)
                token = page.get("NextToken")
                if not token:
                    break
                kwargs["NextToken"] = token
        events = []
        for (host, t), metrics in sorted(values.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            for device in ("gpu", "cpu"):
                key = (host, device, t)
                if key in self.seen:
                    continue
                wanted = [m for m, (dev, _, _) in HOST_METRICS.items() if dev == device]
                if not final and now - t < self.lag_s and any(m not in metrics for m in wanted):
                    continue  # this minute may still get the device's other metric
                ev = self._event(host, device, t, metrics)
                if ev is not None:
                    self.seen.add(key)
                    events.append(ev)
        return events

    def _event(self, host: int, device: str, t: float, metrics: dict) -> dict | None:
        ev: dict[str, Any] = {"t": t, "kind": "system", "node": host, "device": device,
                              "source": "cloudwatch"}
        got = False
        for metric, (dev, field, scale) in HOST_METRICS.items():
            if dev != device or metric not in metrics:
                continue
            raw = metrics[metric]
            count = self.counts.get(scale) if scale else 1
            if scale and not count:
                ev["normalised"] = False  # instance type not catalogued: the raw 0-100 x N figure
                count = 1
            ev[field] = raw / count
            ev[f"raw_{metric}"] = raw
            got = True
        if not got:
            return None
        if device == "gpu":
            ev["gpus"] = self.counts.get("gpus")
            total = self.counts.get("gpu_mem_bytes")
        else:
            ev["ncpu"] = self.counts.get("vcpus")
            total = self.counts.get("mem_bytes")
        if total and isinstance(ev.get("mem_util"), (int, float)):
            ev["mem_total"] = total
            ev["mem_used"] = total * ev["mem_util"] / 100.0
        return ev


# ---------------------------------------------------------------------------------------------
# The MetricsSource
# ---------------------------------------------------------------------------------------------
_FINAL = {"Completed": "succeeded", "Failed": "failed", "Stopped": "stopped"}


class CloudWatchSource:
    """`MetricsSource` over CloudWatch for one training job: step events parsed from the log lines,
    system events from the instance metrics. `state` is a callable returning the job's
    TrainingJobStatus; by default DescribeTrainingJob is asked. `on_line(host, text, t)` sees every
    log line fetched (the job view uses it, so each line is fetched once)."""

    def __init__(self, job_name: str, *, session=None, region: str | None = None, hosts: int | None = None,
                 instance_type: str | None = None, world_size: int | None = None,
                 state: Callable[[], str] | None = None,
                 on_line: Callable[[int, str, float], None] | None = None, start: float | None = None):
        self.job_name = job_name
        self.session = _session(session, region)
        self._describe_cache: dict | None = None
        if hosts is None or instance_type is None:
            desc = self._describe()
            rc = desc.get("ResourceConfig", {})
            hosts = hosts or rc.get("InstanceCount", 1)
            instance_type = instance_type or rc.get("InstanceType")
            if start is None and desc.get("CreationTime") is not None:
                start = desc["CreationTime"].timestamp()
        self.hosts = hosts
        self.instance_type = instance_type
        self.world_size = world_size
        self.logs = LogFollower(job_name, session=self.session)
        self.metrics = HostMetrics(job_name, hosts, instance_type, session=self.session, start=start)
        self._state_fn = state
        self._on_line = on_line
        self._state: str | None = None
        self._done = False
        self.skipped = 0

    def _describe(self) -> dict:
        self._describe_cache = self.session.client("sagemaker").describe_training_job(
            TrainingJobName=self.job_name)
        return self._describe_cache

    def status(self) -> str:
        return self._state_fn() if self._state_fn is not None else self._describe().get("TrainingJobStatus")

    def poll(self) -> list[dict]:
        if self._done:
            return []
        status = self.status()  # read first: what was logged before the job ended counts
        final = status in _FINAL
        self._state = _FINAL.get(status, "running" if status in ("InProgress", "Stopping") else status)
        events: list[dict] = []
        for host, text, t in self.logs.poll():
            if self._on_line is not None:
                self._on_line(host, text, t)
            if LINE_PREFIX.strip() in text:
                ev = parse_log_line(text, host, t)
                if ev is None:
                    self.skipped += 1
                else:
                    events.append(ev)
        events.extend(self.metrics.poll(final=final))
        self._done = final
        return events

    def done(self) -> bool:
        return self._done

    def info(self) -> dict:
        info = {"name": self.job_name, "state": self._state, "nodes": self.hosts,
                "skipped_lines": self.skipped}
        if self.world_size:
            info["world_size"] = self.world_size
        return info
