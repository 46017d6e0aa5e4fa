"""%sdp_debug in a real ipykernel: a %%sdp_px cell fails on rank 1 only; pdb on rank 1, with its
commands given (-c) and typed into the frontend's input box (the kernel's stdin channel, as %debug
reads), shows the failed frame's local and its caller's argument; the next cell runs on both ranks
with every variable kept. A breakpoint() on rank 1 prompts in the input box and the cell goes on."""
from __future__ import annotations

import queue

import pytest

from conftest import wait_no_processes
from helpers.debug_cells import BREAKS_ON_1, FAILS_ON_1
from helpers.kernel import execute
from tools.executed import kernel_env

pytestmark = pytest.mark.slow

FAILS_CELL = "%%sdp_px\n" + FAILS_ON_1.lstrip("\n")


def _text(messages):
    return "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")


def _ok(kc, code, timeout=120):
    reply, messages = execute(kc, code, timeout=timeout)
    assert reply["status"] == "ok", (reply, _text(messages))
    return _text(messages)


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    from jupyter_client.manager import start_new_kernel

    jobs = tmp_path_factory.mktemp("debug-jobs")
    env = kernel_env()
    env["SDP_JOBS_DIR"] = str(jobs)
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(jobs))
    try:
        _ok(kc, "%load_ext sdp_jupyter")
        assert "2 ranks ready" in _ok(kc, "%sdp_session start --nodes 2 --backend gloo --name dbg", timeout=180)
        reply, messages = execute(kc, FAILS_CELL, timeout=120)
        assert reply["status"] == "error" and "rank 1 failed" in "\n".join(reply["traceback"]), reply
        yield km, kc, jobs
    finally:
        try:
            execute(kc, "%sdp_session stop", timeout=60)
        finally:
            kc.stop_channels()
            if km.is_alive():
                km.shutdown_kernel(now=True)
            wait_no_processes(jobs)


def test_sdp_debug_with_commands_prints_the_frame_and_its_caller_and_the_next_cell_runs_everywhere(kernel):
    km, kc, jobs = kernel
    out = _ok(kc, '%sdp_debug 1 -c "p secret" -c "up" -c "p v" -c "q"')
    assert "(Pdb) p secret\n's-21-1'\n" in out and "(Pdb) p v\n7\n" in out, out
    assert out.startswith("> <cell In[") and ")inner()\n-> raise ValueError" in out, out
    _ok(kc, "%%sdp_px --gather both\nkept")
    _ok(kc, "assert both == [10, 11], both")
    reply, messages = execute(kc, "%sdp_debug 0 -c 'p 1'")
    assert reply["status"] == "error" and "%sdp_debug 1" in reply["evalue"], reply


def _typing(kc, code, lines, allow_stdin=True):
    """Run `code`, answering each input request with the next of `lines` as a person would; (reply
    content, the prompts asked, the stream text). `allow_stdin=False`: a frontend without input."""
    typed = iter(lines)
    msg_id = kc.execute(code, allow_stdin=allow_stdin)
    prompts = []
    while True:
        try:
            request = kc.get_stdin_msg(timeout=0.2)
        except queue.Empty:
            request = None
        if request is not None:
            prompts.append(request["content"]["prompt"])
            kc.input(next(typed))
            continue
        try:
            reply = kc.get_shell_msg(timeout=0.2)
        except queue.Empty:
            continue
        if reply["parent_header"].get("msg_id") == msg_id:
            break
    messages = []
    while True:
        msg = kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return reply["content"], prompts, _text(messages)


def test_sdp_debug_reads_each_command_from_the_input_box(kernel):
    km, kc, jobs = kernel
    reply, prompts, out = _typing(kc, "%sdp_debug 1", ["p secret", "up", "p v", "q"])
    assert reply["status"] == "ok", reply
    assert prompts == ["(Pdb) "] * 4
    assert "post-mortem of cell In[" in out and "'s-21-1'" in out and "\n7\n" in out, out
    _ok(kc, "%%sdp_px --gather again\nkept * 2")
    _ok(kc, "assert again == [20, 22], again")


def test_breakpoint_in_a_cell_on_one_rank_prompts_in_the_notebook(kernel):
    km, kc, jobs = kernel
    reply, prompts, out = _typing(kc, "%%sdp_px --gather sums\n" + BREAKS_ON_1.lstrip("\n"), ["p local", "c"])
    assert reply["status"] == "ok", reply
    assert prompts == ["(Pdb) "] * 2 and "breakpoint() on rank 1 in cell In[" in out and "\n5\n" in out, out
    _ok(kc, "assert sums == [10.0, 10.0], sums")
    # a frontend that takes no input (a notebook run by nbclient, papermill): pdb goes on at once
    reply, prompts, out = _typing(kc, "%%sdp_px --gather sums\n" + BREAKS_ON_1.lstrip("\n"), [], allow_stdin=False)
    assert reply["status"] == "ok" and prompts == [], reply
    _ok(kc, "assert sums == [10.0, 10.0], sums")
