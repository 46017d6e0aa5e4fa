"""Scaling rules, warnings and estimates: hand-checked cases, then properties (hypothesis)."""
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdp_jupyter import instances
from sdp_jupyter import scaling as S
from sdp_jupyter.scaling import Plan, evaluate


def codes(outcome):
    return {w.code for w in outcome.warnings}


def local_plan(**kw):
    """A local plan on a pretend 64-core machine, so that only the warning under test fires."""
    base = dict(target="local", backend="gloo", cpus=64, dataset_size=1_000_000)
    base.update(kw)
    return Plan(**base)


# --- hand-checked --------------------------------------------------------------------------------


def test_global_batch_and_iterations():
    assert S.global_batch(4, 8, 32) == 1024
    assert S.iterations_per_epoch(50_000, 1024) == 48  # 48 * 1024 = 49152, 848 dropped
    assert S.iterations_per_epoch(50_000, 1024, drop_last=False) == 49
    assert S.iterations_per_epoch(100, 101) == 0


def test_lr_rules_hand_checked():
    assert S.scale_lr(0.1, 256, 1024, "linear") == pytest.approx(0.4)
    assert S.scale_lr(0.1, 256, 1024, "sqrt") == pytest.approx(0.2)
    assert S.scale_lr(0.1, 256, 1024, "none") == 0.1
    # Goyal et al. 2017: 0.1 per 256 -> 3.2 at 8k
    assert S.scale_lr(0.1, 256, 8192, "linear") == pytest.approx(3.2)
    with pytest.raises(ValueError, match="linear"):
        S.scale_lr(0.1, 256, 512, "cubic")


def test_warmup_suggestion_and_schedule():
    w = S.suggest_warmup(0.1, 0.4, epochs=90, iterations=48)
    assert (w.epochs, w.steps, w.start_lr, w.target_lr) == (5.0, 240, 0.1, 0.4)
    short = S.suggest_warmup(0.1, 0.4, epochs=8, iterations=10)
    assert (short.epochs, short.steps) == (2.0, 20)  # a quarter of 8 epochs
    assert S.suggest_warmup(0.1, 0.1, epochs=90, iterations=48).steps == 0
    assert S.warmup_lr(0, 4, 0.1, 0.5) == pytest.approx(0.2)
    assert S.warmup_lr(3, 4, 0.1, 0.5) == pytest.approx(0.5)
    assert S.warmup_lr(100, 4, 0.1, 0.5) == 0.5
    assert S.warmup_lr(0, 0, 0.1, 0.5) == 0.5


def test_seed_example_64_on_one_gpu_is_2_per_gpu_on_32():
    out = evaluate(local_plan(mode="keep_global", reference_batch=64, reference_lr=0.05, nodes=4,
                              procs_per_node=8, batchnorm=True, dataset_size=50_000))
    assert (out.world_size, out.per_gpu_batch, out.global_batch) == (32, 2, 64)
    assert out.lr == pytest.approx(0.05)  # global batch kept: LR kept
    (bn,) = [w for w in out.warnings if w.code == "batchnorm_small_batch"]
    assert (bn.value, bn.threshold) == (2, 16)
    assert "per-GPU batch 2" in bn.message and "SyncBatchNorm" in bn.advice
    assert out.ok  # a warning, not an error


