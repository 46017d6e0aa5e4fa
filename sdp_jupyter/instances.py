"""Instance catalogue: what a training node has (GPUs, GPU memory, vCPUs, network, price, smddp support).

The SageMaker types live in ``sdp_jupyter/data/instances.json``; every figure there names its source
(``Instance.sources`` maps a field to a source id, ``source(id)`` describes it) and the date it was
checked. Prices stay ``None`` unless a checkable public source gave one: a cost estimate then needs a
price entered by the user (``scaling.estimate(price_per_hour=...)``), never a guessed one.

``"local"`` describes this machine, measured when asked: CPUs this process may use, and the GPUs
NVML finds (none, when the NVIDIA driver is absent).

Use::

    from sdp_jupyter import instances
    instances.get("ml.p4d.24xlarge").gpus            # 8
    instances.get("ml.p4d.24xlarge").gpu_memory_gb   # 40.0 (per GPU)
    instances.get("local").cpus                      # e.g. 2
    sorted(instances.catalogue())                    # the SageMaker type names

No widget and no torch import here: the model-parallel planner and the launcher read it too.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Mapping

#: smddp support levels (``Instance.smddp``)
SMDDP_SUPPORTED = "supported"
SMDDP_ALLREDUCE_ONLY = "allreduce_only"
SMDDP_UNSUPPORTED = "unsupported"
#: the local machine runs our own engine (sdp_jupyter's smddp backend), not SageMaker's
SMDDP_LOCAL = "local"

#: ``--engine`` on SageMaker: who provides ``--backend smddp`` (docs/sagemaker.md, "Engine")
ENGINE_AUTO, ENGINE_SDP, ENGINE_AWS = "auto", "sdp", "aws"
ENGINES = (ENGINE_AUTO, ENGINE_SDP, ENGINE_AWS)
ENGINE_NAMES = {ENGINE_SDP: "sdp_jupyter's engine", ENGINE_AWS: "SageMaker's smdistributed library"}

LOCAL = "local"


@dataclass(frozen=True)
class Instance:
    """One node type. ``None`` means "not known from a source we could check"."""

    name: str
    gpus: int  #: GPUs per node (0 on a machine without NVIDIA GPUs)
    gpu_model: str | None
    gpu_memory_gb: float | None  #: per GPU, GiB
    vcpus: int | None
    memory_gib: float | None  #: host memory
    network: str | None  #: as AWS words it, e.g. "400 Gigabit"
    network_gbps: float | None  #: the number in ``network`` ("Up to 10" -> 10)
    efa: bool | None  #: Elastic Fabric Adapter available
    price_per_hour_usd: float | None  #: on-demand SageMaker training price per node-hour
    price_region: str | None
    price_date: str | None
    smddp: str  #: one of SMDDP_SUPPORTED, SMDDP_ALLREDUCE_ONLY, SMDDP_UNSUPPORTED, SMDDP_LOCAL
    sources: Mapping[str, str] = field(default_factory=dict)  #: field -> source id
    note: str | None = None

    @property
    def cpus(self) -> int | None:
        """CPUs a node has (vCPUs for a cloud type, usable cores for ``local``)."""
        return self.vcpus

    @property
    def total_gpu_memory_gb(self) -> float | None:
        if self.gpu_memory_gb is None:
            return None
        return self.gpu_memory_gb * self.gpus

    @property
    def is_local(self) -> bool:
        return self.name == LOCAL

    def smddp_allows(self) -> bool:
        """True where SageMaker's smddp library runs data-parallel AllReduce on this type."""
        return self.smddp in (SMDDP_SUPPORTED, SMDDP_ALLREDUCE_ONLY, SMDDP_LOCAL)

    @property
    def smddp_engine(self) -> str:
        """Who serves ``--backend smddp`` here with ``--engine auto``: ``"aws"`` (SageMaker's
        smdistributed library) on the types it supports, else ``"sdp"`` (our engine, built in the
        training container when the job starts; the local machine always runs ours)."""
        return ENGINE_AWS if self.smddp in (SMDDP_SUPPORTED, SMDDP_ALLREDUCE_ONLY) else ENGINE_SDP

    def describe(self) -> str:
        """One line for people: '8 x NVIDIA A100 40 GB, 96 vCPUs, 400 Gigabit (EFA), price unknown'."""
        if self.gpus:
            mem = f" {self.gpu_memory_gb:g} GB" if self.gpu_memory_gb else ""
            gpu = f"{self.gpus} x {self.gpu_model or 'GPU'}{mem}"
        else:
            gpu = "no GPU"
        parts = [gpu, f"{self.vcpus} {'CPUs' if self.is_local else 'vCPUs'}" if self.vcpus else None]
        if self.network:
            parts.append(self.network + (" (EFA)" if self.efa else ""))
        if not self.is_local:
            parts.append(
                f"${self.price_per_hour_usd:g}/h ({self.price_region}, {self.price_date})"
                if self.price_per_hour_usd is not None
                else "price unknown"
            )
        return ", ".join(p for p in parts if p)


