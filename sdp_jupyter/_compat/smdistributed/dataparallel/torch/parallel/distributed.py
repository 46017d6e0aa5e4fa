"""`from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel`.

torch's DistributedDataParallel over the job's process group (smddp on sdp_jupyter's engine). On a
CPU-only machine `device_ids` naming a GPU is dropped, so a script written for GPUs still runs.
"""
from __future__ import annotations

import torch
from torch.nn.parallel import DistributedDataParallel as _TorchDDP


class DistributedDataParallel(_TorchDDP):
    def __init__(self, module, device_ids=None, output_device=None, broadcast_buffers=True,
                 process_group=None, bucket_cap_mb=None, **kwargs):
        on_cpu = all(p.device.type == "cpu" for p in module.parameters())
        if on_cpu or not torch.cuda.is_available():
            device_ids, output_device = None, None
        if bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = bucket_cap_mb
        super().__init__(module, device_ids=device_ids, output_device=output_device,
                         broadcast_buffers=broadcast_buffers, process_group=process_group, **kwargs)
