"""The advisor's formula, rules and recommendation: pure logic, no torch."""
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from sdp_jupyter import advisor as A
from sdp_jupyter.advisor import GiB, Cluster, ModelShape, ParallelConfig, Workload

P4D = Cluster(gpus_per_node=8, gpu_memory_gib=40.0, nodes=16, instance_type="ml.p4d.24xlarge")
SMALL = ModelShape(layers=4, hidden=256, heads=8, vocab=1024, name="small")


def ref(name):
    return next(r for r in A.REFERENCES if name in r.name)


# ---------------------------------------------------------------- the formula, term by term


def test_terms_of_a_hand_computed_case():
    """One stage, no parallelism: every term recomputed here from the paper's expressions."""
    m = ModelShape(layers=2, hidden=64, heads=4, vocab=128, ffn=256)
    w = Workload(m, seq_len=16, batch=2, precision="bf16", optimizer="adam")
    e = A.estimate(w, Cluster(1, 1.0, 1), ParallelConfig(), overhead=0)
    h, f, s, b, a, V = 64, 256, 16, 2, 4, 128
    layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
    params = 2 * layer + V * h + s * h + 2 * h  # tied head, positions = seq_len
    assert m.params(s) == params
    st0 = e.stages[0]
    assert st0.term("weights") == params * 2
    assert st0.term("gradients") == params * 2
    assert st0.term("optimizer states") == params * 12  # fp32 master + m + v: 16 B/param in all
    assert st0.term("activations") == pytest.approx(2 * s * b * h * (34 + 5 * a * s / h))
    assert st0.term("logits") == 4 * s * b * V
    assert st0.term("logits gradient") == 2 * 4 * s * b * V
    assert e.peak == pytest.approx(params * 16 + 2 * s * b * h * (34 + 5 * a * s / h) + 3 * 4 * s * b * V)


def test_checkpointed_peak_counts_the_larger_backward_phase():
    """Logits and their gradients are freed before the first layer is recomputed."""
    w = Workload(ModelShape(layers=2, hidden=64, heads=4, vocab=50304), seq_len=16, batch=2)
    e = A.estimate(w, Cluster(1, 1.0, 1), ParallelConfig(checkpointing="layer"), overhead=0)
    st0 = e.stages[0]
    held = sum(st0.term(n) for n in ("weights", "gradients", "optimizer states", "activations"))
    loss = st0.term("logits") + st0.term("logits gradient")
    assert loss > st0.term("recomputed layer")  # a large vocabulary: the loss phase is the peak
    assert st0.total == pytest.approx(held + loss)


def test_tensor_parallel_activation_variants():
    w = Workload(SMALL, seq_len=128, batch=4)
    c = Cluster(8, 80.0, 1)
    s, b, h, a = 128, 4, 256, 8
    sp = A.estimate(w, c, ParallelConfig(tp=4), overhead=0).stages[0].term("activations")
    assert sp == pytest.approx(4 * s * b * h * (34 + 5 * a * s / h) / 4)
    nosp = A.estimate(w, c, ParallelConfig(tp=4, sequence_parallel=False), overhead=0)
    assert nosp.stages[0].term("activations") == pytest.approx(
        4 * s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)))
    flash = A.estimate(w, c, ParallelConfig(tp=4, flash_attention=True), overhead=0)
    assert flash.stages[0].term("activations") == pytest.approx(4 * s * b * h * 34 / 4)


def test_layer_checkpointing_keeps_inputs_plus_one_layer():
    w = Workload(SMALL, seq_len=128, batch=4)
    e = A.estimate(w, Cluster(8, 80.0, 1), ParallelConfig(tp=2, checkpointing="layer"), overhead=0)
    sbh = 128 * 4 * 256
    assert e.stages[0].term("activations") == pytest.approx(4 * 2 * sbh / 2)
    assert e.stages[0].term("recomputed layer") == pytest.approx(sbh * (34 + 5 * 8 * 128 / 256) / 2)


