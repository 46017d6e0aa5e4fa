"""The native engine through sdp_jupyter.comm, in real processes laid out as nodes.

Every collective, dtype and op is checked against a numpy reference computed here from the
same per-rank inputs (engine_workers.rank_data).
"""
from __future__ import annotations

import os
import hmac
import hashlib
import socket
import time

import numpy as np
import psutil
import pytest

from sdp_jupyter import _engine
from helpers.ranks import assert_all_ok, collect, run_ranks, start_ranks
from helpers.engine_workers import rank_data

LAYOUTS = [(2, 2), (2, 1), (3, 1), (3, 3), (4, 2), (4, 1), (4, 4)]  # (world, ranks per node)
SIZES = [0, 1, 7, 1001]
REDUCE = {"sum": np.add, "max": np.maximum, "min": np.minimum, "product": np.multiply}


def reference(kind, n, dtype, op, root, world):
    xs = [rank_data(r, n, dtype) for r in range(world)]
    if kind in ("all_reduce", "reduce"):
        acc_dtype = np.float32 if dtype == "float16" else xs[0].dtype
        acc = xs[0].astype(acc_dtype)
        for x in xs[1:]:
            acc = REDUCE["sum" if op == "avg" else op](acc, x.astype(acc_dtype))
        if op == "avg":
            acc = acc / world
        return [acc.astype(xs[0].dtype) if (kind == "all_reduce" or r == root) else xs[r] for r in range(world)]
    if kind == "broadcast":
        return [xs[root]] * world
    if kind in ("all_gather", "all_gather_list"):
        return [np.concatenate(xs)] * world
    if kind == "ring":
        return [xs[(r - 1) % world] for r in range(world)]
    if kind == "reduce_scatter":
        big = [rank_data(r, n * world, dtype) for r in range(world)]
        acc = big[0].astype(np.float32 if dtype == "float16" else big[0].dtype)
        for b in big[1:]:
            acc = REDUCE["sum" if op == "avg" else op](acc, b)
        if op == "avg":
            acc = acc / world
        return [acc[r * n:(r + 1) * n].astype(big[0].dtype) for r in range(world)]
    return [None] * world


def check(results, cases, world):
    vals = assert_all_ok(results)
    for i, case in enumerate(cases):
        expect = reference(*case, world)
        for r in range(world):
            got = vals[r]["out"][i]
            if expect[r] is None:
                continue
            tol = {"float16": 2e-2, "float32": 1e-5, "float64": 1e-12}.get(case[2], 0)
            np.testing.assert_allclose(got.astype(np.float64), expect[r].astype(np.float64), rtol=tol, atol=tol,
                                       err_msg=f"{case} rank {r}")
    return vals


def test_hmac_matches_python():
    for key, msg in [(b"k", b""), (b"s" * 100, b"x" * 1000), (b"abc", b"hello")]:
        assert _engine.hmac_sha256(key, msg) == hmac.new(key, msg, hashlib.sha256).digest()


