"""Stock torch.distributed and DistributedDataParallel on the smddp backend, in real processes."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from helpers.ranks import assert_all_ok, run_ranks


def single_process_reference(steps: int, world: int):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(123)
    for _ in range(steps):
        x = torch.randn(8 * world, 6, generator=g)
        y = torch.randn(8 * world, 2, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def test_backend_is_registered_on_import():
    import torch.distributed as dist

    import sdp_jupyter.torch  # noqa: F401

    assert "smddp" in dist.Backend.backend_list


def test_missing_import_error_names_the_import():
    code = ("import sdp_jupyter.torch as t, os\n"
            "for v in ('RANK','WORLD_SIZE','MASTER_ADDR','MASTER_PORT'): os.environ.pop(v, None)\n"
            "try:\n    t.init()\nexcept RuntimeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "needs RANK" in out.stdout and "torchrun" in out.stdout, out.stdout + out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("world,per_node", [(2, 2), (2, 1), (4, 2)])
def test_ddp_smddp_matches_single_process_and_gloo(world, per_node):
    steps = 5
    smddp = assert_all_ok(run_ranks("engine_workers:torch_ddp", world, per_node, args=(steps, "smddp"), timeout=180))
    gloo = assert_all_ok(run_ranks("engine_workers:torch_ddp", world, per_node, args=(steps, "gloo"), timeout=180))
    ref = single_process_reference(steps, world)
    for r in range(world):
        for a, b, c in zip(smddp[r], gloo[r], ref):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_ddp_features_unused_params_batchnorm_fp16_hook_subgroups():
    vals = assert_all_ok(run_ranks("engine_workers:torch_features", 3, 1, timeout=180))
    world = 3
    for v in vals:
        assert [o["rank"] for o in v["objs"]] == list(range(world))
        # every rank holds the same weights after training
        torch.testing.assert_close(v["weight"], vals[0]["weight"])
    assert vals[0]["sub"] == float(0 + world - 1) and vals[world - 1]["sub"] == float(0 + world - 1)
    assert vals[1]["sub"] is None


@pytest.mark.slow
def test_16bit_and_integer_and_bool_tensors():
    vals = assert_all_ok(run_ranks("engine_workers:torch_dtypes", 2, 1, timeout=120))
    for v in vals:
        assert v["torch.float16"] == [0.0, 3.0, 6.0, 9.0, 12.0]
        assert v["torch.bfloat16"] == [0.0, 3.0, 6.0, 9.0, 12.0]
        assert v["torch.int64"] == [0, 3, 6, 9, 12]
        assert v["torch.bool"] == [True] * 5


# ---- every operation through torch's public API, gloo as the oracle; refusals; torch's error types
import os as _os  # noqa: E402

from helpers.ranks import ROOT as _ROOT  # noqa: E402

_HELPERS_ENV = {"PYTHONPATH": _os.path.join(_ROOT, "tests", "helpers") + _os.pathsep + _ROOT}


def _run_workers(target, world, *args, env=None, timeout=150):
    return run_ranks(f"backend_workers:{target}", world, world, args=args,
                     env={**_HELPERS_ENV, **(env or {})}, timeout=timeout)


def test_one_node_secret_file_outlives_a_subgroups_set_up():
    """Without SDP_JOB_SECRET, smddp subgroups created before any whole-job group (tp x dp's dp
    groups) all get the job's secret: the file rank 0 wrote is not removed once the first subgroup is
    connected (it was, and the other subgroup's late ranks waited for it until the timeout)."""
    results = run_ranks("backend_workers:subgroups_before_any_whole_group", 4, 4, args=(3.0,),
                        env={**_HELPERS_ENV, "SDP_TIMEOUT": "30"}, timeout=120, secret=lambda r: None)
    vals = assert_all_ok(results)
    assert vals == [[2.0] * 3, [4.0] * 3, [2.0] * 3, [4.0] * 3]


def test_gather_scatter_all_to_all_coalesced_and_object_collectives_match_gloo():
    smddp = assert_all_ok(_run_workers("ops", 2, "smddp"))
    gloo = assert_all_ok(_run_workers("ops", 2, "gloo"))
    assert [v.pop("messages") for v in smddp] == [0, 0]
    assert min(v.pop("peer_read_bytes") for v in smddp) > 0  # the large blocks: straight from the peers' memory
    assert smddp == gloo
    assert smddp[1]["all_to_all_single"] == [2.0, 3.0, 102.0, 103.0]


@pytest.mark.parametrize("world,per_node,no_cma_on", [(3, 3, None), (3, 3, 1), (4, 2, None)])
def test_gather_scatter_all_to_all_in_many_chunks_match_gloo(world, per_node, no_cma_on):
    """gather, scatter and all_to_all_single run in the engine within a node, the large ones read
    straight from the peers' memory or, when any rank says SDP_NO_CMA=1 (here rank 1 alone: every
    rank must follow it), through shared memory in 4 KiB chunks (many per call); across two nodes
    the other nodes' blocks go as messages. Every value equal to gloo's."""
    def env(rank):
        return {**_HELPERS_ENV, "SDP_CHUNK_BYTES": "4096", "SDP_NO_CMA": "1" if rank == no_cma_on else "0"}
    smddp = assert_all_ok(run_ranks("backend_workers:ops", world, per_node, args=("smddp",), env=env, timeout=150))
    gloo = assert_all_ok(run_ranks("backend_workers:ops", world, per_node, args=("gloo",), env=env, timeout=150))
    messages = [v.pop("messages") for v in smddp]
    read = [v.pop("peer_read_bytes") for v in smddp]
    assert smddp == gloo
    assert smddp[0]["big_gather"][0] is not None and smddp[world - 1]["big_gather"][1] is not None
    assert (max(messages) == 0) == (per_node == world), messages
    # the path taken: this machine allows cross-memory reads between the ranks (no Yama here)
    assert (max(read) > 0) == (no_cma_on is None), read  # across nodes: scatter's root node, all_to_all
    if per_node == world:
        assert (min(read) > 0) == (no_cma_on is None), read


@pytest.mark.parametrize("world,per_node", [(4, 2), (3, 2), (2, 1)])
def test_all_to_all_across_nodes_moves_same_node_blocks_in_shared_memory(world, per_node):
    """Several nodes, equal blocks: each rank sends messages only to the ranks of other nodes (two
    per such rank: a send and a receive); the blocks between ranks of one node go through the
    engine, the large ones read from the peer's memory (nothing to read for a rank alone on its
    node). Every element right, with nodes of 2 ranks, of 2 and 1, and of 1."""
    results = assert_all_ok(run_ranks("backend_workers:split_all_to_all", world, per_node,
                                      env={**_HELPERS_ENV, "SDP_TIMEOUT": "60"}, timeout=120))
    for rank, v in enumerate(results):
        node = rank // per_node
        others = sum(1 for r in range(world) if r // per_node != node)
        mates = sum(1 for r in range(world) if r // per_node == node) - 1
        for size in ("small", "large"):
            assert v[size]["equal"], (rank, size, v)
            assert v[size]["messages"] == 2 * others, (rank, size, v)
        assert v["small"]["peer_read_bytes"] == 0, (rank, v)
        assert v["large"]["peer_read_bytes"] == mates * (1 << 17) * 4, (rank, v)


@pytest.mark.parametrize("world,per_node", [(4, 2), (3, 2), (2, 1)])
def test_scatter_across_nodes_moves_the_roots_node_blocks_in_shared_memory_gather_sends_all(world, per_node):
    """Several nodes, root 0 and the last rank. scatter of blocks over 64 KiB with other ranks on
    the root's node: only the blocks of ranks on another node travel as messages (the root posts
    one per such rank, each of them one); the ranks of the root's node read theirs from the root's
    memory. Small blocks, a root alone on its node, and gather: every block is a message
    (docs/benchmarks.md §11). Every element right, with nodes of 2 ranks, of 2 and 1, and of 1."""
    results = assert_all_ok(run_ranks("backend_workers:split_gather_scatter", world, per_node,
                                      env={**_HELPERS_ENV, "SDP_TIMEOUT": "60"}, timeout=120))
    block = (1 << 17) * 4
    for root in (0, world - 1):
        node = root // per_node
        mates = [r for r in range(world) if r // per_node == node and r != root]
        remote = [r for r in range(world) if r // per_node != node]
        for rank, v in enumerate(results):
            for op, size in [(op, size) for op in ("gather", "scatter") for size in ("small", "large")]:
                split = op == "scatter" and size == "large" and bool(mates)
                sent_to = remote if split else remote + mates
                got = v[f"{op}_{size}_{root}"]
                assert got["equal"], (rank, op, size, root, got)
                assert got["messages"] == (len(sent_to) if rank == root else int(rank in sent_to)), (rank, op, size, root, got)
                assert got["peer_read_bytes"] == (block if split and rank in mates else 0), (rank, op, size, root, got)


def test_a_leader_that_shut_down_fails_only_what_needs_it():
    """A node leader that shut down its process group cleanly while a rank of its node was idle: that
    rank's scatter from another node's root (messages only) still succeeds, and only a collective that
    needs the leader fails, naming its goodbye rather than a crash (CI once: the idle rank latched
    "rank 0 exited or closed its connection while this rank was idle" and failed that scatter)."""
    results = assert_all_ok(run_ranks("backend_workers:leader_leaves_first", 4, 2,
                                      env={**_HELPERS_ENV, "SDP_TIMEOUT": "20"}, timeout=90))
    assert [v["scatter"] for v in results] == [[float(r)] * 4 for r in range(4)], results
    assert "barrier" not in results[0], results[0]
    assert "rank 0 (node 0) had shut down its process group during barrier" in results[1]["barrier"], results[1]
    assert all(v["barrier"] != "passed" for v in results[2:]), results


@pytest.mark.parametrize("world,per_node", [(3, 3), (3, 1)])
def test_messages_and_uneven_all_to_all_and_sparse_match_gloo(world, per_node):
    """send/recv with tags, any source, batch_isend_irecv, uneven all_to_all, sparse all_reduce:
    every value equal to gloo's, on one node and one rank per node."""
    env = {**_HELPERS_ENV, "SDP_TIMEOUT": "60"}
    smddp = assert_all_ok(run_ranks("backend_workers:messages", world, per_node, args=("smddp",), env=env, timeout=120))
    gloo = assert_all_ok(run_ranks("backend_workers:messages", world, per_node, args=("gloo",), env=env, timeout=120))
    for r, v in enumerate(smddp):
        assert v.pop("all_to_all_sizes") == [[10.0 * d + r] * (d + 1) for d in range(world)]
    assert smddp == gloo
    assert smddp[0]["any_source"] == [(1, [1, 2, 7]), (2, [2, 4, 7])]
    assert smddp[1]["ring"] == [[0.0] * 4, [100.0] * 2]
    assert smddp[0]["sparse"] == [2.0 * world + 1] + [1.0] * (world - 1)
    assert smddp[2]["uneven_all_to_all"][:1] == [[2.0, 2.0]]


def test_a_large_message_nobody_waits_for_stays_in_the_socket_until_a_receive_is_posted():
    """Instead of being read into a fresh buffer and copied again later, a 64 MiB message with no
    receive from its sender posted waits in the socket: its send is not complete a second later
    (it was: the receiver's I/O thread read it all). Then it lands in its receive; a receive for a
    message behind a waiting one, and one from any source, get theirs."""
    v0, v1 = assert_all_ok(_run_workers("parked_messages", 2, env={"SDP_TIMEOUT": "60"}, timeout=120))
    assert v0 == {"sent_before_posted": False}, v0
    assert v1 == {"first": True, "behind": True, "any_source": [0, True]}, v1


def test_message_failures_name_the_peer_and_the_sizes_and_say_timed_out():
    res = _run_workers("message_failures", 2, env={"SDP_TIMEOUT": "20"}, timeout=90)
    for r in res:
        assert r.ok, r.error + r.output[-2000:]
    v0, v1 = res[0].value, res[1].value
    assert "4 bytes" not in v1["mismatch"] and "16 bytes" in v1["mismatch"] and "20 bytes" in v1["mismatch"], v1
    assert "rank 0" in v1["mismatch"], v1["mismatch"]
    assert f"{4 * ((1 << 23) - 1)} bytes" in v1["late_mismatch"] and f"{4 << 23} bytes" in v1["late_mismatch"], v1
    for v in (v0, v1):
        assert " Timed out " in v["timeout"] and v["timeout_is_dist_backend_error"], v
        assert "monitored_barrier" in v["monitored_barrier"], v  # torch reserves it for gloo
    assert "rank 1" in v0["peer_left"] and "closed its connection" in v0["peer_left"], v0["peer_left"]
    assert v0["peer_left_s"] < 10, v0


def test_timeout_is_torchs_dist_backend_error_and_says_timed_out():
    res = _run_workers("timeout_error", 2, env={"SDP_TIMEOUT": "1"}, timeout=60)
    v = res[0].value
    assert res[0].ok, res[0].error + res[0].output[-2000:]
    assert v["dist_backend_error"] and v["smddp_error"], v
    assert " Timed out " in v["message"], v["message"]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the engine stages CUDA tensors through host memory)"))])
def test_ddp_step_message_and_all_gather_on_device_tensors(device):
    vals = assert_all_ok(_run_workers("device_ops", 2, device, timeout=180))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    x = torch.arange(16 * 8, dtype=torch.float32).reshape(16, 8) / 100
    model(x).square().sum().backward()
    # DDP averages: the mean of the 2 ranks' half-batch gradients is half the whole batch's
    expect = [(p.grad / 2).tolist() for p in model.parameters()]
    for v in vals:
        for got, want in zip(v["grads"], expect):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=1e-5)
        assert v["gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert v["devices"] == [f"{device}:0" if device == "cuda" else "cpu"]
    assert vals[1]["msg"] == [10.0] * 3