@pytest.mark.parametrize("schedule,expected", [("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1])])
def test_in_flight_microbatches_per_stage(schedule, expected):
    cfg = ParallelConfig(pp=4, microbatches=8, schedule=schedule)
    assert [A.in_flight(cfg, i) for i in range(4)] == expected
    capped = replace(cfg, active_microbatches=3)
    assert [A.in_flight(capped, i) for i in range(4)] == [min(3, x) for x in expected]


def test_interleaved_first_stage_matches_korthikanti():
    # first stage holds p + (p-1)/v microbatches' worth of stage activations
    cfg = ParallelConfig(pp=4, microbatches=16, schedule="interleaved", virtual_stages=2)
    assert A.in_flight(cfg, 0) == pytest.approx(4 + 3 / 2)


def test_bubble_fraction():
    assert A.bubble_fraction(ParallelConfig(pp=2, microbatches=4)) == pytest.approx(1 / 5)
    assert A.bubble_fraction(ParallelConfig(pp=4, microbatches=1)) == pytest.approx(3 / 4)
    assert A.bubble_fraction(ParallelConfig()) == 0


def test_pipeline_puts_logits_on_last_stage_and_embeddings_on_first():
    w = Workload(SMALL, seq_len=64, batch=8)
    e = A.estimate(w, Cluster(4, 16.0, 1), ParallelConfig(pp=2, microbatches=4), overhead=0)
    first, last = e.stages
    assert first.term("logits") == 0 and last.term("logits") > 0
    assert first.layers == last.layers == 2
    # the last stage holds a tied copy of the token embedding and the final norm, not positions
    diff_params = (first.term("weights") - last.term("weights")) / 2
    assert diff_params == 64 * 256 - 2 * 256


def test_sharding_levels_divide_the_right_terms():
    w = Workload(SMALL, seq_len=64, batch=8)
    c = Cluster(8, 16.0, 1)
    none, opt, grad, full = (A.estimate(w, c, ParallelConfig(sharding=s), overhead=0).stages[0]
                             for s in A.SHARDING)
    assert opt.term("optimizer states") == pytest.approx(none.term("optimizer states") / 8)
    assert opt.term("gradients") == none.term("gradients")
    assert grad.term("gradients") == pytest.approx(none.term("gradients") / 8)
    assert full.term("weights") == pytest.approx(none.term("weights") / 8)
    assert full.term("gathered layers") > 0


def test_fp32_and_sgd_bytes_per_param():
    w = Workload(SMALL, seq_len=64, batch=8, precision="fp32", optimizer="sgd_momentum")
    st0 = A.estimate(w, Cluster(1, 16.0, 1), ParallelConfig(), overhead=0).stages[0]
    n = SMALL.params(64)
    assert (st0.term("weights"), st0.term("gradients"), st0.term("optimizer states")) == (4 * n, 4 * n, 4 * n)


# ---------------------------------------------------------------- properties


configs = st.builds(
    ParallelConfig,
    tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]),
    microbatches=st.sampled_from([1, 2, 4, 8]),
    sharding=st.sampled_from(A.SHARDING), checkpointing=st.sampled_from(A.CHECKPOINTING),
    schedule=st.sampled_from(["1f1b", "gpipe"]))


@settings(max_examples=150, deadline=None)
@given(cfg=configs)
def test_each_memory_knob_never_increases_the_peak(cfg):
    w = Workload(ref("10B").workload.model, seq_len=512, batch=32)
    c = P4D
    base = A.estimate(w, c, cfg).peak
    assert A.estimate(w, c, replace(cfg, sharding="full")).peak <= base  # dp >= 4 here
    if cfg.sharding == "none":
        assert A.estimate(w, c, replace(cfg, sharding="optimizer")).peak <= base
    if cfg.checkpointing == "none":
        assert A.estimate(w, c, replace(cfg, checkpointing="layer")).peak <= base
        assert A.estimate(w, c, replace(cfg, checkpointing="selective")).peak <= base
    if cfg.tp < 8:
        assert A.estimate(w, c, replace(cfg, tp=cfg.tp * 2)).peak < base
    if cfg.pp > 1 and cfg.microbatches > 1:
        assert A.estimate(w, c, replace(cfg, active_microbatches=1)).peak <= base


@settings(max_examples=100, deadline=None)
@given(cfg=configs, nodes=st.sampled_from([1, 2, 4, 16]))
def test_every_error_names_a_fix(cfg, nodes):
    w = Workload(ModelShape(layers=6, hidden=768, heads=12, vocab=50257), seq_len=512, batch=12)
    for f in A.validate(w, replace(P4D, nodes=nodes), cfg):
        assert f.level in ("error", "warning", "info")
        if f.level == "error":
            assert f.fix


# ---------------------------------------------------------------- rules


def findings(w, c, cfg, level="error"):
    return {(f.knob, f.message.split(" ")[0]) for f in A.validate(w, c, cfg) if f.level == level}


def test_rules_each_reported():
    w = Workload(ModelShape(layers=6, hidden=768, heads=12, vocab=50257), seq_len=512, batch=12)
    assert any(f.knob == "tp" and "power of two" in f.message
               for f in A.validate(w, P4D, ParallelConfig(tp=3)))
    msg = [f for f in A.validate(w, P4D, ParallelConfig(tp=16)) if "cross nodes" in f.message]
    assert msg and "pp across nodes" in msg[0].fix
    assert any("vocab=50257" in f.message and "50304" in f.fix
               for f in A.validate(w, P4D, ParallelConfig(tp=2)))
    assert any("heads=12" in f.message for f in A.validate(w, P4D, ParallelConfig(tp=8)))
    assert any("layers=6" in f.message for f in A.validate(w, P4D, ParallelConfig(pp=4)))
    assert any("not divisible by tp*pp" in f.message
               for f in A.validate(w, Cluster(8, 40.0, 3), ParallelConfig(tp=4, pp=4)))
    assert any("batch 12" in f.message for f in A.validate(w, P4D, ParallelConfig(pp=2, microbatches=8)))
    bubble = [f for f in A.validate(w, P4D, ParallelConfig(pp=2, microbatches=1))]
    assert [f.level for f in bubble] == ["warning"] and "50%" in bubble[0].message
    off = [f for f in A.validate(w, P4D, ParallelConfig(offload_activations=True)) if f.level == "error"]
    assert off and all(n in off[0].message for n in ("checkpointing", "pp > 1", "microbatches > 1"))
    assert not [f for f in A.validate(w, P4D, ParallelConfig(
        pp=2, microbatches=4, checkpointing="layer", offload_activations=True)) if f.level == "error"]


def test_valid_config_has_no_errors():
    w = Workload(ModelShape(layers=8, hidden=1024, heads=16, vocab=50304), seq_len=512, batch=16)
    assert A.validate(w, P4D, ParallelConfig(tp=4, pp=2, microbatches=4)) == []


def test_offload_reduces_in_flight_checkpoints():
    w = Workload(ModelShape(layers=8, hidden=1024, heads=16, vocab=50304), seq_len=512, batch=16)
    cfg = ParallelConfig(pp=4, microbatches=8, checkpointing="layer", schedule="gpipe")
    on = A.estimate(w, P4D, replace(cfg, offload_activations=True)).stages[0].term("activations")
    off = A.estimate(w, P4D, cfg).stages[0].term("activations")
    assert on == pytest.approx(off * 2 / 8)


def test_downsizing_a_sharded_job_16_gpus_fit_8_do_not():
    """The seed's warning: a model that fits on 16 GPUs with sharded optimizer states may not fit
    on 8, because each GPU then holds twice the shard."""
    w = Workload(ModelShape(layers=28, hidden=4096, heads=32, vocab=50304), seq_len=512, batch=8)
    cfg = ParallelConfig(sharding="optimizer", checkpointing="layer")
    two = Cluster(8, 40.0, 2, "ml.p4d.24xlarge")
    on16, on8 = A.estimate(w, two, cfg), A.estimate(w, replace(two, nodes=1), cfg)
    assert on16.fits and not on8.fits
    assert on8.stages[0].term("optimizer states") == pytest.approx(2 * on16.stages[0].term("optimizer states"))
    info = [f for f in on16.findings if f.knob == "sharding"]
    assert info and "at least 2 node(s)" in info[0].message
    assert A.min_nodes(w, two, cfg) == 2


# ---------------------------------------------------------------- the seed's reference configurations


@pytest.mark.parametrize("r", A.REFERENCES, ids=lambda r: r.name)
def test_reference_fits_on_40gb_a100(r):
    c = r.cluster()
    assert c.gpus_per_node == 8 and c.gpu_memory_gib == 40.0
    e = A.estimate(r.workload, c, r.config)
    assert e.valid, e.findings
    assert e.fits, e.table()
    assert abs(r.workload.model.params(r.workload.seq_len) / 1e9 - float(r.workload.model.name[:-1])) < 0.5


def knobs(r):
    return {k.knob: k for k in A.explain(r.workload, r.cluster(), r.config)}


def test_10b_needs_sharding_and_checkpointing_and_tensor_parallelism():
    r = ref("10B")
    k = knobs(r)
    assert k["sharding"].needed and not k["sharding"].without.fits
    assert k["checkpointing"].needed and not k["checkpointing"].without.fits
    # tp: the reference's tp=4; without any tensor parallelism it cannot fit
    no_tp = A.estimate(r.workload, r.cluster(), replace(r.config, tp=1))
    assert not no_tp.fits and no_tp.stages[0].term("weights") + no_tp.stages[0].term("gradients") > 34 * GiB


def test_30b_needs_tp8_sharding_and_checkpointing():
    k = knobs(ref("30B"))
    assert k["tp"].needed and k["tp"].without.config.tp == 4
    assert k["sharding"].needed and k["checkpointing"].needed


def test_60b_needs_pipeline_and_explains_microbatches():
    k = knobs(ref("60B"))
    assert all(k[n].needed for n in ("pp", "tp", "sharding", "checkpointing"))
    assert not k["pp"].without.fits  # tp=8 alone on 32 nodes: over budget
    assert not k["microbatches"].needed and "50% to 20%" in k["microbatches"].message
    assert "holds 4" in k["active_microbatches"].message


def test_recommendation_walks_the_ladder_to_the_reference_knobs():
    r30 = ref("30B")
    rec = A.recommend(r30.workload, r30.cluster())
    assert rec.config is not None
    assert (rec.config.tp, rec.config.pp, rec.config.sharding, rec.config.checkpointing) == (8, 1, "optimizer", "layer")
    order = [s.knob for s in rec.steps]
    assert order[:4] == ["as proposed", "larger instance", "optimizer sharding", "activation checkpointing"]
    r60 = ref("60B")
    rec = A.recommend(r60.workload, r60.cluster())
    c = rec.config
    assert (c.tp, c.pp, c.microbatches, c.active_microbatches) == (8, 2, 4, 2)
    assert "pipeline parallelism" in rec.reasoning()


def test_recommendation_stops_at_the_first_rung_that_fits():
    w = Workload(SMALL, seq_len=128, batch=8)
    rec = A.recommend(w, P4D)
    assert rec.config == ParallelConfig() and len(rec.steps) == 1


def test_recommendation_shrinks_batch_last_and_gives_up_honestly():
    big = Workload(ModelShape(layers=2, hidden=8192, heads=64, vocab=50304), seq_len=8192, batch=64)
    rec = A.recommend(big, Cluster(8, 40.0, 1))
    assert rec.steps[-1].knob == "smaller batch"
    assert rec.estimate is None or rec.estimate.workload.batch < 64
    huge = Workload(ModelShape.from_params(1e12), seq_len=512, batch=8)
    rec = A.recommend(huge, Cluster(8, 40.0, 1))
    assert rec.estimate is None and "nothing fits" in rec.reasoning()


def test_larger_instance_only_taken_when_allowed():
    pytest.importorskip("sdp_jupyter.instances")
    w = Workload(ModelShape(layers=12, hidden=4096, heads=32, vocab=50304), seq_len=512, batch=8)
    c = Cluster.from_instance("ml.p4d.24xlarge", 1)
    stay = A.recommend(w, c)
    assert stay.estimate.cluster.instance_type == "ml.p4d.24xlarge"
    move = A.recommend(w, c, allow_instance_change=True)
    assert move.estimate.cluster.gpu_memory_gib > 40 and move.estimate.config == ParallelConfig()


def test_from_params_lands_near_the_count():
    for n in (1e9, 10e9, 60e9, 175e9):
        m = ModelShape.from_params(n)
        assert abs(m.params(2048) - n) / n < 0.2
        assert m.hidden % 1024 == 0 and m.layers % 2 == 0


def test_env_round_trip_names():
    env = ParallelConfig(tp=2, pp=2, microbatches=4, active_microbatches=2, sharding="optimizer",
                         checkpointing="layer", offload_activations=True).env()
    assert env["SDP_TP"] == "2" and env["SDP_PP"] == "2" and env["SDP_MICROBATCHES"] == "4"
    assert env["SDP_ACTIVE_MICROBATCHES"] == "2" and env["SDP_SHARD_OPTIMIZER"] == "optimizer"
    assert env["SDP_CHECKPOINT_ACTIVATIONS"] == "layer" and env["SDP_OFFLOAD_ACTIVATIONS"] == "1"
    opts = ParallelConfig(tp=2, pp=2).env_options()
    assert opts.startswith("--env SDP_TP=2 --env SDP_PP=2 ") and opts.count("--env ") == len(ParallelConfig().env())


def test_prescaled_batch_false_means_tp_times_the_batch_per_replica():
    m = ref("10B").workload.model
    pre = Workload(m, seq_len=512, batch=40, precision="fp16")
    per_rank = Workload(m, seq_len=512, batch=10, precision="fp16", prescaled_batch=False)
    cfg = ParallelConfig(tp=4, sharding="optimizer", checkpointing="layer")
    a, b = A.estimate(pre, P4D, cfg), A.estimate(per_rank, P4D, cfg)
    assert a.peak == b.peak and a.global_batch == b.global_batch == 40 * 32


def test_shape_of_a_torch_module():
    torch = pytest.importorskip("torch")
    from sdp_jupyter.parallel import gpt

    cfg = gpt.GPTConfig(layers=3, hidden=64, heads=4, vocab=100, seq_len=32)
    model = gpt.GPT(cfg)
    shape = A.shape_of(model)
    assert shape.params(32) == sum(p.numel() for p in model.parameters())
    guessed = A.shape_of(torch.nn.Linear(4096, 4096 * 24))
    assert guessed.layers >= 2 and "guessed" in guessed.name


def test_layout_rules_need_no_model():
    """What a launcher can check from --nodes, GPUs per node and the parallel options alone."""
    errs = lambda cfg, g=8, n=2: {f.knob for f in A.validate_layout(cfg, g, n) if f.level == "error"}
    assert errs(ParallelConfig(tp=2, pp=2, microbatches=4)) == set()
    assert errs(ParallelConfig(tp=16)) == {"tp"}
    assert errs(ParallelConfig(tp=3)) == {"tp", "tp/pp"}
    assert errs(ParallelConfig(pp=3)) == {"tp/pp"}
    assert errs(ParallelConfig(offload_activations=True)) == {"offload_activations"}
    assert errs(ParallelConfig(tp=2, pp=2), g=1, n=4) == {"tp"}  # 4 one-GPU nodes: tp crosses nodes
    w = Workload(SMALL, seq_len=128, batch=8)
    for cfg in (ParallelConfig(tp=16), ParallelConfig(pp=2, microbatches=1)):
        assert set(map(str, A.validate_layout(cfg, 8, 2))) <= set(map(str, A.validate(w, replace(P4D, nodes=2), cfg)))
