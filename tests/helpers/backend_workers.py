"""Rank functions for the smddp backend's torch-integration tests (run by tests/helpers/ranks.py with
this folder on PYTHONPATH). Each returns plain values the test compares across backends."""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist

import sdp_jupyter.torch  # noqa: F401 - registers smddp


def _init(backend: str) -> tuple[int, int]:
    dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def ops(backend: str):
    """Every collective torch.distributed offers on CPU, through its public API."""
    rank, world = _init(backend)
    out: dict = {}
    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    g = [torch.empty(6) for _ in range(world)] if rank == 0 else None
    dist.gather(x, g, dst=0)
    out["gather"] = [t.tolist() for t in g] if g else None
    s = torch.empty(3)
    dist.scatter(s, [torch.full((3,), float(r + 1)) for r in range(world)] if rank == 1 else None, src=1)
    out["scatter"] = s.tolist()
    o = torch.empty(2 * world)
    dist.all_to_all_single(o, torch.arange(2 * world, dtype=torch.float32) + 100 * rank)
    out["all_to_all_single"] = o.tolist()
    if backend == "smddp":  # in place: the output is the input (checked here; gloo's is not compared)
        ip = torch.arange(2 * world, dtype=torch.float32) + 100 * rank
        dist.all_to_all_single(ip, ip)
        assert ip.tolist() == [float(2 * rank + k + 100 * j) for j in range(world) for k in range(2)], ip
    outs = [torch.empty(2, dtype=torch.int64) for _ in range(world)]
    dist.all_to_all(outs, [torch.tensor([rank, r]) for r in range(world)])
    out["all_to_all"] = [t.tolist() for t in outs]
    lists = [[torch.empty(2), torch.empty(1, 3)] for _ in range(world)]
    dist.all_gather_coalesced(lists, [torch.ones(2) * rank, torch.ones(1, 3) * (rank + 5)])
    out["all_gather_coalesced"] = [[t.tolist() for t in li] for li in lists]
    rs = torch.empty(2)
    dist.reduce_scatter_tensor(rs, torch.arange(2 * world, dtype=torch.float32) * (rank + 1))
    out["reduce_scatter_tensor"] = rs.tolist()
    ag = torch.empty(3 * world)
    dist.all_gather_into_tensor(ag, torch.full((3,), float(rank)))
    out["all_gather_into_tensor"] = ag.tolist()
    objs = [None]
    dist.scatter_object_list(objs, [{"to": r} for r in range(world)] if rank == 0 else None, src=0)
    out["scatter_object_list"] = objs[0]
    got = [None] * world if rank == 0 else None
    dist.gather_object({"from": rank}, got, dst=0)
    out["gather_object"] = got
    c = torch.tensor([1.0 + rank, -1.0], dtype=torch.complex64)
    dist.all_reduce(c)
    out["complex_all_reduce"] = [complex(v) for v in c.tolist()]
    out.update(_big_blocks(rank, world, backend))
    dist.destroy_process_group()
    return out


def _big_blocks(rank: int, world: int, backend: str) -> dict:
    """gather, scatter and all_to_all_single of odd sizes that span many of the engine's chunks
    (the test sets SDP_CHUNK_BYTES small): lists that are one buffer and lists that are not, every
    element checked through a position-weighted sum; on smddp also a non-contiguous output (gloo
    aborts the process on one), checked against the expected values."""
    def check(t):
        t = t.reshape(-1).to(torch.float64)
        return float((t * torch.arange(1, t.numel() + 1, dtype=torch.float64)).sum())
    from sdp_jupyter.comm import _live
    out = {}
    messages0 = sum(c.messages for c in list(_live))
    read0 = sum(c.stats()["peer_read_bytes"] for c in list(_live)) if backend == "smddp" else 0
    n = 20011  # above the 64 KiB one-barrier path in float64 and float32: the chunked path
    big = torch.arange(n, dtype=torch.float64) * (rank + 1) + rank
    separate = [torch.empty(n, dtype=torch.float64) for _ in range(world)] if rank == 0 else None
    dist.gather(big, separate, dst=0)
    one = torch.empty(world, n, dtype=torch.float64)
    dist.gather(big, list(one.unbind(0)) if rank == world - 1 else None, dst=world - 1)
    out["big_gather"] = ([check(t) for t in separate] if separate else None,
                         check(one) if rank == world - 1 else None)
    whole = torch.arange(world * n, dtype=torch.float32) + 0.5
    s = torch.empty(n, dtype=torch.float32)
    dist.scatter(s, list(whole.chunk(world)) if rank == 0 else None, src=0)
    out["big_scatter"] = check(s)
    if backend == "smddp":
        cols = torch.empty(2, n, dtype=torch.float32).t()  # non-contiguous; the root's pieces not one buffer
        dist.scatter(cols, [torch.full((n, 2), float(r)) + torch.arange(n).unsqueeze(1) for r in range(world)]
                     if rank == world - 1 else None, src=world - 1)
        assert torch.equal(cols, torch.full((n, 2), float(rank)) + torch.arange(n).unsqueeze(1)), cols
    m = 1001
    inp = torch.arange(world * m * 3, dtype=torch.int32).reshape(world * m, 3) + 100000 * rank
    a2a = torch.empty(world * m, 3, dtype=torch.int32)
    dist.all_to_all_single(a2a, inp)
    out["big_all_to_all_single"] = check(a2a)
    if backend == "smddp":  # the path taken: the engine within one node, messages across nodes
        out["messages"] = sum(c.messages for c in list(_live)) - messages0
        out["peer_read_bytes"] = sum(c.stats()["peer_read_bytes"] for c in list(_live)) - read0
    return out


