"""Rank functions for the engine tests of blocks and messages (gather, scatter, all_to_all within and
across nodes; receives reading their own connection), run by helpers/ranks.py like engine_workers."""
from __future__ import annotations

import time

import numpy as np

from sdp_jupyter import comm


def node_blocks(n: int):
    """One node: gather (to the last rank), scatter (from rank 0) and all_to_all of n float64 per
    block through the engine itself; the values and the bytes read straight from peers' memory."""
    c = comm.init()
    w, r = c.world_size, c.rank
    try:
        mine = np.arange(n, dtype=np.float64) + 1000.0 * r
        blocks = [np.zeros(n) for _ in range(w)] if r == w - 1 else []
        c.submit(comm.COLLS["gather"], mine.ctypes.data, n, comm.DTYPES["float64"], root=w - 1, keepalive=blocks,
                 blocks=[b.ctypes.data for b in blocks]).wait()
        pieces = [np.full(n, 7.0 * k) + np.arange(n) for k in range(w)] if r == 0 else []
        got = np.zeros(n)
        c.submit(comm.COLLS["scatter"], got.ctypes.data, n, comm.DTYPES["float64"], root=0, keepalive=pieces,
                 blocks=[p.ctypes.data for p in pieces]).wait()
        src = np.arange(w * n, dtype=np.float64) + 1e6 * r
        out = np.zeros(w * n)
        c.submit(comm.COLLS["all_to_all"], out.ctypes.data, n, comm.DTYPES["float64"], keepalive=src,
                 src=src.ctypes.data).wait()
        return {"gather": [b.tolist() for b in blocks], "scatter": got.tolist(), "all_to_all": out.tolist(),
                "peer_read_bytes": c.stats()["peer_read_bytes"]}
    finally:
        comm.shutdown()


def mismatch_gather_scatter(coll: str):
    """The last rank gathers/scatters 12-element blocks, the others 10: every rank must raise."""
    c = comm.init(timeout=20)
    n = 12 if c.rank == c.world_size - 1 else 10
    try:
        if coll == "all_gather":
            c.all_gather(np.zeros(n * c.world_size, dtype=np.float32), np.ones(n, dtype=np.float32))
        else:
            c.reduce_scatter(np.zeros(n, dtype=np.float32), np.ones(n * c.world_size, dtype=np.float32))
    except comm.SmddpError as exc:
        return str(exc)
    finally:
        comm.shutdown()
    return "no error"


def message_readers():
    """A receive from one rank reads that rank's connection itself (mailbox.cpp, wait_reading):
    what it does not want is left for others, the I/O thread reads the connection again once the
    receive is done, and a shutdown from another thread ends a receive that is reading."""
    import threading

    c = comm.init(timeout=30)
    out = {}
    peer = 1 - c.rank
    if c.rank == 0:
        c.send(np.arange(5, dtype=np.int64), 1, tag=2)   # arrives before the receive that wants it
        c.send(np.arange(3, dtype=np.int64), 1, tag=1)
        c.barrier()
        c.send(np.full(4, 7, dtype=np.int64), 1, tag=3)  # nobody waits: the I/O thread reads it
        c.barrier()
    else:
        a, b = np.zeros(3, dtype=np.int64), np.zeros(5, dtype=np.int64)
        c.recv(a, 0, tag=1)  # reads the tag-2 message first and keeps it
        w = c.recv(b, 0, tag=2, async_op=True)
        out["kept"] = [a.tolist(), bool(w.is_completed()), b.tolist()]
        w.wait()
        late = np.zeros(4, dtype=np.int64)
        lw = c.recv(late, 0, tag=3, async_op=True)
        c.barrier()
        t0 = time.monotonic()
        while not lw.is_completed() and time.monotonic() - t0 < 10:
            time.sleep(0.01)
        out["io_thread_took_it_back"] = [bool(lw.is_completed()), late.tolist()]
        lw.wait()
        c.barrier()
    # every rank: a receive that nothing will ever match, ended by a shutdown from another thread
    box = {}

    def waiting():
        t = time.monotonic()
        try:
            c.recv(np.zeros(1), peer, tag=99)
            box["error"] = "no error"
        except comm.SmddpError as exc:
            box["error"] = str(exc)
        box["after"] = time.monotonic() - t

    th = threading.Thread(target=waiting)
    th.start()
    # One outcome per rank, not a race: rank 0 shuts down 0.5 s into its wait (its own shutdown ends its
    # receive); rank 1 shuts down only once its receive has ended, which rank 0 closing its connection
    # does. (Both shutting down at once, either event could reach a rank first.)
    if c.rank == 0:
        time.sleep(0.5)
    else:
        th.join(10)
    t0 = time.monotonic()
    comm.shutdown()
    out["shutdown_s"] = time.monotonic() - t0
    th.join(10)
    out["waiting"] = box
    return out


