"""Rank functions for tests/torch/test_compiled.py: PyTorch 2's compiled recipes on one backend."""
from __future__ import annotations


def _model():
    import torch

    torch.manual_seed(0)
    # 1.3 M parameters (5 MB): several 1 MB DDP buckets, so dynamo's DDPOptimizer splits the graph
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                               torch.nn.ReLU(), torch.nn.Linear(1024, 8))


def _train(wrapped, model, compile_backend: str, steps: int = 3):
    import torch
    import torch.distributed as dist

    compiled = torch.compile(wrapped, backend=compile_backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(compiled(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def compiled_recipes(backend: str, compile_backend: str) -> dict:
    """torch.compile over stock DDP (graph split by DDPOptimizer, and not split), over our DDP wrapper, and
    functional collectives inside a compiled function: each recipe's final weights (or outputs)."""
    import torch
    import torch._dynamo
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.nn.parallel import DistributedDataParallel as DDP

    if backend == "smddp":
        import sdp_jupyter.torch  # noqa: F401  registers the backend
    dist.init_process_group(backend)
    out = {}
    model = _model()
    out["stock DDP, graph split"] = _train(DDP(model, bucket_cap_mb=1), model, compile_backend)
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = False
    model = _model()
    out["stock DDP, one graph"] = _train(DDP(model, bucket_cap_mb=1), model, compile_backend)
    torch._dynamo.config.optimize_ddp = True
    torch._dynamo.reset()
    from sdp_jupyter.torch import DistributedDataParallel as OurDDP

    model = _model()
    out["our DDP wrapper"] = _train(OurDDP(model), model, compile_backend)
    torch._dynamo.reset()

    @torch.compile(backend=compile_backend)
    def step(x):
        return funcol.all_reduce(x * 2 + 1, "sum", dist.group.WORLD).sin()

    rank = dist.get_rank()
    out["functional all_reduce in a compiled function"] = [step(torch.ones(8) * (rank + 1)),
                                                           step(torch.arange(8.0) + rank)]
    out.update(_sharded_recipes(compile_backend))
    dist.destroy_process_group()
    return out


def _sharded_recipes(compile_backend: str) -> dict:
    """torch.compile over FSDP2 (fully_shard per layer and the root) and over a tensor-parallel model
    (ColwiseParallel, RowwiseParallel) on a 1-D mesh of every rank: the full weights after 3 steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for recipe in ("compiled FSDP2", "compiled tensor parallel"):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        if recipe == "compiled FSDP2":
            for layer in (model[0], model[2], model):
                fully_shard(layer, mesh=mesh)
            seed = dist.get_rank()  # data parallel: each rank its own batch
        else:
            parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
            seed = 0  # tensor parallel: every rank the same batch
        compiled = torch.compile(model, backend=compile_backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(seed)
        for _ in range(3):
            x, y = torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)
            opt.zero_grad()
            torch.nn.functional.mse_loss(compiled(x), y).backward()
            opt.step()
        out[recipe] = [p.full_tensor().detach().clone() for p in model.parameters()]
    return out