def test_keep_per_gpu_grows_global_and_lr():
    out = evaluate(local_plan(mode="keep_per_gpu", per_gpu_batch=64, reference_batch=64, reference_lr=0.05,
                              nodes=4, procs_per_node=8, rule="linear", epochs=90))
    assert (out.per_gpu_batch, out.global_batch) == (64, 2048)
    assert out.lr == pytest.approx(1.6)
    assert out.warmup.epochs == 5.0 and out.warmup.start_lr == 0.05
    hps = out.hyperparameters()
    assert hps["batch_size"] == 64 and hps["global_batch_size"] == 2048 and hps["lr"] == 1.6
    assert hps["warmup_steps"] == out.warmup.steps == 5 * (1_000_000 // 2048)


def test_keep_global_rounds_down_and_says_so():
    out = evaluate(local_plan(mode="keep_global", reference_batch=100, nodes=1, procs_per_node=3))
    assert (out.per_gpu_batch, out.global_batch) == (33, 99)
    (w,) = [w for w in out.warnings if w.code == "global_rounded"]
    assert w.value == 99 and "99" in w.message
    assert out.lr == pytest.approx(0.1 * 99 / 100)


def test_keep_global_with_more_gpus_than_samples_blocks_launch():
    out = evaluate(local_plan(mode="keep_global", reference_batch=16, nodes=4, procs_per_node=8))
    assert not out.ok and "global_below_world" in codes(out)
    assert out.hyperparameters() == {}


def test_sagemaker_uses_the_instance_gpu_count_and_checks_smddp():
    out = evaluate(Plan(target="sagemaker", instance_type="ml.p4d.24xlarge", nodes=2, procs_per_node=1,
                        backend="smddp", per_gpu_batch=32, dataset_size=1_000_000))
    assert out.world_size == 16 and out.global_batch == 512 and out.ok
    bad = evaluate(Plan(target="sagemaker", instance_type="ml.p5.48xlarge", nodes=2, backend="smddp", engine="aws"))
    (w,) = [w for w in bad.warnings if w.code == "smddp_unsupported_instance"]
    assert w.level == S.ERROR and not bad.ok
    assert "ml.p5.48xlarge" in w.message and "ml.p4d.24xlarge" in w.advice
    # engine auto (the default): our engine there, said as a warning that does not block
    ours = evaluate(Plan(target="sagemaker", instance_type="ml.p5.48xlarge", nodes=2, backend="smddp"))
    (w,) = [w for w in ours.warnings if w.code == "smddp_engine_ours"]
    assert ours.ok and "sdp_jupyter's engine" in w.message and "C++ compiler" in w.message
    assert evaluate(Plan(target="sagemaker", instance_type="ml.p5.48xlarge", nodes=2, backend="nccl")).ok


def test_input_errors_name_the_field_and_block_launch():
    out = evaluate(local_plan(nodes=0, per_gpu_batch=0, reference_lr=0.0))
    assert {"invalid_nodes", "invalid_per_gpu_batch", "invalid_reference_lr"} <= codes(out)
    assert not out.ok and out.global_batch is None
    with pytest.raises(ValueError, match="rule must be one of none, linear, sqrt"):
        Plan(rule="log")


def test_estimate_hand_checked():
    # 48 steps x 1024 = 49152 samples; 100 samples/s/GPU x 32 GPUs x 0.9 = 2880 samples/s
    e = S.estimate(49_152, epochs=10, nodes=4, world_size=32, throughput_per_gpu=100, efficiency=0.9,
                   price_per_hour=36.0)
    assert e.samples_per_second == pytest.approx(2880)
    assert e.epoch_seconds == pytest.approx(49_152 / 2880)
    assert e.cost_per_epoch == pytest.approx(49_152 / 2880 / 3600 * 4 * 36)
    assert e.cost_per_run == pytest.approx(10 * e.cost_per_epoch)
    assert "0.9 scaling efficiency" in e.assumptions
    single = S.estimate(1000, 1, 1, 1, 100)
    assert single.efficiency == 1.0 and single.epoch_seconds == 10
    assert single.cost_per_run is None  # no price: cost unknown, not zero


def test_measured_efficiency():
    assert S.measured_efficiency(100.0, 85.0) == pytest.approx(0.85)
    with pytest.raises(ValueError, match="one-rank throughput"):
        S.measured_efficiency(0.0, 85.0)


def test_plan_estimate_uses_entered_price_and_unknown_catalogue_price():
    kw = dict(target="sagemaker", instance_type="ml.p4d.24xlarge", nodes=2, backend="smddp",
              dataset_size=1_000_000, throughput_per_gpu=500.0)
    assert evaluate(Plan(**kw)).estimate.cost_per_run is None
    priced = evaluate(Plan(price_per_hour=10.0, **kw)).estimate
    assert priced.cost_per_run == pytest.approx(priced.run_seconds / 3600 * 2 * 10.0)


# --- warnings fire exactly at their thresholds ---------------------------------------------------


@given(st.integers(1, 64))
def test_batchnorm_threshold(per_gpu):
    out = evaluate(local_plan(per_gpu_batch=per_gpu, batchnorm=True))
    assert ("batchnorm_small_batch" in codes(out)) == (per_gpu < S.BN_MIN_PER_GPU_BATCH)
    assert "batchnorm_small_batch" not in codes(evaluate(local_plan(per_gpu_batch=per_gpu)))


@settings(max_examples=40)
@given(st.integers(S.LINEAR_SCALING_MAX_GLOBAL_BATCH - 3, S.LINEAR_SCALING_MAX_GLOBAL_BATCH + 3),
       st.sampled_from(S.OPTIMIZERS), st.sampled_from(S.RULES))
def test_linear_scaling_limit_threshold(gb, optimizer, rule):
    out = evaluate(local_plan(per_gpu_batch=gb, optimizer=optimizer, rule=rule))
    expect = gb > S.LINEAR_SCALING_MAX_GLOBAL_BATCH and rule == "linear" and optimizer not in ("lars", "lamb")
    assert ("linear_scaling_limit" in codes(out)) == expect


@given(st.integers(1, 2000), st.integers(1, 64))
def test_dataset_and_iteration_thresholds(dataset, per_gpu):
    out = evaluate(local_plan(dataset_size=dataset, per_gpu_batch=per_gpu))
    assert ("batch_exceeds_dataset" in codes(out)) == (per_gpu > dataset)
    assert out.ok == (per_gpu <= dataset)
    iters = dataset // per_gpu
    assert ("few_iterations" in codes(out)) == (per_gpu <= dataset and iters < S.MIN_ITERATIONS_PER_EPOCH)


@given(st.integers(1, 8), st.integers(1, 8), st.integers(1, 40))
def test_oversubscription_threshold(nodes, procs, cpus):
    out = evaluate(local_plan(nodes=nodes, procs_per_node=procs, cpus=cpus, per_gpu_batch=1))
    w = [w for w in out.warnings if w.code == "oversubscribed"]
    assert bool(w) == (nodes * procs > cpus)
    if w:
        assert (w[0].value, w[0].threshold) == (nodes * procs, cpus)


@given(st.sampled_from(sorted(instances.catalogue())), st.sampled_from(S.BACKENDS), st.sampled_from(instances.ENGINES))
def test_smddp_instance_check_on_sagemaker(name, backend, engine):
    out = evaluate(Plan(target="sagemaker", instance_type=name, nodes=2, backend=backend, dataset_size=10**7,
                        engine=engine))
    inst = instances.get(name)
    chosen = inst.smddp_engine if engine == "auto" else engine
    blocked = backend == "smddp" and chosen == "aws" and not inst.smddp_allows()
    assert ("smddp_unsupported_instance" in codes(out)) == blocked
    assert ("smddp_engine_ours" in codes(out)) == (backend == "smddp" and chosen == "sdp")
    assert out.world_size == 2 * instances.get(name).gpus
    allreduce_only = backend == "smddp" and chosen == "aws" and inst.smddp == instances.SMDDP_ALLREDUCE_ONLY
    assert ("smddp_allreduce_only" in codes(out)) == allreduce_only and out.ok == (not blocked)


@given(st.integers(1, 4), st.sampled_from(S.BACKENDS))
def test_smddp_single_node(nodes, backend):
    out = evaluate(local_plan(nodes=nodes, backend=backend))
    assert ("smddp_single_node" in codes(out)) == (backend == "smddp" and nodes == 1)


@settings(max_examples=60)
@given(st.integers(1, 100_000), st.integers(1, 64), st.integers(1, 8), st.integers(1, 4096))
def test_every_warning_carries_its_number(dataset, per_gpu, procs, ref_batch):
    out = evaluate(local_plan(dataset_size=dataset, per_gpu_batch=per_gpu, procs_per_node=procs, nodes=2,
                              cpus=4, batchnorm=True, backend="smddp", reference_batch=ref_batch))
    for w in out.warnings:
        assert w.advice and w.level in (S.ERROR, S.WARNING)
        assert w.value is not None and str(w.value) in w.message, w


# --- the rules as properties ---------------------------------------------------------------------

lrs = st.floats(1e-6, 10, allow_nan=False)
batches = st.integers(1, 1 << 16)


@given(lrs, batches, batches)
def test_linear_doubles_lr_when_global_batch_doubles(lr, ref, gb):
    assert S.scale_lr(lr, ref, 2 * gb, "linear") == pytest.approx(2 * S.scale_lr(lr, ref, gb, "linear"))


@given(lrs, batches, batches)
def test_sqrt_multiplies_by_root_two_and_none_is_constant(lr, ref, gb):
    assert S.scale_lr(lr, ref, 2 * gb, "sqrt") == pytest.approx(math.sqrt(2) * S.scale_lr(lr, ref, gb, "sqrt"))
    assert S.scale_lr(lr, ref, gb, "none") == lr


@given(lrs, batches, st.sampled_from(S.RULES))
def test_at_the_reference_batch_every_rule_gives_the_reference_lr(lr, ref, rule):
    assert S.scale_lr(lr, ref, ref, rule) == pytest.approx(lr)


@settings(max_examples=60)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(1, 64), st.sampled_from(S.RULES), lrs)
def test_keep_global_keeps_lr_fixed(nodes, procs, per_gpu_at_scale, rule, lr):
    world = nodes * procs
    ref = world * per_gpu_at_scale  # a reference batch the world size divides
    out = evaluate(local_plan(mode="keep_global", reference_batch=ref, reference_lr=lr, rule=rule,
                              nodes=nodes, procs_per_node=procs))
    assert out.global_batch == ref and out.per_gpu_batch == per_gpu_at_scale
    assert out.lr == pytest.approx(lr)
    assert out.warmup.steps == 0  # LR not raised: no warm-up suggested