def split_all_to_all():
    """all_to_all_single with equal blocks in a group of several nodes: the blocks between ranks of
    one node through the engine (large ones read from the peer's memory), the others as messages,
    both at once. Checks every element (block d of rank r's input holds 1e6 * r + 1e3 * d + i) and
    returns what the split took: messages posted and bytes read from peers, per call."""
    from sdp_jupyter.comm import _live
    rank, world = _init("smddp")
    comms = list(_live)
    out = {}
    for name, per_block in (("small", 5), ("large", 1 << 17)):  # 20 B and 512 KiB of float32 per block
        inp = torch.cat([torch.arange(per_block, dtype=torch.float32) + 1e6 * rank + 1e3 * d for d in range(world)])
        got = torch.full((world * per_block,), -1.0)
        messages0 = sum(c.messages for c in comms)
        read0 = sum(c.stats()["peer_read_bytes"] for c in comms)
        dist.all_to_all_single(got, inp)
        want = torch.cat([torch.arange(per_block, dtype=torch.float32) + 1e6 * d + 1e3 * rank for d in range(world)])
        out[name] = {"equal": bool(torch.equal(got, want)),
                     "messages": sum(c.messages for c in comms) - messages0,
                     "peer_read_bytes": sum(c.stats()["peer_read_bytes"] for c in comms) - read0}
    dist.destroy_process_group()
    return out


def split_gather_scatter():
    """gather and scatter in a group of several nodes, root 0 and the last rank (scatter: the blocks
    between ranks of the root's node through the engine, large ones read from the root's memory,
    the others as messages; gather: all messages). Checks every element (rank r's block holds 1e6 * r + i) and returns, per
    call, the messages this rank posted and the bytes it read from peers."""
    from sdp_jupyter.comm import _live
    rank, world = _init("smddp")
    comms = list(_live)
    out = {}

    def taken(fn):
        messages0, read0 = sum(c.messages for c in comms), sum(c.stats()["peer_read_bytes"] for c in comms)
        equal = fn()
        return {"equal": equal, "messages": sum(c.messages for c in comms) - messages0,
                "peer_read_bytes": sum(c.stats()["peer_read_bytes"] for c in comms) - read0}
    for name, per_block in (("small", 5), ("large", 1 << 17)):  # 20 B and 512 KiB of float32 per block
        def block(r):
            return torch.arange(per_block, dtype=torch.float32) + 1e6 * r
        for root in (0, world - 1):
            def gather():
                got = [torch.full((per_block,), -1.0) for _ in range(world)] if rank == root else None
                dist.gather(block(rank), got, dst=root)
                return rank != root or all(torch.equal(got[r], block(r)) for r in range(world))

            def scatter():
                got = torch.full((per_block,), -1.0)
                dist.scatter(got, [block(r) for r in range(world)] if rank == root else None, src=root)
                return bool(torch.equal(got, block(rank)))
            out[f"gather_{name}_{root}"] = taken(gather)
            out[f"scatter_{name}_{root}"] = taken(scatter)
    dist.destroy_process_group()
    return out


