"""A training script written for SageMaker's data parallel library (docs/migration.md, path B).

It is the "before" and the "after": sdp_jupyter runs it unchanged. On SageMaker with AWS's library
the import below is AWS's smdistributed; in a local, SSH, Ray or Slurm job of sdp_jupyter it is
sdp_jupyter's stand-in, served by sdp_jupyter's engine.
"""
import argparse
import json
import os

import smdistributed.dataparallel.torch.torch_smddp  # noqa: F401  registers the "smddp" backend
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=5)        # hyperparameters arrive as --KEY VALUE
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--model-dir", default=os.environ["SM_MODEL_DIR"])  # SageMaker's environment
parser.add_argument("--hosts", type=json.loads, default=os.environ["SM_HOSTS"])
parser.add_argument("--current-host", default=os.environ["SM_CURRENT_HOST"])
parser.add_argument("--num-gpus", type=int, default=os.environ["SM_NUM_GPUS"])
args = parser.parse_args()

dist.init_process_group(backend="smddp")
rank, world = dist.get_rank(), dist.get_world_size()
local_rank = int(os.environ["LOCAL_RANK"])
device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(local_rank)
print(f"rank {rank} of {world} on {args.current_host} of {args.hosts}, {args.num_gpus} GPU(s) there")

# generated data, y = x @ w + noise; each rank trains on its own shard
gen = torch.Generator().manual_seed(0)
X = torch.randn(1024, 16, generator=gen)
Y = X @ torch.randn(16, 1, generator=gen) + 0.1 * torch.randn(1024, 1, generator=gen)
X_mine, Y_mine = X[rank::world].to(device), Y[rank::world].to(device)

torch.manual_seed(0)
model = DDP(torch.nn.Linear(16, 1).to(device))
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
for epoch in range(args.epochs):
    for i in range(0, len(X_mine), 32):
        loss = F.mse_loss(model(X_mine[i:i + 32]), Y_mine[i:i + 32])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if rank == 0:
        print(f"epoch {epoch + 1}: loss {loss.item():.4f}")

if rank == 0:  # SageMaker uploads what is in SM_MODEL_DIR as model.tar.gz
    torch.save(model.module.state_dict(), os.path.join(args.model_dir, "model.pt"))
dist.destroy_process_group()
