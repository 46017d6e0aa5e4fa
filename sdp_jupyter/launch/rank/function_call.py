"""The rank's side of `sdp_jupyter.run(fn)` (launch/kernel/run_function.py): the job's script is
`SCRIPT`, run like any job's after the default process group is made (--init-process-group), with
the call pushed by value under `CALL`. Every rank calls `fn(*args, **kwargs)`; rank 0 gathers the
return values over the job's own process group and returns them in rank order, as the script's last
expression: the job's result (result.pkl), which every target already brings back to the notebook.
"""
from __future__ import annotations

CALL = "_sdp_run_call"
SCRIPT = ("from sdp_jupyter.launch.rank.function_call import call as _sdp_call\n"
          "_sdp_call(globals())\n")


def call(namespace: dict):
    """Call the pushed function on this rank; on rank 0, the list of every rank's return value."""
    fn, args, kwargs = namespace.pop(CALL)
    namespace.pop("_sdp_call", None)  # the script's own name: not the user's
    value = fn(*args, **kwargs)
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [value]
    import cloudpickle

    # each value pickled here by cloudpickle: an instance of a class the notebook sent by value would
    # not survive gather_object's plain pickle
    mine = cloudpickle.dumps(value)
    rank = dist.get_rank()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    return [cloudpickle.loads(data) for data in gathered] if rank == 0 else None
