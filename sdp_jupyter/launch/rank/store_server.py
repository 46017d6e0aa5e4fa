"""`python -m sdp_jupyter.launch.rank.worker --module sdp_jupyter.launch.rank.store_server ADDR PORT`:
an interactive session's TCPStore, served from a process of its own so that any rank, rank 0 included,
can die and be started again (launch/host/session_store.py starts it). Prints "ready" once it
listens; ends at EOF on stdin, or with its launcher (the worker's parent-death signal).
"""
from __future__ import annotations

import sys


def main() -> int:
    import torch.distributed as dist

    addr, port = sys.argv[1], int(sys.argv[2])
    store = dist.TCPStore(addr, port, None, True, wait_for_workers=False)  # noqa: F841 - serves while held
    print("ready", flush=True)
    sys.stdin.read()  # EOF: the launcher is done with the session
    return 0


if __name__ == "__main__":
    sys.exit(main())
