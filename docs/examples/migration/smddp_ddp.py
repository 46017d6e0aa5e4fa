"""After: the same script on the smddp backend (docs/migration.md, path A).

    sdp-train --nodes 2 smddp_ddp.py --steps 40

or, from a notebook, sdp_jupyter.launch("smddp_ddp.py", nodes=2, args=["--steps", "40"]).
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()

dist.init_process_group("smddp")  # the launcher sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as torchrun does
rank, world = dist.get_rank(), dist.get_world_size()

# generated data, y = x @ w + noise; each rank trains on its own shard
gen = torch.Generator().manual_seed(0)
X = torch.randn(1024, 16, generator=gen)
Y = X @ torch.randn(16, 1, generator=gen) + 0.1 * torch.randn(1024, 1, generator=gen)
X_mine, Y_mine = X[rank::world], Y[rank::world]

torch.manual_seed(0)  # the same initial weights on every rank
model = DDP(torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
with torch.no_grad():
    first = F.mse_loss(model.module(X), Y).item()
for step in range(args.steps):
    i = step * 32 % len(X_mine)
    loss = F.mse_loss(model(X_mine[i:i + 32]), Y_mine[i:i + 32])
    opt.zero_grad()
    loss.backward()  # the gradients are averaged across the ranks here
    opt.step()
with torch.no_grad():
    last = F.mse_loss(model.module(X), Y).item()

if rank == 0:
    print(f"loss on all the data: {first:.6f} before, {last:.6f} after {args.steps} steps on {world} ranks")
dist.destroy_process_group()
{"first": first, "last": last}  # rank 0's last expression: the job's result (job.result() in the notebook)
