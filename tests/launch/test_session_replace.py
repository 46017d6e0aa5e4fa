"""A session's rank that dies is started again and joins the process group in place
(launch/kernel/session.py, launch/rank/cell_loop.py): the others keep their variables, the failing
cell says what was lost, and the group works on the next cell with every rank."""
from __future__ import annotations

import os
import signal
import time

import pytest

from sdp_jupyter.launch import JobSpec
from sdp_jupyter.launch.kernel import session as sessions

SETUP = """
import os, signal, torch, torch.distributed as dist
import sdp_jupyter.checkpoint
rank = dist.get_rank()
kept = f"rank {rank} was here"
torch.manual_seed(rank)  # each rank's model differs until broadcast_state
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
model(torch.ones(1, 8)).sum().backward(); opt.step()
t = torch.ones(3) * rank
dist.all_reduce(t)
t.tolist()
"""

KILL = """
if rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
t = torch.ones(3)
dist.all_reduce(t)  # the others are inside it when rank 2 dies: it fails naming rank 2
"""

AFTER = """
import os, torch, torch.distributed as dist
import sdp_jupyter.checkpoint
if sdp_replaced:  # what only the new rank lost: rebuild it, then take rank 0's state
    rank = dist.get_rank()
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
sdp_jupyter.checkpoint.broadcast_state(model, opt)
t = torch.ones(3) * dist.get_rank()
dist.all_reduce(t)
(t.tolist(), dist.get_world_size(), globals().get("kept"), sdp_replaced, os.getpid(),
 model.weight.sum().item(), opt.state_dict()["state"][0]["momentum_buffer"].sum().item())
"""


def test_a_rank_killed_inside_a_cell_is_started_again_and_the_others_keep_their_variables(jobs_dir):
    s = sessions.Session.start(JobSpec(code="pass", nodes=4))
    try:
        first = s.run(SETUP, want="result")
        assert first.failed == [] and first.value(0) == [6.0] * 3, first.message()
        old_pids = {r: s.ready[r]["pid"] for r in range(4)}

        killed = s.run(KILL)
        text = killed.message()
        assert text.startswith("rank 2 died during the cell; it failed on ranks 0-1,3\n"
                               "rank 2 died:\nrank 2 (node 2, local rank 0) was killed by signal SIGKILL"), text
        assert "rank 2 was started again and joined the process group: every variable it had is gone" in text
        assert text.endswith("The session is still up."), text

        after = s.run(AFTER, want="gather")
        assert after.failed == [], after.message()
        values = {r: after.value(r) for r in range(4)}
        for r, (t, world, kept, replaced, pid, weight, momentum) in values.items():
            assert t == [6.0] * 3 and world == 4, values
            assert kept == (None if r == 2 else f"rank {r} was here"), values
            assert replaced is (r == 2) and (pid != old_pids[r]) is (r == 2), values
            assert (weight, momentum) == (values[0][5], values[0][6]), values  # rank 0's state everywhere
        status = s.status()
        assert [(x["rank"], x["cell"]) for x in status["replacements"]] == [(2, killed.n)], status
        assert status["replacements"][0]["pid"] == values[2][4] and "SIGKILL" in status["replacements"][0]["why"]
        assert s.job.status["replacements"][0]["rank"] == 2 and s.job.state == "running"
        assert f"rank 2 started again in cell {killed.n} (pid {values[2][4]}) after: rank 2 (node 2, local rank 0) was killed by signal " \
               "SIGKILL" in sessions.describe(status)  # %sdp_session status
        assert s.stop() == "succeeded"

        # rank 0 too: the session's store is a process of its own (launch/host/session_store.py)
        s = sessions.Session.start(JobSpec(code="pass", nodes=2))
        s.run("import torch, torch.distributed as dist\nkept = dist.get_rank() + 10")
        os.kill(s.ready[0]["pid"], signal.SIGKILL)
        time.sleep(0.5)  # killed between cells: the next cell finds it dead
        killed = s.run("x = 1")
        assert killed.message().startswith("rank 0 died during the cell"), killed.message()
        after = s.run("import torch, torch.distributed as dist\nt = torch.ones(2)\ndist.all_reduce(t)\n"
                      "(t.tolist(), globals().get('kept'), sdp_replaced)", want="gather")
        assert after.failed == [], after.message()
        assert [after.value(r) for r in range(2)] == [([2.0, 2.0], None, True), ([2.0, 2.0], 11, False)]
    finally:
        s.stop()


def test_a_rank_stopped_inside_a_cell_is_killed_and_started_again(jobs_dir, monkeypatch):
    """SIGSTOP: alive and silent, the rank would hold the others' all_reduce until SDP_TIMEOUT; it is
    killed after SDP_STOPPED_RANK_S and replaced like a rank that died."""
    monkeypatch.setenv("SDP_STOPPED_RANK_S", "2")
    s = sessions.Session.start(JobSpec(code="pass", nodes=2))
    try:
        s.run("import os, signal, torch, torch.distributed as dist\nkept = dist.get_rank() + 10")
        t0 = time.monotonic()
        stopped = s.run("if dist.get_rank() == 1:\n    os.kill(os.getpid(), signal.SIGSTOP)\n"
                        "dist.all_reduce(torch.ones(2))")
        text = stopped.message()
        assert time.monotonic() - t0 < 30, text
        assert text.startswith("rank 1 died during the cell"), text
        assert "was stopped by a signal (SIGSTOP) for 2 s: killed" in text, text
        after = s.run("import torch, torch.distributed as dist\nt = torch.ones(2)\ndist.all_reduce(t)\n"
                      "(t.tolist(), globals().get('kept'), sdp_replaced)", want="gather")
        assert after.failed == [], after.message()
        assert [after.value(r) for r in range(2)] == [([2.0, 2.0], 10, False), ([2.0, 2.0], None, True)]
    finally:
        s.stop()


def test_a_store_that_cannot_listen_says_why_at_once(tmp_path):
    """The job's own store process (sessions, --heal) on a port another process holds: ready() names its
    exit and the store's own error as soon as it ends, not a 60 s timeout."""
    import socket

    from sdp_jupyter.launch.host import session_store

    (tmp_path / "logs").mkdir()
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        started = time.monotonic()
        proc = session_store.start(tmp_path, "127.0.0.1", holder.getsockname()[1])
        with pytest.raises(RuntimeError) as err:
            session_store.ready(proc)
        assert time.monotonic() - started < session_store.READY_TIMEOUT / 2
    finally:
        holder.close()
    assert "ended (exit 1) before it listened" in str(err.value) and "address already in use" in str(err.value)
