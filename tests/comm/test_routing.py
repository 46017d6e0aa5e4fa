"""gather, scatter and all_to_all through the numpy face (sdp_jupyter.comm), routed by topology: one
node (the engine: shared memory, large blocks read straight from the peers' memory), several nodes
(the node's part through the engine, the other nodes' blocks as messages at the same time), one rank
per node (all messages). Every element checked, and the route taken (messages posted, bytes read
from peers) as docs/engine.md describes it."""
from __future__ import annotations

import pytest

from helpers.ranks import assert_all_ok, run_ranks
from sdp_jupyter import comm

SMALL, LARGE = 5, 1 << 15  # float32 elements per block: 20 B, and 128 KiB (over comm.SMALL_BYTES)


def test_the_engines_numbers_are_bound_not_copied():
    from sdp_jupyter import _engine

    assert comm.SMALL_BYTES == _engine.SMALL_BYTES == 64 << 10
    assert (comm.DEFAULT_CHUNK_BYTES, comm.DEFAULT_TIMEOUT) == (4 << 20, 300.0)
    assert comm.DTYPE_SIZES[comm.DTYPES["bfloat16"]] == 2 and comm.DTYPE_SIZES[comm.DTYPES["int64"]] == 8
    assert SMALL * 4 <= comm.SMALL_BYTES < LARGE * 4


@pytest.mark.parametrize("world,per_node", [(3, 3), (4, 2), (2, 1), (1, 1)])  # (1, 1): each record's `alone`
def test_gather_scatter_all_to_all_route_by_topology(world, per_node):
    vals = assert_all_ok(run_ranks("routing_workers:routed_blocks", world, per_node, args=([SMALL, LARGE],),
                                   timeout=150))
    assert vals[0]["node_of_rank"] == [r // per_node for r in range(world)]
    nodes = world // per_node
    for rank, v in enumerate(vals):
        node = rank // per_node
        mates = [r for r in range(world) if r // per_node == node and r != rank]
        others = world - 1 - len(mates)
        for name, got in v.items():
            if name == "node_of_rank":
                continue
            assert got["equal"], (rank, name, got)
        for n in (SMALL, LARGE):
            nbytes = 4 * n
            for root in (0, world - 1):
                root_mates = [r for r in range(world) if r // per_node == root // per_node and r != root]
                remote = [r for r in range(world) if r // per_node != root // per_node]
                for form in ("", "flat_"):
                    g, s = v[f"gather_{form}{n}_{root}"], v[f"scatter_{form}{n}_{root}"]
                    # gather: one node, the engine; several, every block a message (also the root's node)
                    senders = [r for r in range(world) if r != root] if nodes > 1 else []
                    assert g["messages"] == (len(senders) if rank == root else int(rank in senders)), (rank, n, root, g)
                    read = nbytes * (world - 1) if nodes == 1 and rank == root and n == LARGE else 0
                    assert g["peer_read_bytes"] == read, (rank, n, root, g)
                    # scatter: the root's node through the engine when blocks are large and it has mates
                    split = nodes == 1 or (n == LARGE and bool(root_mates))
                    sent_to = remote if split else remote + root_mates
                    assert s["messages"] == (len(sent_to) if rank == root else int(rank in sent_to)), (rank, n, root, s)
                    read = nbytes if split and n == LARGE and rank in root_mates else 0
                    assert s["peer_read_bytes"] == read, (rank, n, root, s)
            for case in (f"all_to_all_single_{n}", f"all_to_all_single_in_place_{n}"):
                a = v[case]
                assert a["messages"] == 2 * others, (rank, case, a)  # a send and a receive per other node's rank
                read = nbytes * len(mates) if n * world * 4 > comm.SMALL_BYTES else 0
                assert a["peer_read_bytes"] == read, (rank, case, a)
        for case in ("all_to_all_single_uneven", "all_to_all_lists"):  # any sizes: all messages
            assert v[case]["messages"] == 2 * (world - 1) and v[case]["peer_read_bytes"] == 0, (rank, case, v[case])


def test_bad_blocks_are_refused_before_anything_moves():
    class Store(dict):
        def set(self, k, v):
            self[k] = v

        def get(self, k):
            return self[k]

    import numpy as np

    with comm.Communicator(0, 1, Store(), secret=b"s" * 32, timeout=5) as c:
        x = np.arange(4, dtype=np.float32)
        with pytest.raises(ValueError, match="needs 1 buffers"):
            c.gather([np.zeros(4, np.float32)] * 2, x)
        with pytest.raises(ValueError, match="must hold world_size x 4"):
            c.scatter(np.zeros(4, np.float32), np.zeros(3, np.float32))
        with pytest.raises(ValueError, match="split sizes"):
            c.all_to_all_single(np.zeros(4, np.float32), x, out_splits=[3], in_splits=[4])
        got = [np.zeros(4, np.float32)]
        c.gather(got, x)
        c.all_to_all(got, [x + 1])
        assert got[0].tolist() == [1.0, 2.0, 3.0, 4.0] and c.messages == 0