def leader_leaves_first():
    """4 ranks, 2 per node: the last scatter comes from rank 3 (node 1), so node 0's ranks get their
    blocks as messages and need nothing of their leader. Rank 0 takes its block, shuts down its process
    group and exits; rank 1 calls the scatter 0.5 s later (its engine idle all that while, seeing the
    leader go). Then every rank still in the group needs the leader: rank 1's barrier names its goodbye."""
    rank, world = _init("smddp")
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)
    got = torch.full((4,), -1.0)
    dist.scatter(got, [torch.full((4,), float(r)) for r in range(world)] if rank == 3 else None, src=3)
    out = {"scatter": got.tolist()}
    if rank == 0:
        dist.destroy_process_group()
        return out
    try:
        dist.barrier()
        out["barrier"] = "passed"
    except Exception as exc:  # noqa: BLE001 - the message is the value compared
        out["barrier"] = f"{type(exc).__name__}: {exc}"
    return out


def parked_messages():
    """A 64 MiB message that arrives while its receiver has no receive from the sender posted stays
    in the socket (the send is not complete a second later) and lands in the receive once posted;
    a receive for a message behind a parked one, and a receive from any source, still get theirs."""
    rank, world = _init("smddp")
    out: dict = {}
    big = torch.arange(1 << 24, dtype=torch.float32)
    if rank == 0:
        w = dist.isend(big, 1, tag=1)
        time.sleep(1.0)
        out["sent_before_posted"] = w.is_completed()
        dist.barrier()  # rank 1 posts its receive after this
        w.wait()
        later = [dist.isend(big, 1, tag=2), dist.isend(torch.ones(4), 1, tag=3)]
        for h in later:
            h.wait()
        dist.send(big, 1, tag=4)
    else:
        time.sleep(1.0)
        dist.barrier()
        got = torch.empty_like(big)
        dist.recv(got, 0, tag=1)
        out["first"] = bool(torch.equal(got, big))
        small, got = torch.empty(4), torch.empty_like(big)
        dist.recv(small, 0, tag=3)  # the 64 MiB message of tag 2 comes first on the connection
        dist.recv(got, 0, tag=2)
        out["behind"] = small.tolist() == [1.0] * 4 and bool(torch.equal(got, big))
        got = torch.empty_like(big)
        out["any_source"] = [dist.recv(got, tag=4), bool(torch.equal(got, big))]
    dist.barrier()
    dist.destroy_process_group()
    return out


def messages(backend: str):
    """Point-to-point traffic and what rides on it, through torch's public API: values only (the
    test compares them with gloo's)."""
    rank, world = _init(backend)
    out: dict = {}
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    # send/recv in a ring, with two tags sent in one order and received in the other
    a, b = torch.full((4,), float(rank)), torch.full((2,), 100.0 + rank)
    ra, rb = torch.empty(4), torch.empty(2)
    reqs = [dist.isend(a, nxt, tag=1), dist.isend(b, nxt, tag=2)]
    dist.recv(rb, prv, tag=2)
    dist.recv(ra, prv, tag=1)
    for r in reqs:
        r.wait()
    out["ring"] = [ra.tolist(), rb.tolist()]
    # any source: rank 0 takes one message from every other rank, in whatever order they come
    if rank == 0:
        got = {}
        for _ in range(world - 1):
            t = torch.empty(3, dtype=torch.int64)
            src = dist.recv(t, tag=7)
            got[src] = t.tolist()
        out["any_source"] = sorted(got.items())
    else:
        dist.send(torch.tensor([rank, rank * 2, 7]), 0, tag=7)
    # batch_isend_irecv: both neighbours at once, fp16
    send_h = torch.arange(6, dtype=torch.float16).reshape(3, 2) + rank
    recv_h = torch.empty(3, 2, dtype=torch.float16)
    ops = [dist.P2POp(dist.isend, send_h, nxt), dist.P2POp(dist.irecv, recv_h, prv)]
    for r in dist.batch_isend_irecv(ops):
        r.wait()
    out["batch"] = recv_h.tolist()
    # uneven all_to_all_single: rank r sends r+1 rows to everyone
    ins = [r + 1 for r in range(world)]
    inp = torch.cat([torch.full((rank + 1, 2), float(10 * rank + d)) for d in range(world)])
    o = torch.empty(sum(ins), 2)
    dist.all_to_all_single(o, inp, output_split_sizes=ins, input_split_sizes=[rank + 1] * world)
    out["uneven_all_to_all"] = o.tolist()
    if backend == "smddp":  # gloo refuses all_to_all with tensors of different sizes
        outs = [torch.empty(r + 1) for r in range(world)]
        dist.all_to_all(outs, [torch.full((rank + 1,), float(rank * 10 + d)) for d in range(world)])
        out["all_to_all_sizes"] = [t.tolist() for t in outs]
    # sparse all_reduce (as gloo does it)
    sp = torch.sparse_coo_tensor(torch.tensor([[rank, 0]]), torch.tensor([1.0, 2.0]), (world,))
    dist.all_reduce(sp)
    out["sparse"] = sp.to_dense().tolist()
    objs = [None] * world
    dist.all_gather_object(objs, {"r": rank})
    out["objects"] = objs
    out.update(_big_messages(rank))
    dist.barrier()
    dist.destroy_process_group()
    return out