@functools.lru_cache(maxsize=1)
def _document() -> dict:
    text = resources.files("sdp_jupyter").joinpath("data/instances.json").read_text()
    return json.loads(text)


@functools.lru_cache(maxsize=1)
def catalogue() -> Mapping[str, Instance]:
    """The SageMaker training types, name -> Instance, in catalogue order (no ``local``)."""
    out = {}
    for name, rec in _document()["instances"].items():
        out[name] = Instance(name=name, **rec)
    return out


def names() -> list[str]:
    """``"local"`` first, then the SageMaker types in catalogue order."""
    return [LOCAL, *catalogue()]


def source(source_id: str) -> dict:
    """What a source id in ``Instance.sources`` refers to: ``{"what": ..., "checked": date or None}``."""
    return dict(_document()["sources"][source_id])


def checked_date() -> str:
    """The date the catalogue was last checked against its sources."""
    return _document()["checked"]


def get(name: str) -> Instance:
    """The Instance called ``name`` (``"local"`` is measured now). Unknown name: KeyError naming the choices."""
    if name == LOCAL:
        return local()
    try:
        return catalogue()[name]
    except KeyError:
        raise KeyError(f"unknown instance type {name!r}; known: {', '.join(names())}") from None


def host_counts(instance_type: str | None, region: str | None = None, *, sdk: bool = True) -> dict:
    """One node's counts as the CloudWatch figures are divided by them and the SageMaker plan checks
    them: ``{"gpus", "vcpus", "gpu_mem_bytes" (all its GPUs), "mem_bytes"}`` from the catalogue; for a
    type it does not list, with `sdk`, ``{"gpus", "gpu_mem_bytes"}`` from the SageMaker SDK's GPU table
    when the SDK is installed; else ``{}``."""
    if not instance_type:
        return {}
    inst = catalogue().get(instance_type)
    if inst is not None:
        out = {"gpus": inst.gpus or None, "vcpus": inst.vcpus}
        if inst.gpu_memory_gb and inst.gpus:
            out["gpu_mem_bytes"] = inst.gpu_memory_gb * inst.gpus * 2**30
        if inst.memory_gib:
            out["mem_bytes"] = inst.memory_gib * 2**30
        return out
    if not sdk:
        return {}
    try:
        from sagemaker.core import instance_types_gpu_info

        info = instance_types_gpu_info.retrieve(region or "us-east-1").get(instance_type)
    except Exception:  # no SDK, or one without the table
        info = None
    if info:
        return {"gpus": info["Count"], "gpu_mem_bytes": info["TotalGpuMemoryInMiB"] * 2**20}
    return {}


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's total)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def nvml_gpus() -> list[dict]:
    """GPUs NVML reports: ``[{"name", "memory_gb"}]``; empty without the NVIDIA library or driver."""
    try:
        import pynvml  # provided by nvidia-ml-py
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # NVMLError_LibraryNotFound / DriverNotLoaded on a machine without GPUs
        return []
    try:
        found = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            if isinstance(name, bytes):
                name = name.decode()
            total = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            found.append({"name": name, "memory_gb": round(total / 2**30, 1)})
        return found
    finally:
        pynvml.nvmlShutdown()


def local() -> Instance:
    """This machine: usable CPUs, host memory, and the GPUs NVML finds."""
    gpus = nvml_gpus()
    try:
        import psutil

        memory = round(psutil.virtual_memory().total / 2**30, 1)
    except ImportError:
        memory = None
    models = sorted({g["name"] for g in gpus})
    return Instance(
        name=LOCAL,
        gpus=len(gpus),
        gpu_model=", ".join(models) if models else None,
        gpu_memory_gb=min(g["memory_gb"] for g in gpus) if gpus else None,
        vcpus=usable_cpus(),
        memory_gib=memory,
        network=None,
        network_gbps=None,
        efa=False,
        price_per_hour_usd=None,
        price_region=None,
        price_date=None,
        smddp=SMDDP_LOCAL,
        sources={"gpus": "nvml", "vcpus": "os.sched_getaffinity", "memory_gib": "psutil"},
    )
