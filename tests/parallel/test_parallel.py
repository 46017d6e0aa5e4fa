"""sdp_jupyter.parallel on CPU with gloo: 2-4 real processes against a single-process reference.

Each scenario trains one step of the small GPT (forward, backward, AdamW step) with a hybrid
configuration and compares the loss, every gradient and every updated parameter, gathered to full
tensors, with the same step run in one process on the whole batch.
"""
import os
import re
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from sdp_jupyter.parallel_config import ParallelConfig
from sdp_jupyter.parallel import gpt
from sdp_jupyter._net import free_port

CFG = gpt.GPTConfig(layers=4, hidden=32, heads=4, vocab=64, seq_len=8)
BATCH = 8
LR = 1e-2
# AdamW normalises each gradient; wk.bias has a mathematically zero gradient (softmax ignores a shift
# of every key), so with the default eps rounding noise of 1e-10 would become a full lr-sized step
OPT = dict(lr=LR, eps=1e-4)


def data():
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, CFG.vocab, (BATCH, CFG.seq_len), generator=g)
    y = torch.randint(0, CFG.vocab, (BATCH, CFG.seq_len), generator=g)
    return x, y


def fresh_model():
    torch.manual_seed(0)
    return gpt.GPT(CFG)


def clean(name: str) -> str:
    """A stage's parameter name as the full model calls it (wrappers and chunk indices removed)."""
    for junk in ("_checkpoint_wrapped_module.", "inner."):
        name = name.replace(junk, "")
    return re.sub(r"^\d+\.", "", name)  # interleaved: chunk k of an nn.ModuleList