def _big_messages(rank: int) -> dict:
    """64 MiB messages from rank 0 to rank 1: one kept whole while a later one is received first,
    then one whose receive is most likely posted while it arrives (on smddp the rest then goes
    straight into the tensor); every element checked through a position-weighted sum."""
    n = 1 << 24

    def check(t):
        t = t.to(torch.float64)
        return float((t * torch.arange(1, t.numel() + 1, dtype=torch.float64)).sum())
    out = {}
    if rank == 0:
        works = [dist.isend(torch.arange(n, dtype=torch.float32), 1, tag=20), dist.isend(torch.tensor([5.0]), 1, tag=21)]
        for w in works:
            w.wait()
        third = torch.arange(n, dtype=torch.float32) * -1.5
        dist.barrier()
        dist.send(third, 1, tag=22)
    elif rank == 1:
        small, first, second = torch.empty(1), torch.empty(n), torch.empty(n)
        dist.recv(small, 0, tag=21)
        dist.recv(first, 0, tag=20)
        dist.barrier()
        time.sleep(0.003)  # rank 0 has begun to send (64 MiB take longer): the receive meets it half-way
        dist.recv(second, 0, tag=22)
        out["big_messages"] = [small.tolist(), check(first), check(second)]
    else:
        dist.barrier()
    return out


