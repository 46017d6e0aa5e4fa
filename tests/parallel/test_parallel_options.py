"""Hybrid-parallel job options (sdp_jupyter.launch.parallel_options): JobSpec.parallel, sdp-train, the
worker variables. No process is started; the magic and the worker environment are in test_magics.py
and test_launch.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sdp_jupyter.parallel_config import ParallelConfig
from sdp_jupyter.launch import JobSpec, SpecError
from sdp_jupyter.launch.parallel_options import DEFAULTS, PARALLEL_OPTIONS
from sdp_jupyter.parallel_config import ENV_NAMES


def test_every_key_has_one_option_and_one_worker_variable():
    assert sorted(o.field.split(".", 1)[1] for o in PARALLEL_OPTIONS) == sorted(DEFAULTS)
    full = JobSpec(code="x", nodes=2, procs_per_node=2, parallel={
        "tp": 2, "pp": 2, "microbatches": 4, "active_microbatches": 2, "pipeline_schedule": "interleaved",
        "virtual_stages": 2, "shard_optimizer": "full", "checkpoint_activations": "layer",
        "offload_activations": True, "sequence_parallel": False})
    assert sorted(full.parallel_env()) == sorted(ENV_NAMES)
    # the names the workers read, each listed in docs/jobs.md
    assert sorted(ParallelConfig(active_microbatches=2, virtual_stages=2).env()) == sorted(ENV_NAMES)
    jobs_md = (Path(__file__).resolve().parents[2] / "docs" / "jobs.md").read_text()
    assert [n for n in ENV_NAMES if f"`{n}`" not in jobs_md] == []


def test_values_are_coerced_like_the_workers_read_them():
    spec = JobSpec(code="x", nodes=2, procs_per_node=2, parallel={
        "tp": "2", "pp": 2.0, "microbatches": " 4 ", "pipeline_schedule": "GPipe", "shard_optimizer": True,
        "checkpoint_activations": "1", "sequence_parallel": "false"})
    assert spec.parallel == {"tp": 2, "pp": 2, "microbatches": 4, "pipeline_schedule": "gpipe",
                             "shard_optimizer": "optimizer", "checkpoint_activations": "layer",
                             "sequence_parallel": False}
    env = spec.parallel_env()
    assert ParallelConfig.from_env(env) == ParallelConfig(tp=2, pp=2, microbatches=4, schedule="gpipe",
                                                          sharding="optimizer", checkpointing="layer",
                                                          sequence_parallel=False)
    assert JobSpec(code="x").parallel_env() == {}  # no options: the environment a job always had


@pytest.mark.parametrize("parallel, option, fragment", [
    ({"tp": 0}, "--tp", "must be 1 or more"),
    ({"pp": True}, "--pp", "whole number"),
    ({"active_microbatches": "all"}, "--active-microbatches", "whole number"),
    ({"offload_activations": "maybe"}, "--offload-activations", "is a flag"),
    ({"zero": 3}, "parallel", "unknown hybrid-parallel option(s) zero"),
    ({"virtual_stages": 2, "pp": 2}, "--virtual-stages", "Fix: --pipeline-schedule interleaved"),
])
def test_bad_values_name_the_option(parallel, option, fragment):
    with pytest.raises(SpecError) as info:
        JobSpec(code="x", nodes=2, procs_per_node=2, parallel=parallel)
    assert info.value.option == option and fragment in str(info.value)


def test_not_passed_to_ray_silently():
    with pytest.raises(SpecError) as info:
        JobSpec(code="x", target="ray", parallel={"tp": 2, "shard_optimizer": "optimizer"})
    assert info.value.option == "--tp" and "--env SDP_TP=2" in str(info.value)
    assert "--env SDP_SHARD_OPTIMIZER=optimizer" in str(info.value)
    # the old way still works everywhere: --env without the options is passed through unchanged
    assert JobSpec(code="x", target="ray", env={"SDP_TP": "2"}).env == {"SDP_TP": "2"}
    # SageMaker jobs take them (tests/launch/targets/sagemaker/test_sagemaker.py checks the request's Environment)
    assert JobSpec(code="x", target="sagemaker", parallel={"tp": 2}).parallel == {"tp": 2}


def test_a_valid_layout_passes_and_warnings_do_not_refuse():
    # microbatches < pp is a bubble warning of the advisor, not an error
    spec = JobSpec(code="x", nodes=2, procs_per_node=2, parallel={"tp": 2, "pp": 2})
    assert spec.parallel == {"tp": 2, "pp": 2}


def test_sdp_train_bare_level_before_the_script_and_bad_layout(tmp_path):
    from sdp_jupyter.cli import build_parser, spell_out_levels

    argv = spell_out_levels(["--nodes", "2", "--procs-per-node", "2", "--shard-optimizer", "full",
                             "--checkpoint-activations", "train.py", "--shard-optimizer"])
    assert argv[-3:] == ["--checkpoint-activations=layer", "train.py", "--shard-optimizer"]  # script's own
    ns = build_parser().parse_args(argv)
    spec = JobSpec.from_options(vars(ns), script=__file__)
    assert spec.parallel == {"shard_optimizer": "full", "checkpoint_activations": "layer"}
    assert ns.script_args == ["--shard-optimizer"]

    script = tmp_path / "train.py"
    script.write_text("print('ran')\n")
    out = subprocess.run([sys.executable, "-m", "sdp_jupyter.cli", "--jobs-dir", str(tmp_path / "jobs"),
                          "--nodes", "2", "--procs-per-node", "2", "--tp", "4", str(script)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "--tp: this job's layout (--nodes 2 x --procs-per-node 2, tp=4, pp=1) cannot run" in out.stderr
    assert "nothing was launched" in out.stderr and "ran" not in out.stdout
    assert not (tmp_path / "jobs").exists()


def test_launching_with_the_options_does_not_import_torch():
    """The option table lives in launch/, not sdp_jupyter.parallel (whose package imports torch)."""
    code = ("import sys, sdp_jupyter, sdp_jupyter.magics, sdp_jupyter.cli\n"
            "from sdp_jupyter.launch.spec import all_options\n"
            "spec = sdp_jupyter.JobSpec(code='x', nodes=2, procs_per_node=2, parallel={'tp': 2, 'pp': 2})\n"
            "assert '--tp' in [o.flag for o in all_options()] and spec.parallel_env()['SDP_TP'] == '2'\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "from sdp_jupyter.ui.advisor import AdvisorView\n"
            "assert sdp_jupyter.AdvisorView is AdvisorView and 'AdvisorView' in sdp_jupyter.__all__\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