def reference(microbatches: int = 1):
    model = fresh_model()
    x, y = data()
    opt = torch.optim.AdamW(model.parameters(), **OPT)
    loss = gpt.lm_loss(model(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return loss.item(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _worker(rank, world, port, config, outdir, backend=None):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import torch.distributed as dist

    from sdp_jupyter import parallel

    if backend != "smddp":  # with smddp, setup() makes the default group (on the engine)
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        hp = parallel.setup(config, backend=backend)
        stage = hp.parallelize(fresh_model())
        opt = hp.optimizer(stage.parameters(), torch.optim.AdamW, **OPT)
        x, y = data()
        rows = BATCH // hp.dp
        xs, ys = x[hp.dp_rank * rows:(hp.dp_rank + 1) * rows], y[hp.dp_rank * rows:(hp.dp_rank + 1) * rows]
        loss = hp.step(stage, xs, ys, gpt.lm_loss)
        hp.finish_gradients(stage)
        grads = {clean(n): _full(p.grad).detach().clone() for n, p in stage.named_parameters()}
        opt.step()
        params = {clean(n): _full(p).detach().clone() for n, p in stage.named_parameters()}
        if loss is not None:  # average the replica losses: the reference saw the whole batch
            loss = loss.clone()
            dist.all_reduce(loss, group=hp.mesh["dp"].get_group())
            loss = (loss / hp.dp).item()
        dp_backend = dist.get_backend(hp.dp_group) if hp.dp_group is not None else None
        groups = {dist.get_backend(g) for g in dist.distributed_c10d._world.pg_map}
        torch.save({"loss": loss, "grads": grads, "params": params, "describe": hp.describe(),
                    "dp_backend": dp_backend, "group_backends": groups,
                    "offload": vars(hp.offload_stats)}, os.path.join(outdir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run(config: ParallelConfig, world: int, backend=None):
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_worker, args=(world, free_port(), config, d, backend), nprocs=world,
                           start_method="spawn")
        return [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(world)]


def check_against_reference(results, atol=1e-5):
    ref_loss, ref_grads, ref_params = reference()
    losses = [r["loss"] for r in results if r["loss"] is not None]
    assert losses and all(abs(l - ref_loss) < atol for l in losses), (losses, ref_loss)
    seen = set()
    for r in results:
        for n, g in r["grads"].items():
            torch.testing.assert_close(g, ref_grads[n], atol=atol, rtol=1e-4, msg=f"grad {n}")
            torch.testing.assert_close(r["params"][n], ref_params[n], atol=atol, rtol=1e-4,
                                       msg=f"param {n}")
            seen.add(n)
    assert seen == set(ref_grads), set(ref_grads) ^ seen  # every parameter lives on some rank


SCENARIOS = {
    "tp2-checkpoint-no-sp": (ParallelConfig(tp=2, sequence_parallel=False, checkpointing="layer"), 2),
    "pp2-gpipe": (ParallelConfig(pp=2, microbatches=4, schedule="gpipe"), 2),
    "pp2-interleaved-2-chunks": (ParallelConfig(pp=2, microbatches=4, schedule="interleaved",
                                                virtual_stages=2), 2),
    "dp2-zero1": (ParallelConfig(sharding="optimizer"), 2),
    # tp=2 with sequence parallelism x plain data parallelism, every group on our engine
    "tp2-dp2-smddp": (ParallelConfig(tp=2), 4, "smddp"),
    "dp2-fsdp2": (ParallelConfig(sharding="full", checkpointing="selective"), 2),
    # FSDP2 with the dp dimension of the mesh on our engine (all-gather, reduce-scatter)
    "dp2-fsdp2-smddp": (ParallelConfig(sharding="full"), 2, "smddp"),
    "dp2-zero1-smddp": (ParallelConfig(sharding="optimizer"), 2, "smddp"),
    # the notebook's layout, with offloading: one 4-process run covers tp x pp x offload
    "tp2-pp2-1f1b-offload": (ParallelConfig(tp=2, pp=2, microbatches=4, checkpointing="layer",
                                            offload_activations=True), 4),
    # the notebook's layout on our engine: tp's collectives and the pipeline's messages on smddp
    "tp2-pp2-1f1b-smddp": (ParallelConfig(tp=2, pp=2, microbatches=4), 4, "smddp"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_hybrid_step_equals_single_process(name):
    config, world, *backend = SCENARIOS[name]
    results = run(config, world, *backend)
    check_against_reference(results)
    if backend == ["smddp"]:
        assert {r["dp_backend"] for r in results if r["dp_backend"]} <= {"smddp"}
        # no hidden gloo: every group of the job (default, tp, pp, dp) is on the engine
        assert all(r["group_backends"] == {"smddp"} for r in results), [r["group_backends"] for r in results]
    if config.offload_activations:
        # save_on_cpu cannot copy a DTensor; our hook offloads its local shard and rebuilds it.
        # With per-layer checkpointing the blocks save only their inputs; the sequence-parallel
        # final norm and the column-parallel head still save DTensors on the last stage.
        for r in results:
            st = r["offload"]
            # (a pipeline stage also runs one forward without backward to infer shapes)
            assert 0 < st["restored"] <= st["tensors"], st
        last = [r["offload"] for r in results if r["loss"] is not None]
        assert last and all(st["dtensors"] > 0 for st in last)


# ------------------------------------------------------------------------------ single process


def test_environment_round_trip():
    c = ParallelConfig(tp=2, pp=2, microbatches=4, active_microbatches=2, sharding="full",
                       checkpointing="selective", offload_activations=True, schedule="gpipe")
    assert ParallelConfig.from_env(c.env()) == c
    assert ParallelConfig.from_env({}) == ParallelConfig()
    assert ParallelConfig.from_env({"SDP_SHARD_OPTIMIZER": "1", "SDP_CHECKPOINT_ACTIVATIONS": "true"}) \
        == ParallelConfig(sharding="optimizer", checkpointing="layer")
    with pytest.raises(ValueError, match="SDP_TP"):
        ParallelConfig.from_env({"SDP_TP": "two"})
    with pytest.raises(ValueError, match="sharding"):
        ParallelConfig.from_env({"SDP_SHARD_OPTIMIZER": "zero9"})


def test_stage_layers_cover_all_blocks_once():
    from sdp_jupyter.parallel import stage_layers

    for n, p in ((4, 2), (7, 3), (74, 2), (5, 5)):
        got = [i for s in range(p) for i in stage_layers(n, p, s)]
        assert got == list(range(n))
        sizes = [len(stage_layers(n, p, s)) for s in range(p)]
        assert max(sizes) - min(sizes) <= 1


def test_split_for_pipeline_keeps_names():
    from sdp_jupyter.parallel import split_for_pipeline

    full = {n for n, _ in fresh_model().named_parameters()}
    first = {n for n, _ in split_for_pipeline(fresh_model(), 2, 0).named_parameters()}
    last = {n for n, _ in split_for_pipeline(fresh_model(), 2, 1).named_parameters()}
    assert first | last == full and not first & last
    assert "tok_emb.weight" in first and "head.weight" in last


def test_checkpointing_and_offload_single_process_equal_reference():
    from sdp_jupyter.parallel import OffloadStats, apply_checkpointing, offload_saved_tensors

    ref_loss, ref_grads, _ = reference()
    for mode in ("layer", "selective"):
        model = apply_checkpointing(fresh_model(), mode)
        x, y = data()
        stats = OffloadStats()
        with offload_saved_tensors(stats):
            loss = gpt.lm_loss(model(x), y)
        loss.backward()
        assert abs(loss.item() - ref_loss) < 1e-6
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[clean(n)])
        assert stats.tensors > 0 and stats.restored == stats.tensors and stats.dtensors == 0


def test_torch_save_on_cpu_is_what_we_replace():
    """Documents why the hook exists: it must at least equal save_on_cpu on plain tensors."""
    from sdp_jupyter.parallel import offload_saved_tensors

    x, y = data()
    a = fresh_model()
    with torch.autograd.graph.save_on_cpu():
        la = gpt.lm_loss(a(x), y)
    la.backward()
    b = fresh_model()
    with offload_saved_tensors():
        lb = gpt.lm_loss(b(x), y)
    lb.backward()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def _layout_worker(rank, world, port, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    import torch.distributed as dist

    from sdp_jupyter import parallel

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        parallel.setup(ParallelConfig(tp=2))  # 2 one-process nodes: tp would cross them
    except ValueError as e:
        open(os.path.join(outdir, f"rank{rank}.txt"), "w").write(str(e))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_setup_rejects_tensor_parallelism_across_nodes():
    with tempfile.TemporaryDirectory() as d:
        mp.start_processes(_layout_worker, args=(2, free_port(), d), nprocs=2, start_method="spawn")
        msgs = [open(os.path.join(d, f"rank{r}.txt")).read() for r in range(2)]
    assert all("must not cross nodes" in m for m in msgs)
