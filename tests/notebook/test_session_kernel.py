"""Interactive sessions in a real ipykernel: %sdp_session and %%sdp_px as a person uses them.

One kernel for the module: a 4-rank local session trains a DDP model cell by cell and must end with
the weights of one %%sdp_train job doing the same steps; a cell that raises on one rank, and a
cell interrupted with the kernel's interrupt, each leave the session usable; stop leaves nothing,
nor does killing the kernel.
"""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from conftest import wait_no_processes, worker_processes
from helpers.kernel import execute, sdp_kernel
from tools.executed import kernel_env

pytestmark = pytest.mark.slow

SETUP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
g = torch.Generator().manual_seed(1)
X, Y = torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)

def epoch():
    r, w = dist.get_rank(), dist.get_world_size()
    for i in range(0, 64, 16):
        xb, yb = X[i:i + 16][r::w], Y[i:i + 16][r::w]
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()
"""
EPOCH = "epoch()\n"
NEW_LR = "for group in opt.param_groups:\n    group['lr'] = 0.05\n"
WEIGHTS = "[p.detach().reshape(-1).tolist() for p in model.parameters()]\n"


def _ok(kc, code, timeout=120):
    reply, messages = execute(kc, code, timeout=timeout)
    assert reply["status"] == "ok", (reply, _text(messages))
    return _text(messages)


def _text(messages):
    return "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")


def _error(reply):
    return "\n".join(reply.get("traceback") or []) + reply.get("evalue", "")


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    jobs = tmp_path_factory.mktemp("session-jobs")
    with sdp_kernel(jobs) as (km, kc):
        yield km, kc, jobs


def test_a_session_trains_cell_by_cell_like_one_job(kernel):
    km, kc, jobs = kernel
    out = _ok(kc, "%sdp_session start --nodes 4 --name sess-train", timeout=180)
    assert "4 ranks ready" in out, out
    _ok(kc, "%%sdp_px\n" + SETUP)
    _ok(kc, "%%sdp_px\n" + EPOCH)
    _ok(kc, "%%sdp_px\n" + NEW_LR)
    _ok(kc, "%%sdp_px --result w_session\n" + EPOCH + WEIGHTS)
    # a variable defined in one cell is there in the next; --gather brings every rank's value
    _ok(kc, "%%sdp_px --gather lrs\nopt.param_groups[0]['lr'], dist.get_rank()")
    _ok(kc, "assert lrs == [(0.05, r) for r in range(4)], lrs")
    job_code = SETUP + EPOCH + NEW_LR + EPOCH + WEIGHTS
    _ok(kc, "%%sdp_train --nodes 4 --wait --init-process-group --result w_job\n" + job_code, timeout=180)
    _ok(kc, "assert w_session == w_job, (w_session, w_job)")
    status = _ok(kc, "st = %sdp_session status\nprint(repr(st))")
    assert "running, 4 ranks" in status and status.count("MiB resident") == 4, status


def test_an_exception_on_one_rank_names_it_and_the_session_goes_on(kernel):
    km, kc, jobs = kernel
    reply, messages = execute(kc, "%%sdp_px\nif dist.get_rank() == 2:\n    raise ValueError('rank two is bad')\n"
                                  "t = torch.ones(3)\ndist.all_reduce(t)\n", timeout=120)
    assert reply["status"] == "error"
    text = _error(reply)
    assert "the cell failed on ranks 0-3" in text and "rank 2 failed" in text and "ValueError: rank two is bad" in text, text
    # the cause first; the others (one line per distinct error: ranks whose errors are the same share it)
    others = re.search(r"ranks? 0[-,0-9]* failed: (.*)", text)
    assert others and text.index("rank 2 failed") < others.start(), text
    assert "rank 2" in others.group(1), text  # the others name who left
    assert "process group reconnected" in text and "still up" in text, text
    # the engine works again, and so does the DDP model built before the failure
    _ok(kc, "%%sdp_px --gather sums\nt = torch.ones(3) * (dist.get_rank() + 1)\ndist.all_reduce(t)\nepoch()\n"
            "t.tolist()")
    _ok(kc, "assert sums == [[10.0] * 3] * 4, sums")


def test_the_kernels_interrupt_stops_the_cell_on_every_rank_and_keeps_the_session(kernel):
    km, kc, jobs = kernel
    timer = threading.Timer(2.0, km.interrupt_kernel)
    timer.start()
    started = time.monotonic()
    reply, messages = execute(kc, "%%sdp_px\nimport time\nwhile True:\n    time.sleep(0.05)\n", timeout=60)
    timer.join()
    assert reply["status"] == "error"
    assert time.monotonic() - started < 10
    text = _error(reply)
    assert "interrupted on ranks 0-3" in text and "KeyboardInterrupt" in text, text
    out = _ok(kc, "%%sdp_px --ranks 1,3 --gather pair\nt = torch.ones(1)\ndist.all_reduce(t, group=sdp_group)\n"
                  "print('in the pair', flush=True)\nt.item()")
    # the line both ranks printed shows once, with the ranks it came from
    assert "[ranks 1,3] in the pair" in out and "[rank 0]" not in out, out
    _ok(kc, "assert pair == [None, 2.0, None, 2.0], pair")


def test_a_rank_killed_inside_a_cell_is_started_again_and_the_others_keep_their_variables(kernel):
    km, kc, jobs = kernel
    reply, _ = execute(kc, "%%sdp_px\nimport os, signal\nif dist.get_rank() == 2:\n    os.kill(os.getpid(), "
                           "signal.SIGKILL)\ndist.all_reduce(torch.ones(1))\n", timeout=120)
    text = _error(reply)
    assert reply["status"] == "error" and "rank 2 died during the cell" in text, text
    assert "every variable it had is gone (the other ranks kept theirs)" in text and "still up" in text, text
    # the pair's group of the last test was dropped everywhere (the new rank has none) and is made again
    _ok(kc, "%%sdp_px --gather after\nimport torch, torch.distributed as dist\nt = torch.ones(1)\n"
            "dist.all_reduce(t)\n(t.item(), 'opt' in globals(), sdp_replaced)")
    _ok(kc, "assert after == [(4.0, r != 2, r == 2) for r in range(4)], after")
    _ok(kc, "%%sdp_px --ranks 1,3\nt = torch.ones(1)\ndist.all_reduce(t, group=sdp_group)\nassert t.item() == 2")
    assert "rank 2 started again in cell" in _ok(kc, "st = %sdp_session status\nprint(repr(st))")


def test_stop_and_a_killed_kernel_leave_nothing(kernel, tmp_path):
    from jupyter_client.manager import start_new_kernel

    import psutil

    km, kc, jobs = kernel
    # the session's ranks by pid: a rank started again from the warm pool (the last test) is a fork of
    # the pool's server, whose /proc environ does not name the job
    out = _ok(kc, "from sdp_jupyter.launch.kernel import session as _s\nprint(sorted(r['pid'] for r in "
                  "_s.current().ready.values()))")
    pids = [int(p) for p in out.strip().strip("[]").split(",")]
    assert len(pids) == 4 and all(psutil.pid_exists(p) for p in pids), pids
    out = _ok(kc, "%sdp_session stop")
    assert "succeeded" in out, out
    assert wait_no_processes(jobs) == []
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    reply, _ = execute(kc, "%%sdp_px\nx = 1\n")
    assert reply["status"] == "error" and "no session is running" in _error(reply)

    env = kernel_env()
    env["SDP_JOBS_DIR"] = str(tmp_path)
    km2, kc2 = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    try:
        _ok(kc2, "%load_ext sdp_jupyter")
        _ok(kc2, "%sdp_session start --nodes 2 --backend gloo", timeout=180)
        _ok(kc2, "%%sdp_px\nx = 1\n")
        assert len(worker_processes(tmp_path)) == 2
        os.kill(km2.provisioner.pid, signal.SIGKILL)
        assert wait_no_processes(tmp_path) == []
    finally:
        kc2.stop_channels()
        if km2.is_alive():
            km2.shutdown_kernel(now=True)