def message_failures():
    """What a failing message says: a size mismatch, a receive that times out, a peer that left."""
    rank, world = _init("smddp")
    out = {}
    if rank == 0:
        dist.send(torch.zeros(5), 1, tag=3)
    else:
        try:
            dist.recv(torch.zeros(4), 0, tag=3)
            out["mismatch"] = "no error"
        except Exception as exc:  # noqa: BLE001 - the test reads the message
            out["mismatch"] = f"{type(exc).__name__}: {exc}"
    # the same with 32 MiB, the receive posted while the message arrives
    dist.barrier()
    if rank == 0:
        dist.send(torch.zeros(1 << 23), 1, tag=4)
    else:
        time.sleep(0.002)
        try:
            dist.recv(torch.zeros((1 << 23) - 1), 0, tag=4)
            out["late_mismatch"] = "no error"
        except Exception as exc:  # noqa: BLE001
            out["late_mismatch"] = f"{type(exc).__name__}: {exc}"
    try:
        w = dist.irecv(torch.zeros(1), 1 - rank, tag=99)
        w.wait(datetime.timedelta(seconds=1))
        out["timeout"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["timeout"] = f"{type(exc).__name__}: {exc}"
        out["timeout_is_dist_backend_error"] = isinstance(exc, dist.DistBackendError)
    try:
        dist.monitored_barrier()
        out["monitored_barrier"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["monitored_barrier"] = f"{type(exc).__name__}: {exc}"
    # rank 1 leaves (after one message, so its connection to rank 0 exists); rank 0's next
    # receive from it fails naming it, well before the timeout
    if rank == 1:
        dist.send(torch.ones(1), 0, tag=4)
        dist.barrier()
        return out
    dist.recv(torch.zeros(1), 1, tag=4)
    dist.barrier()
    t0 = time.monotonic()
    try:
        dist.recv(torch.zeros(1), 1, tag=5)
        out["peer_left"] = "no error"
    except Exception as exc:  # noqa: BLE001
        out["peer_left"] = f"{type(exc).__name__}: {exc}"
    out["peer_left_s"] = time.monotonic() - t0
    return out


def functional_and_mesh(backend: str):
    """_resolve_process_group, functional collectives, a 1-D DeviceMesh and DTensor on the group."""
    from torch.distributed._functional_collectives import (all_gather_tensor, all_reduce, all_to_all_single,
                                                           broadcast, reduce_scatter_tensor)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    rank, world = _init(backend)
    pg = dist.group.WORLD
    out = {"resolves": _resolve_process_group(pg.group_name) is pg, "name": pg.group_name}
    t = torch.ones(4) * (rank + 1)
    out["fc_all_reduce"] = torch.as_tensor(all_reduce(t, "sum", pg)).tolist()
    out["fc_broadcast"] = torch.as_tensor(broadcast(t, 1, pg)).tolist()
    out["fc_all_to_all_single"] = torch.as_tensor(
        all_to_all_single(torch.arange(2.0 * world) + 10 * rank, None, None, pg)).tolist()
    out["fc_all_gather"] = torch.as_tensor(all_gather_tensor(t, 0, pg)).tolist()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    out["mesh_backend"] = dist.get_backend(mesh.get_group("dp"))
    full = torch.arange(4 * world, dtype=torch.float32).reshape(2 * world, 2)
    d = distribute_tensor(full, mesh, [Shard(0)])
    out["dtensor_local"] = d.to_local().tolist()
    out["dtensor_full"] = d.redistribute(mesh, [Replicate()]).to_local().tolist()
    part = DTensor.from_local(torch.arange(2.0 * world) * (rank + 1), mesh, [Partial()])
    out["dtensor_partial_to_shard"] = part.redistribute(mesh, [Shard(0)]).to_local().tolist()
    out["fc_reduce_scatter"] = torch.as_tensor(reduce_scatter_tensor(torch.arange(2.0 * world), "sum", 0, pg)).tolist()
    dist.destroy_process_group()
    return out


def mesh_2d(backend: str):
    """A 2-D (data x tensor) DeviceMesh: every sub-group is smddp and reduces over its own ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world = _init(backend)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for dim in ("dp", "tp"):
        grp = mesh.get_group(dim)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=grp)
        out[dim] = (dist.get_backend(grp), t.item(), dist.get_process_group_ranks(grp))
    dist.destroy_process_group()
    return out


def fsdp2(backend: str, steps: int = 4):
    """FSDP2: fully_shard per layer and on the root, AdamW; returns the full parameters."""
    from torch.distributed.fsdp import fully_shard

    rank, world = _init(backend)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                                torch.nn.GELU(), torch.nn.Linear(32, 3))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 3, generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    dist.destroy_process_group()
    return full


def timeout_error():
    """Rank 1 never joins the barrier: rank 0 must raise torch's DistBackendError with " Timed out "."""
    rank, world = _init("smddp")
    if rank == 1:
        time.sleep(float(os.environ["SDP_TIMEOUT"]) + 3)
        return None
    try:
        dist.barrier()
    except Exception as exc:  # noqa: BLE001 - the test reads the type
        return {"dist_backend_error": isinstance(exc, dist.DistBackendError),
                "smddp_error": isinstance(exc, sdp_jupyter.torch.SmddpError), "message": str(exc)}
    return {"dist_backend_error": False, "message": "no error"}


def subgroups_before_any_whole_group(delay_odd: float):
    """A tp x dp job's shape: the default group is gloo and the first smddp groups are the dp
    subgroups {0, 2} and {1, 3}, with no SDP_JOB_SECRET (the one-node secret file). The odd ranks
    come late, after {0, 2} is connected, so the file must outlive that subgroup's set-up."""
    rank, world = _init("gloo")
    if rank % 2:
        time.sleep(delay_odd)
    groups = [dist.new_group([r for r in range(world) if r % 2 == parity], backend="smddp") for parity in (0, 1)]
    mine = groups[rank % 2]
    t = torch.full((3,), float(rank))
    dist.all_reduce(t, group=mine)
    dist.barrier()  # on the default (gloo) group: rank 0 serves the store until everyone is done
    return t.tolist()


def device_ops(device: str):
    """smddp on tensors of `device` (CUDA ones are staged through pinned host memory): a DDP step, a
    message and an all_gather, every result back on that device. Compared by the test with one process."""
    rank, world = _init("smddp")
    dev = torch.device(device)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(dev)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    x = torch.arange(16 * 8, dtype=torch.float32, device=dev).reshape(16, 8) / 100
    rows = 16 // world
    ddp(x[rank * rows:(rank + 1) * rows]).square().sum().backward()
    grads = [p.grad.cpu().tolist() for p in model.parameters()]
    t = torch.full((3,), float(rank), device=dev)
    if rank == 0:
        dist.send(t + 10, 1)
    elif rank == 1:
        dist.recv(t, 0)
    g = [torch.empty(2, device=dev) for _ in range(world)]
    dist.all_gather(g, torch.full((2,), float(rank), device=dev))
    out = {"grads": grads, "msg": t.cpu().tolist(), "gather": [v.cpu().tolist() for v in g],
           "devices": sorted({str(v.device) for v in g + [t]})}
    dist.destroy_process_group()
    return out