@settings(max_examples=60)
@given(st.integers(1, 6), st.integers(1, 8), st.integers(1, 256), st.integers(1, 1024))
def test_keep_per_gpu_global_is_the_product(nodes, procs, per_gpu, ref):
    out = evaluate(local_plan(nodes=nodes, procs_per_node=procs, per_gpu_batch=per_gpu, reference_batch=ref,
                              rule="linear"))
    assert out.global_batch == nodes * procs * per_gpu
    assert out.lr == pytest.approx(0.1 * out.global_batch / ref)
    assert out.iterations_per_epoch == 1_000_000 // out.global_batch
    if out.lr > 0.1:
        assert 0 < out.warmup.epochs <= S.GOYAL_WARMUP_EPOCHS and out.warmup.start_lr == 0.1


@given(st.integers(1, 10**7), st.integers(1, 100), st.integers(1, 16), st.floats(0.1, 1e4),
       st.floats(0.05, 1.0), st.floats(0.0, 100.0))
def test_estimate_scales_as_stated(samples, epochs, nodes, thr, eff, price):
    world = nodes * 8
    e = S.estimate(samples, epochs, nodes, world, thr, eff, price)
    e2 = S.estimate(samples, epochs, nodes, world, 2 * thr, eff, 2 * price)
    assert e2.epoch_seconds == pytest.approx(e.epoch_seconds / 2)
    assert e2.cost_per_epoch == pytest.approx(e.cost_per_epoch)  # twice the price for half the time
    assert e.run_seconds == pytest.approx(epochs * e.epoch_seconds)
    assert e.cost_per_run == pytest.approx(epochs * e.cost_per_epoch)