@pytest.mark.parametrize("simd", ["1", "0"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8", "int8"])
@pytest.mark.parametrize("op", [0, 2, 3, 4])
def test_kernels_match_numpy(dtype, op, simd, monkeypatch):
    # The kernels alone, in this process (SDP_NO_SIMD is read once per process, so the portable
    # build is exercised in test_portable_kernels_in_fresh_process).
    a = rank_data(0, 3001, dtype)
    b = rank_data(1, 3001, dtype)
    c = rank_data(2, 3001, dtype)
    dst = np.empty_like(a)
    _engine.reduce_buffers(int(_engine.DType.__members__[dtype]), op, dst.ctypes.data,
                           [a.ctypes.data, b.ctypes.data, c.ctypes.data], a.size)
    f = [np.add, None, np.maximum, np.minimum, np.multiply][op]
    wide = np.float32 if dtype == "float16" else a.dtype
    expect = f(f(a.astype(wide), b.astype(wide)), c.astype(wide)).astype(a.dtype)
    np.testing.assert_allclose(dst.astype(np.float64), expect.astype(np.float64), rtol=1e-6)


def test_portable_kernels_in_fresh_process(tmp_path):
    code = (
        "import numpy as np; from sdp_jupyter import _engine as e\n"
        "assert e.kernel_isa() == 'portable'\n"
        "a = (np.arange(5000) % 37 / 7).astype(np.float16); b = a[::-1].copy(); d = np.empty_like(a)\n"
        "e.reduce_buffers(int(e.DType.float16), int(e.ReduceOp.sum), d.ctypes.data, [a.ctypes.data, b.ctypes.data],"
        " a.size)\n"
        "assert np.array_equal(d, (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16))\n"
        "print('ok')\n"
    )
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SDP_NO_SIMD": " On "},
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("value,isa", [("off", None), ("FALSE", None), ("0", None), ("maybe", "error")])
def test_no_simd_reads_booleans_as_python_does(value, isa):
    """The engine's SDP_NO_SIMD has _env.py's truth table ("false" keeps the SIMD kernels; it
    used to mean 'on', as did anything not starting with 0), and garbage is refused by name."""
    import subprocess
    import sys
    code = "from sdp_jupyter import _engine as e\ntry:\n print(e.kernel_isa())\nexcept e.EngineError as x:\n print(x)\n"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SDP_NO_SIMD": value},
                         capture_output=True, text=True, timeout=60).stdout.strip()
    if isa == "error":
        assert out == "SDP_NO_SIMD=maybe is not a boolean: use one of 1/0, true/false, yes/no, on/off", out
    else:
        assert out == _engine.kernel_isa(), out  # what this process (SDP_NO_SIMD unset) uses


def test_bf16_conversion_rounds_to_nearest_even():
    # bfloat16 exists only through torch; check the engine's conversion against torch's.
    torch = pytest.importorskip("torch")
    x = torch.randn(10000) * 1000
    a = x.to(torch.bfloat16)
    b = (x * 0.37).to(torch.bfloat16)
    d = torch.empty_like(a)
    _engine.reduce_buffers(int(_engine.DType.bfloat16), int(_engine.ReduceOp.sum), d.data_ptr(),
                           [a.data_ptr(), b.data_ptr()], a.numel())
    assert torch.equal(d, (a.float() + b.float()).to(torch.bfloat16))


@pytest.mark.slow
@pytest.mark.parametrize("world,per_node", LAYOUTS)
def test_every_collective_matches_numpy(world, per_node):
    cases = []
    for n in SIZES:
        for dtype in ("float32", "float64", "float16", "int32", "int64", "uint8", "int8"):
            cases.append(("all_reduce", n, dtype, "sum", 0))
        cases.append(("broadcast", n, "float32", "sum", world - 1))
        cases.append(("all_gather", n, "int64", "sum", 0))
        cases.append(("reduce_scatter", n, "float32", "sum", 0))
        cases.append(("ring", n, "int8", None, 0))
    for op in ("avg", "max", "min", "product"):
        cases.append(("all_reduce", 513, "float32", op, 0))
        cases.append(("all_reduce", 513, "float16", op, 0))
        cases.append(("all_reduce", 513, "int32", op if op != "avg" else "sum", 0))
    cases += [("reduce", 99, "float64", "sum", 1 % world), ("all_gather_list", 3, "float32", "sum", 0),
              ("reduce_scatter", 5, "float64", "avg", 0), ("barrier", 0, "uint8", "sum", 0)]
    results = run_ranks("engine_workers:collectives", world, per_node, args=(cases,), timeout=120)
    vals = check(results, cases, world)
    assert [v["node"] for v in vals] == [r // per_node for r in range(world)]
    assert [v["local_rank"] for v in vals] == [r % per_node for r in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("world,per_node", [(2, 2), (2, 1), (4, 2)])
def test_large_buffers_cross_many_chunks(world, per_node):
    # 64 MiB of float32 and an odd count not divisible by the world size, with small chunks so
    # the chunking and shard arithmetic are exercised many times.
    n = 16 * 1024 * 1024 + 3
    cases = [("all_reduce", n, "float32", "sum", 0), ("all_reduce", 100003, "float16", "avg", 0),
             ("broadcast", 1000003, "float64", "sum", 0)]
    results = run_ranks("engine_workers:collectives", world, per_node, args=(cases,), timeout=300,
                        env={"SDP_CHUNK_BYTES": str(1 << 20)})
    check(results, cases, world)


@pytest.mark.slow
@pytest.mark.parametrize("world,per_node,depth", [(2, 1, 2), (3, 1, 2), (4, 1, 2), (3, 1, 1), (4, 2, 2), (6, 3, 2)])
def test_pipelined_paths_many_chunks_odd_sizes(world, per_node, depth):
    # Both pipelined paths across nodes. One rank per node: two chunks in flight, shards scaled by
    # their owner. Several ranks per node: piece j of the node's sum crosses (beside piece j-1's
    # gather) while the node reduces piece j+1 and copies back piece j-1, in the two halves of every
    # slot. 4 KiB chunks (2 KiB pieces) make 1, 2, 3 and many chunks or pieces, with shards of
    # uneven length; broadcasts in between leave the peers with different receive counts (a
    # receive-count bookkeeping error shows up as a wrong sum right after them).
    chunk = 4096
    cases = []
    for n in (1, 3, 511, 513, 1023, 1024, 1025, 2049, 3 * 1024 + 7, 50 * 1024 + 11):
        cases.append(("all_reduce", n, "float32", "sum", 0))
        cases.append(("broadcast", n, "float32", "sum", n % world))
        cases.append(("all_reduce", n, "float16", "avg", 0))
        cases.append(("all_reduce", n, "int32", "max", 0))
        cases.append(("all_reduce", n, "uint8", "sum", 0))
        cases.append(("all_reduce", n, "float64", "avg", 0))
    results = run_ranks("engine_workers:collectives", world, per_node, args=(cases,), timeout=180,
                        env={"SDP_CHUNK_BYTES": str(chunk), "SDP_PIPELINE_DEPTH": str(depth)})
    check(results, cases, world)


@pytest.mark.slow
@pytest.mark.parametrize("world,per_node", [(2, 2), (2, 1), (3, 1), (4, 2), (3, 3)])
def test_native_all_gather_and_reduce_scatter_many_chunks(world, per_node):
    # The engine's own all_gather / reduce_scatter (not broadcasts or a full all_reduce): 4 KiB
    # chunks make one, a few and many rounds, with blocks of odd length, on every path (shared
    # memory, one rank per node over TCP, several ranks on several nodes); all_reduce in between
    # checks that the collectives leave the slots and links in step.
    cases = []
    for n in (1, 3, 1023, 1025, 5 * 1024 + 7):
        cases.append(("all_gather", n, "float32", "sum", 0))
        cases.append(("reduce_scatter", n, "float32", "sum", 0))
        cases.append(("all_reduce", n, "float32", "sum", 0))
        cases.append(("reduce_scatter", n, "float16", "avg", 0))
        cases.append(("reduce_scatter", n, "int32", "max", 0))
        cases.append(("all_gather", n, "uint8", "sum", 0))
    cases.append(("all_gather_list", 77, "float64", "sum", 0))
    results = run_ranks("engine_workers:collectives", world, per_node, args=(cases,), timeout=180,
                        env={"SDP_CHUNK_BYTES": str(4096)})
    check(results, cases, world)


@pytest.mark.slow
@pytest.mark.parametrize("nodes", [(0, 0, 1), (0, 1, 1, 1), (0, 1, 1)])
def test_nodes_of_different_sizes(nodes):
    # A launcher may start a different number of ranks on each node: a node of one rank and a
    # node of several must take the same path across nodes (small and large, every collective).
    world = len(nodes)
    cases = []
    for n in (1, 1001, 40 * 1024 + 3):
        cases += [("all_reduce", n, "float32", "sum", 0), ("all_reduce", n, "float16", "avg", 0),
                  ("broadcast", n, "float32", "sum", world - 1), ("all_gather", n, "float32", "sum", 0),
                  ("reduce_scatter", n, "float32", "sum", 0)]
    results = run_ranks("engine_workers:collectives", world, world, args=(cases,), timeout=120,
                        env=lambda r: {"GROUP_RANK": str(nodes[r]), "SDP_CHUNK_BYTES": str(64 << 10)})
    vals = check(results, cases, world)
    assert [v["node"] for v in vals] == list(nodes)


@pytest.mark.parametrize("n, no_cma", [(10001, "0"), (10001, "1"), (100, "0")])
def test_node_gather_scatter_all_to_all_through_the_engine(n, no_cma):
    # 3 ranks on one node. 80 KB blocks: read straight from the peers' memory, or through the
    # slots in 4 KiB chunks (SDP_NO_CMA=1); 800 bytes: the one-barrier small slots. The sanitized
    # build runs this too (tests/engine/test_native_builds.py).
    w = 3
    vals = assert_all_ok(run_ranks("routing_workers:node_blocks", w, w, args=(n,), timeout=120,
                                   env={"SDP_CHUNK_BYTES": "4096", "SDP_NO_CMA": no_cma}))
    ar = np.arange(n, dtype=np.float64)
    assert vals[w - 1]["gather"] == [(ar + 1000.0 * r).tolist() for r in range(w)]
    for r, v in enumerate(vals):
        assert v["scatter"] == (7.0 * r + ar).tolist()
        assert v["all_to_all"] == np.concatenate([ar + r * n + 1e6 * k for k in range(w)]).tolist()
    read = [v["peer_read_bytes"] for v in vals]
    # in blocks: the gather root (rank 2) reads 2, each scatter non-root 1, every rank 2 in all_to_all
    assert read == ([8 * n * k for k in (2, 3, 5)] if no_cma == "0" and n > 1000 else [0] * w), read


def test_a_bad_no_cma_value_fails_set_up_by_name():
    # read when the group is set up, so a typo fails init_process_group, not a later gather
    results = run_ranks("engine_workers:just_init", 2, 2, timeout=60, env={"SDP_NO_CMA": "maybe"})
    for r in results:
        assert not r.ok and "SDP_NO_CMA=maybe is not a boolean" in r.error, r.error


@pytest.mark.slow
@pytest.mark.parametrize("coll", ["all_gather", "reduce_scatter"])
@pytest.mark.parametrize("world,per_node", [(2, 2), (2, 1), (4, 2)])
def test_gather_scatter_mismatch_fails_every_rank(coll, world, per_node):
    procs, tmp = start_ranks("routing_workers:mismatch_gather_scatter", world, per_node, args=(coll,))
    vals = assert_all_ok(collect(procs, tmp, timeout=60))
    for r, v in enumerate(vals):
        assert "collective mismatch" in v and "element count" in v and coll in v, f"rank {r}: {v}"
    _no_rank_left(procs)


def _no_rank_left(results_procs):
    for p in results_procs:
        assert not psutil.pid_exists(p.pid) or psutil.Process(p.pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["count", "dtype", "barrier"])
@pytest.mark.parametrize("world,per_node", [(2, 2), (2, 1), (4, 2)])
def test_mismatch_fails_every_rank_and_reduces_nothing(kind, world, per_node):
    """barrier: the engine's own collective (coll_records.cpp), so a rank in a barrier while the others
    all-reduce one byte is a mismatch naming both, and the flight recorder says which one each rank was in."""
    procs, tmp = start_ranks("engine_workers:mismatch", world, per_node, args=(kind,))
    results = collect(procs, tmp, timeout=60)
    vals = assert_all_ok(results)
    field = {"count": "element count", "dtype": "dtype", "barrier": "collective"}[kind]
    for r, v in enumerate(vals):
        assert "collective mismatch" in v and field in v, f"rank {r}: {v}"
        assert "nothing was reduced" in v
        if kind == "barrier":
            assert "barrier" in v.split(" | ")[0] and "all_reduce" in v.split(" | ")[0], f"rank {r}: {v}"
            assert v.split(" | ")[1] == ("barrier" if r == world - 1 else "all_reduce"), f"rank {r}: {v}"
    _no_rank_left(procs)


@pytest.mark.slow
@pytest.mark.parametrize("world,per_node,victim", [(2, 1, 1), (3, 1, 2), (4, 2, 3), (4, 2, 0), (2, 2, 1)])
def test_dead_rank_is_named_within_two_seconds(world, per_node, victim):
    procs, tmp = start_ranks("engine_workers:die_mid_training", world, per_node, args=(victim,))
    results = collect(procs, tmp, timeout=60)
    assert results[victim].returncode == 17
    for r in results:
        if r.rank == victim:
            continue
        assert r.ok, r.output
        err, after = r.value["error"], r.value["after"]
        assert after < 2.5, f"rank {r.rank} took {after:.1f} s to notice: {err}"
        # The victim's node leader names it; ranks elsewhere name it or its node's leader.
        leader = (victim // per_node) * per_node
        assert f"rank {victim} " in err or f"rank {leader} " in err, err
        assert "exited or closed" in err or "failed" in err, err
    _no_rank_left(procs)


@pytest.mark.slow
@pytest.mark.parametrize("world,per_node", [(2, 2), (2, 1)])
def test_stalled_rank_times_out_with_its_name(world, per_node):
    results = run_ranks("engine_workers:stall", world, per_node, args=(1,), timeout=60)
    err = results[0].value
    assert "timed out after 3 s" in err, err
    # within a node the barrier names the late rank(s); across nodes the link names the leader
    assert "rank(s) 1" in err or "node leader rank 1 " in err, err


@pytest.mark.slow
def test_wrong_secret_is_refused():
    results = run_ranks("engine_workers:just_init", 2, 1, timeout=60,
                        secret=lambda r: "good" * 8 if r == 0 else "bad" * 8, env={"SDP_TIMEOUT": "5"})
    # The rendezvous store (served by rank 0) refuses the stranger before it reads a key;
    # rank 0 never hears from its peer.
    assert not results[1].ok and "SDP_JOB_SECRET differs" in results[1].error, results[1].error
    assert not results[0].ok and "timed out" in results[0].error, results[0].error


def test_engine_refuses_a_peer_with_another_secret(capfd):
    """The engine's own handshake, below the store: node 0's leader dials node 1's with the
    wrong secret; the dialler is told its proof was refused, the listener logs why."""
    from sdp_jupyter import _engine

    listener = _engine.Engine(1, [0, 1], b"good" * 8, "127.0.0.1", 2.0, 1 << 20, -1)
    dialer = _engine.Engine(0, [0, 1], b"bad!" * 8, "127.0.0.1", 2.0, 1 << 20, -1)
    port, _ = listener.prepare()
    dialer.prepare()
    with pytest.raises(_engine.EngineError, match="job secret"):
        dialer.connect(["127.0.0.1", "127.0.0.1"], [0, port])
    with pytest.raises(_engine.EngineError, match="timed out"):
        listener.connect(["127.0.0.1", "127.0.0.1"], [0, port])
    listener.shutdown()
    dialer.shutdown()
    assert "failed the job-secret challenge" in capfd.readouterr().err


@pytest.mark.parametrize("spin", ["2000", "0"])
def test_a_receive_reading_its_connection_keeps_others_messages_and_gives_it_back(spin):
    """A waiting receive reads its source's connection itself (spinning first unless SDP_SPIN=0):
    a message for another tag it meets is kept, a message nobody waits for is then read by the I/O
    thread (no wait() called), and shutting down from another thread ends a reading receive."""
    results = assert_all_ok(run_ranks("routing_workers:message_readers", 2, 2, env={"SDP_SPIN": spin}, timeout=90))
    assert results[1]["kept"] == [[0, 1, 2], True, [0, 1, 2, 3, 4]], results[1]
    assert results[1]["io_thread_took_it_back"] == [True, [7, 7, 7, 7]], results[1]
    # rank 0's own shutdown ends its receive; rank 1's ends because rank 0 then closed its connection
    # (routing_workers.message_readers orders the two shutdowns)
    assert "shut down" in results[0]["waiting"]["error"], results[0]
    assert "rank 0" in results[1]["waiting"]["error"] and "closed its connection" in results[1]["waiting"]["error"], results[1]
    for v in results:
        assert v["waiting"]["after"] < 3 and v["shutdown_s"] < 3, v