def routed_blocks(sizes):
    """gather, scatter (list and flat forms, roots 0 and last), all_to_all_single (equal, in place,
    uneven) and all_to_all (lists of any sizes) through the numpy face, routed by topology. Per case:
    whether every element is right, and the messages this rank posted and the bytes it read
    straight from peers' memory (the route taken)."""
    c = comm.init(timeout=60)
    w, r = c.world_size, c.rank
    out: dict = {"node_of_rank": list(c.node_of_rank)}

    def taken(name, fn):
        m0, p0 = c.messages, c.stats()["peer_read_bytes"]
        out[name] = {"equal": bool(fn()), "messages": c.messages - m0,
                     "peer_read_bytes": c.stats()["peer_read_bytes"] - p0}

    def block(k, n):
        return np.arange(n, dtype=np.float32) + 1e6 * k

    try:
        for n in sizes:
            for root in (0, w - 1):
                def gather(flat=False):
                    if r != root:
                        return c.gather(None, block(r, n), root=root) is None
                    got = np.full(w * n, -1, np.float32) if flat else [np.full(n, -1, np.float32) for _ in range(w)]
                    c.gather(got, block(r, n), root=root, async_op=True).wait()
                    return np.array_equal(np.concatenate(got) if not flat else got,
                                          np.concatenate([block(k, n) for k in range(w)]))

                def scatter(flat=False):
                    got = np.full(n, -1, np.float32)
                    ins = None
                    if r == root:
                        ins = [block(k, n) for k in range(w)]
                        ins = np.concatenate(ins) if flat else ins
                    c.scatter(got, ins, root=root)
                    return np.array_equal(got, block(r, n))
                taken(f"gather_{n}_{root}", gather)
                taken(f"gather_flat_{n}_{root}", lambda: gather(True))
                taken(f"scatter_{n}_{root}", scatter)
                taken(f"scatter_flat_{n}_{root}", lambda: scatter(True))

            def inp(k):  # block d of rank k's input: 1e6 * k + 1e3 * d + i
                return np.concatenate([np.arange(n, dtype=np.float32) + 1e6 * k + 1e3 * d for d in range(w)])
            want = np.concatenate([np.arange(n, dtype=np.float32) + 1e6 * d + 1e3 * r for d in range(w)])

            def a2a():
                got = np.full(w * n, -1, np.float32)
                c.all_to_all_single(got, inp(r))
                return np.array_equal(got, want)

            def a2a_in_place():
                buf = inp(r)
                c.all_to_all_single(buf, buf)
                return np.array_equal(buf, want)
            taken(f"all_to_all_single_{n}", a2a)
            taken(f"all_to_all_single_in_place_{n}", a2a_in_place)

        def uneven():  # rank k sends d + 1 rows of 2 to rank d, each row 10 * k + d
            src = np.concatenate([np.full((d + 1, 2), 10.0 * r + d) for d in range(w)])
            got = np.full(((r + 1) * w, 2), -1.0)
            c.all_to_all_single(got, src, out_splits=[r + 1] * w, in_splits=[d + 1 for d in range(w)])
            return np.array_equal(got, np.concatenate([np.full((r + 1, 2), 10.0 * k + r) for k in range(w)]))

        def lists():  # rank k sends rank d an int64 array of k + 2 d + 1 elements
            ins = [np.full(r + 2 * d + 1, 100 * r + d, np.int64) for d in range(w)]
            outs = [np.zeros(k + 2 * r + 1, np.int64) for k in range(w)]
            c.all_to_all(outs, ins)
            return all(np.array_equal(o, np.full(k + 2 * r + 1, 100 * k + r)) for k, o in enumerate(outs))
        taken("all_to_all_single_uneven", uneven)
        taken("all_to_all_lists", lists)
        return out
    finally:
        comm.shutdown()
