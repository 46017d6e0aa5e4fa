"""Session cells for the debugger's tests (tests/launch/test_session_debug.py and
tests/notebook/test_session_debug_kernel.py): one that fails on rank 1 only, in `inner` called from
`outer(v)`, and one that stops at a breakpoint() on rank 1 before an all_reduce of 5 from each rank."""

FAILS_ON_1 = """
import torch.distributed as dist
kept = 10 + dist.get_rank()

def inner(x):
    secret = f"s-{x}-{dist.get_rank()}"
    if dist.get_rank() == 1:
        raise ValueError("only rank 1 fails")
    return secret

def outer(v):
    return inner(v * 3)

outer(7)
"""

BREAKS_ON_1 = """
import torch, torch.distributed as dist
def g(a):
    local = a + 1
    if dist.get_rank() == 1:
        breakpoint()
    t = torch.ones(1) * local
    dist.all_reduce(t)
    return t.item()
g(4)
"""
