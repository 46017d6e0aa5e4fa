"""The advisor widget is a view over sdp_jupyter.advisor: knobs in, the same figures out."""
import pytest

pytest.importorskip("ipywidgets")

from sdp_jupyter import advisor as A  # noqa: E402
from sdp_jupyter.ui.advisor import AdvisorView  # noqa: E402


def ref(name):
    return next(r for r in A.REFERENCES if name in r.name)


def test_reference_preset_shows_the_formula_figure():
    view = AdvisorView.from_reference("GPT-2 30B")
    e = A.estimate(ref("30B").workload, ref("30B").cluster(), ref("30B").config)
    assert view.config == ref("30B").config
    assert f"{e.peak_gib:.1f} GiB per GPU" in view.result.value and "fits" in view.result.value


def test_turning_a_knob_off_re_estimates_and_warns():
    view = AdvisorView.from_reference("GPT-2 10B")
    view.sharding.value = "none"
    assert "does NOT fit" in view.result.value
    view.sharding.value = "optimizer"
    view.tp.value = 3
    assert "power of two" in view.result.value


def test_recommend_button_sets_the_knobs():
    r = ref("60B")
    view = AdvisorView(r.workload, r.cluster(), A.ParallelConfig())
    assert "does NOT fit" in view.result.value
    view.recommend_button.click()
    c = view.config
    assert (c.tp, c.pp, c.microbatches, c.active_microbatches, c.sharding, c.checkpointing) == \
        (8, 2, 4, 2, "optimizer", "layer")
    assert "fits" in view.result.value and "pipeline parallelism" in view.notes.value


def test_explain_button_lists_needed_knobs():
    view = AdvisorView.from_reference("GPT-2 10B")
    view.explain_button.click()
    assert "sharding</b>: needed" in view.notes.value and "checkpointing</b>: needed" in view.notes.value


def test_instance_type_fills_gpu_figures_from_the_catalogue():
    pytest.importorskip("sdp_jupyter.instances")
    view = AdvisorView.from_reference("GPT-2 10B")
    view.instance.value = "ml.p4de.24xlarge"
    assert view.cluster.gpu_memory_gib == 80.0 and view.gpu_mem.disabled
    assert "of 80 GiB" in view.result.value


def test_preset_switch_loads_reference():
    view = AdvisorView.from_reference("GPT-2 10B")
    view.preset.value = "GPT-2 60B"
    assert view.config == ref("60B").config and view.nodes.value == 32


def test_view_shows_the_job_options_for_the_configuration():
    view = AdvisorView.from_reference("GPT-2 60B")
    assert "--nodes 32 --procs-per-node 8 --env SDP_TP=8 --env SDP_PP=2" in view.result.value


def test_torch_accounting_adds_the_embedding_gradient():
    view = AdvisorView.from_reference("GPT-2 10B")
    assert "embedding gradient" not in view.result.value
    before = view.estimate.peak
    view.runtime.value = "torch"
    assert view.config.runtime == "torch" and view.estimate.peak > before
    assert "embedding gradient" in view.result.value
