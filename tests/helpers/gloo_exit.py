"""torch's gloo can abort a rank in interpreter shutdown after its script ended: a reference run of a
plain torchrun + gloo + DDP script then exits non-zero although it trained (about 1 run in 15 on 2
busy cores; never in our own ranks, which leave through `fast_exit` without finalizing).

A core dump shows the race: a ProcessGroupGloo worker thread drops DDP's last AsyncAllreduceWork after
the main thread reached Py_FinalizeEx; the work's ThreadLocalState decrefs a Python object, taking the
GIL in a finalizing interpreter calls pthread_exit, and that unwind through a noexcept destructor is
"terminate called without an active exception" (SIGABRT, torchrun's "exitcode: -6").
"""
from __future__ import annotations


def aborted_at_exit(output: str) -> bool:
    """True when torchrun's output (stdout + stderr) shows a rank aborted by exactly that race. A
    caller excuses it only with the proof that the script had finished its collectives."""
    return "terminate called without an active exception" in output and "exitcode: -6" in output
