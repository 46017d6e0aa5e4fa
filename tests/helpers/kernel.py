"""Running code in a real ipykernel from a test: one request's reply and its iopub messages."""

import contextlib


def execute(kc, code, timeout=60):
    """Run code; return (reply content, iopub messages of this request)."""
    msg_id = kc.execute(code)
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    messages = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return reply["content"], messages


@contextlib.contextmanager
def sdp_kernel(jobs):
    """A real ipykernel with `%load_ext sdp_jupyter` done, its jobs under `jobs` (its cwd too); shut down
    at the end, and every process of its jobs waited for. Yields (kernel manager, client)."""
    from jupyter_client.manager import start_new_kernel

    from conftest import wait_no_processes
    from tools.executed import kernel_env

    env = kernel_env()
    env["SDP_JOBS_DIR"] = str(jobs)
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(jobs))
    try:
        reply, _ = execute(kc, "%load_ext sdp_jupyter")
        assert reply["status"] == "ok", reply
        yield km, kc
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
        wait_no_processes(jobs)