def test_the_docs_warning_table_lists_exactly_the_codes_evaluate_can_emit():
    """docs/scaling.md's table of warnings names every code scaling.py can emit, and no other."""
    import re
    from pathlib import Path

    src = Path(S.__file__).read_text()
    emitted = set(re.findall(r'ScalingWarning\(\s*"([a-z_]+)"', src))
    emitted |= {f"invalid_{name}" for name in re.findall(r'\("(\w+)", plan\.\w+, 1\)', src)}
    assert {"smddp_engine_ours", "invalid_nodes", "invalid_price"} <= emitted  # the patterns still match
    page = (Path(__file__).resolve().parents[2] / "docs" / "scaling.md").read_text()
    table = page[page.index("| code | level |"):].split("\n\n")[0]
    documented = set(re.findall(r"^\| `([a-z_]+)` \|", table, re.M)) | set(re.findall(r"`(invalid_[a-z_]+)`", table))
    assert documented == emitted, (f"not in docs/scaling.md's table: {sorted(emitted - documented)}; "
                                   f"in the table but never emitted: {sorted(documented - emitted)}")


def test_processes_per_node_has_one_name_and_the_old_one_still_works_with_a_warning():
    """procs_per_node is the name everywhere (%%sdp_train --procs-per-node, launch(), the form, Plan,
    JobSetup, %sdp_setup); gpus_per_node, the setup's old name for it, still works and says so."""
    import sdp_jupyter
    from sdp_jupyter.jobsetup import setup_from_line
    from sdp_jupyter.jobsetup.setup_options import setup_arguments

    with pytest.warns(FutureWarning, match="gpus_per_node is now procs_per_node"):
        assert Plan(gpus_per_node=4).procs_per_node == 4
    with pytest.warns(FutureWarning, match=r"JobSetup\(\): gpus_per_node is now procs_per_node"):
        s = sdp_jupyter.JobSetup(code="pass", backend="gloo", gpus_per_node=3)
    assert s.values["procs_per_node"] == 3 and "gpus_per_node" not in s.values
    with pytest.warns(FutureWarning, match=r"JobSetup.set\(\)"):
        s.set(gpus_per_node=2)
    assert s.values["procs_per_node"] == 2
    with pytest.raises(TypeError, match="give procs_per_node only"):
        sdp_jupyter.JobSetup(code="pass", gpus_per_node=2, procs_per_node=2)
    with pytest.warns(FutureWarning, match="%sdp_setup --gpus-per-node"):
        assert setup_from_line("--target local --gpus-per-node 2").values["procs_per_node"] == 2
    assert setup_from_line("--target local --procs-per-node 2").values["procs_per_node"] == 2
    shown = [flags[0] for flags, kw in setup_arguments() if kw.get("help") != "==SUPPRESS=="]
    assert "--procs-per-node" in shown and "--gpus-per-node" not in shown
