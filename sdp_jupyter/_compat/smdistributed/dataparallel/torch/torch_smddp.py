"""`import smdistributed.dataparallel.torch.torch_smddp` registers the "smddp" torch.distributed backend.

Then `torch.distributed.init_process_group(backend="smddp")` runs on sdp_jupyter's engine.
"""
import sdp_jupyter.torch  # noqa: F401  (registers the backend on import)
