"""torch.compile and this backend: our process group and its work objects run as they are, never traced.

Under torch.compile, dynamo intercepts every Python frame called while a compiled function runs (after
a graph break, DDP's own calls into the process group among them) and tries to compile it. A gloo or
NCCL group's methods are C++, so dynamo never sees inside them; ours are Python, on a subclass of
`dist.ProcessGroup`, which torch registers as an opaque type with a handful of members (size, rank,
...). Tracing `broadcast` then stopped at its first private attribute: "UnsafeScriptObjectError:
Attempted to access unregistered member on an OpaqueObject" (issue 59). There is nothing in a
collective's Python for a graph to gain, so each method's code is marked SKIP for itself and for
every frame it calls, exactly as a C++ method behaves: it runs eagerly, with the engine, and the
compiled code around it is untouched.

This uses the frame-evaluation hook of torch's C extension (what torch._dynamo's own `skip_code` sets),
not torch._dynamo itself, whose import costs seconds a rank.
"""
from __future__ import annotations


def run_eagerly(*classes) -> None:
    """Mark every function defined in `classes` (methods, static and class methods, properties) so that
    torch.compile neither traces it nor anything it calls."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
    except ImportError:  # a torch without dynamo's frame hook: nothing would trace them
        return
    skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    for cls in classes:
        for member in vars(cls).values():
            parts = (member.fget, member.fset, member.fdel) if isinstance(member, property) else \
                (getattr(member, "__func__", member),)
            for fn in parts:
                code = getattr(fn, "__code__", None)
                if code is not None:
                    set_code_exec_strategy(code, skip)
