"""The instance catalogue: shape, sources, the local entry, and a cross-check against the SageMaker SDK."""
import json
from importlib import resources

import pytest

from sdp_jupyter import instances

REQUIRED = [
    "ml.p3.2xlarge", "ml.p3.8xlarge", "ml.p3.16xlarge", "ml.p3dn.24xlarge", "ml.p4d.24xlarge",
    "ml.p4de.24xlarge", "ml.p5.48xlarge", "ml.g5.xlarge", "ml.g5.2xlarge", "ml.g5.4xlarge",
    "ml.g5.8xlarge", "ml.g5.12xlarge", "ml.g5.16xlarge", "ml.g5.24xlarge", "ml.g5.48xlarge",
]


def test_catalogue_has_the_types_the_issue_names():
    assert set(REQUIRED) <= set(instances.catalogue())
    assert instances.names()[0] == "local"


@pytest.mark.parametrize(
    "name,gpus,mem,model",
    [
        ("ml.p3.2xlarge", 1, 16, "V100"),
        ("ml.p3.8xlarge", 4, 16, "V100"),
        ("ml.p3.16xlarge", 8, 16, "V100"),
        ("ml.p3dn.24xlarge", 8, 32, "V100"),
        ("ml.p4d.24xlarge", 8, 40, "A100"),
        ("ml.p4de.24xlarge", 8, 80, "A100"),
        ("ml.p5.48xlarge", 8, 80, "H100"),
        ("ml.g5.xlarge", 1, 24, "A10G"),
        ("ml.g5.12xlarge", 4, 24, "A10G"),
        ("ml.g5.16xlarge", 1, 24, "A10G"),
        ("ml.g5.48xlarge", 8, 24, "A10G"),
    ],
)
def test_gpu_facts(name, gpus, mem, model):
    inst = instances.get(name)
    assert inst.gpus == gpus
    assert inst.gpu_memory_gb == mem
    assert model in inst.gpu_model
    assert inst.total_gpu_memory_gb == gpus * mem


def test_every_figure_names_a_known_source_and_prices_are_not_guessed():
    doc = json.loads(resources.files("sdp_jupyter").joinpath("data/instances.json").read_text())
    assert doc["checked"] == instances.checked_date()
    for inst in instances.catalogue().values():
        for fld in ("gpus", "gpu_model", "gpu_memory_gb", "vcpus", "memory_gib", "network", "efa",
                    "price_per_hour_usd", "smddp"):
            sid = inst.sources[fld]
            assert "what" in instances.source(sid), (inst.name, fld)
        if inst.price_per_hour_usd is not None:
            # a price needs a source that was checked, and its date next to it
            assert inst.price_date and instances.source(inst.sources["price_per_hour_usd"])["checked"]
        else:
            assert "price unknown" in inst.describe()


def test_smddp_support_levels():
    assert instances.get("ml.p4d.24xlarge").smddp_allows()
    assert instances.get("ml.p4de.24xlarge").smddp_allows()
    assert instances.get("ml.p3dn.24xlarge").smddp == instances.SMDDP_ALLREDUCE_ONLY
    for name in ("ml.p5.48xlarge", "ml.g5.48xlarge", "ml.p3.2xlarge", "ml.p3.16xlarge"):
        assert not instances.get(name).smddp_allows(), name


def test_unknown_name_lists_the_choices():
    with pytest.raises(KeyError, match="ml.p4d.24xlarge"):
        instances.get("ml.p4d.48xlarge")


def test_local_entry_describes_this_machine():
    import os

    loc = instances.get("local")
    assert loc.is_local and loc.cpus == len(os.sched_getaffinity(0))
    assert loc.gpus == len(instances.nvml_gpus())
    assert loc.smddp_allows()
    assert "CPUs" in loc.describe()


def test_catalogue_matches_the_sagemaker_sdk_gpu_table():
    """Where the SDK's instance_gpu_info.json lists a type, GPU count and total memory must agree
    (except where the catalogue's note explains a known SDK discrepancy)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("sagemaker")  # located, not imported (importing it takes seconds)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the SageMaker SDK is not installed (pip install sagemaker)")
    path = Path(list(spec.submodule_search_locations)[0], "core", "image_uri_config", "instance_gpu_info.json")
    sdk = json.loads(path.read_text())["us-east-1"]
    compared = 0
    for name, inst in instances.catalogue().items():
        if name not in sdk:
            assert inst.note and "Missing from the SDK" in inst.note
            continue
        assert inst.gpus == sdk[name]["Count"], name
        total_gib = sdk[name]["TotalGpuMemoryInMiB"] / 1024
        if inst.note and "instance_gpu_info.json gives" in inst.note:
            assert total_gib != inst.total_gpu_memory_gb
        else:
            assert total_gib == inst.total_gpu_memory_gb, name
        compared += 1
    assert compared >= 13


def test_local_entry_reads_gpus_through_nvml(monkeypatch):
    """The NVML path, on a machine without GPUs: a stand-in pynvml module answers as the NVIDIA
    library does for two A10Gs (names as bytes, as older bindings return them)."""
    import sys
    import types

    calls = []

    class NVMLError(Exception):
        pass

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        nvmlInit=lambda: calls.append("init"),
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA A10G",
        nvmlDeviceGetMemoryInfo=lambda h: types.SimpleNamespace(total=24 * 2**30 - 512 * 2**20),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    loc = instances.local()
    assert (loc.gpus, loc.gpu_model, loc.gpu_memory_gb) == (2, "NVIDIA A10G", 23.5)
    assert calls == ["init", "shutdown"]  # NVML is shut down again after reading

    def no_library():
        raise NVMLError("NVML Shared Library Not Found")

    fake.nvmlInit = no_library
    assert instances.local().gpus == 0 and instances.nvml_gpus() == []
