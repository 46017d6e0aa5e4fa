"""Makes `dist.init_process_group("smddp")` work without `import sdp_jupyter.torch`.

torch imports every entry point of the group "torch.backends" at `import torch`
(TORCH_DEVICE_BACKEND_AUTOLOAD=1, its default). Ours registers "smddp" with a creator that imports
the real backend only when a process group is actually created, so `import torch` stays as fast as
before. With TORCH_DEVICE_BACKEND_AUTOLOAD=0, `import sdp_jupyter.torch` registers it instead.
"""
from __future__ import annotations


def _create(store, rank, world_size, timeout):
    import sdp_jupyter.torch as backend

    return backend.create_process_group(store, rank, world_size, timeout)


def autoload() -> None:
    try:
        import torch.distributed as dist

        if dist.is_available() and "smddp" not in dist.Backend.backend_list:
            dist.Backend.register_backend("smddp", _create, devices=["cpu", "cuda"])
    except Exception:  # noqa: BLE001 - never break `import torch` for anyone
        pass
