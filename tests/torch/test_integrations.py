"""The recipes of docs/integrations.md, end to end on 2 ranks: Hugging Face Trainer, accelerate and
Ray Train train a tiny BERT (built from a config, generated data) on smddp; both ranks end with the
same weights, bit-equal to the gloo run's."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from helpers.ranks import ROOT, assert_all_ok, free_port, run_ranks

HELPERS = os.path.join(ROOT, "tests", "helpers")
ENV = {"PYTHONPATH": HELPERS + os.pathsep + ROOT}


def _assert_same_weights(runs: dict[str, list[dict]]):
    ref = runs["gloo"][0]
    for backend, states in runs.items():
        for r, st in enumerate(states):
            assert st.keys() == ref.keys()
            for k in st:
                assert torch.equal(st[k], ref[k]), (backend, r, k)
    # it trained: the classifier moved away from its initial values
    from integration_workers import tiny_bert  # noqa: PLC0415 - helpers are on sys.path below

    init = tiny_bert().state_dict()
    assert not torch.equal(ref["classifier.weight"], init["classifier.weight"])


sys.path.insert(0, HELPERS)


def test_trainer_on_smddp_matches_gloo(tmp_path):
    pytest.importorskip("transformers")
    runs = {}
    for backend in ("smddp", "gloo"):
        vals = assert_all_ok(run_ranks("integration_workers:trainer", 2, 2, args=(backend, str(tmp_path / backend)),
                                       env=ENV, timeout=180), f"the {backend} run")
        for v in vals:
            assert v["backend"] == backend and v["world"] == 2 and v["parallel_mode"] == "ParallelMode.DISTRIBUTED"
        runs[backend] = [v["state"] for v in vals]
    _assert_same_weights(runs)


def test_accelerate_launch_on_smddp_matches_gloo(tmp_path):
    pytest.importorskip("accelerate")
    runs = {}
    for backend in ("smddp", "gloo"):
        out = tmp_path / backend
        # as a user starts it on one host: no SDP_JOB_SECRET (the group's one-host secret)
        env = {k: v for k, v in {**os.environ, **ENV}.items() if k != "SDP_JOB_SECRET"}
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), os.path.join(HELPERS, "integration_workers.py"),
               backend, str(out)]
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=str(tmp_path))
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        saved = [torch.load(f"{out}.{r}") for r in range(2)]
        assert all(s["backend"] == backend and s["world"] == 2 for s in saved)
        runs[backend] = [s["state"] for s in saved]
    _assert_same_weights(runs)


def _ray_run(backend: str, out: str):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from integration_workers import ray_train_loop

    os.makedirs(out, exist_ok=True)
    trainer = TorchTrainer(ray_train_loop, train_loop_config={"out": out},
                           torch_config=TorchConfig(backend=backend),
                           scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                           run_config=RunConfig(storage_path=os.path.join(out, "ray"), name=backend))
    trainer.fit()
    saved = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]
    assert all(s["backend"] == backend for s in saved)
    return [s["state"] for s in saved]


@pytest.mark.slow
def test_ray_train_torch_config_smddp_matches_gloo(tmp_path):
    ray = pytest.importorskip("ray")
    # one node: no SDP_JOB_SECRET needed (across nodes the recipe passes one in runtime_env's env vars)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": HELPERS + os.pathsep + ROOT}})
    try:
        runs = {b: _ray_run(b, str(tmp_path / b)) for b in ("smddp", "gloo")}
    finally:
        ray.shutdown()
    _assert_same_weights(runs)
