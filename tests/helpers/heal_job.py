"""A --heal job's training script and what every target's heal test checks of its run (tests/launch)."""
from __future__ import annotations

import pickle
import re
import textwrap
from pathlib import Path

HEAL_JOB = textwrap.dedent("""
    import os, signal, time
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from sdp_jupyter.heal import Healer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(512, 16, generator=g); Y = X[:, :1] * 2 - X[:, 1:2]
    if os.environ.get("SECOND") == os.environ["RANK"] and not os.environ.get("SDP_HEAL_JOIN"):
        import sdp_jupyter.torch.generations as G
        leave, calls = G.leave_every_group, []

        def leave_then_die(backend):  # its second leave begins generation 1's formation: it dies there
            calls.append(backend)
            if len(calls) == 2:
                time.sleep(1.5)  # the survivors wait in that formation by now
                os.kill(os.getpid(), signal.SIGKILL)
            leave(backend)
        G.leave_every_group = leave_then_die
    healer = Healer(model, opt, wrap=lambda m: DDP(m))
    print("start", healer.rank, os.getpid(), "joined" if healer.joined else "first", healer.step, flush=True)
    for step in healer.steps(100):
        def train_step():
            if step == 20 and healer.rank == int(os.environ["DIES"]) and not healer.joined:
                os.kill(os.getpid(), getattr(signal, os.environ["SIG"]))  # mid-step, inside the script
            r, w = dist.get_rank(), dist.get_world_size()
            idx = torch.arange(step * 32 + r, step * 32 + 32, w) % 512
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(healer.model(X[idx]), Y[idx])
            loss.backward()
            opt.step()
        healer.run(train_step)
        if step > 20 and len(healer.members) < 4:
            time.sleep(0.25)  # leave the replacement (a cold interpreter) time to start before the end
    loss = torch.nn.functional.mse_loss(model(X), Y).item()
    print("end", healer.rank, os.getpid(), repr(loss), [c["generation"] for c in healer.changes], flush=True)
    healer.close()
    loss  # the job's result: saved by a rank that lived through every change (rank 1 when rank 0 died)
""")


def heal_lines(job_dir, world: int) -> dict:
    """Each rank's "start ..." and "end ..." lines, split into words."""
    lines: dict = {}
    for rank in range(world):
        for line in (Path(job_dir) / "logs" / f"rank-{rank}.log").read_text().splitlines():
            if line.startswith(("start ", "end ")):
                lines.setdefault(rank, []).append(line.split())
    return lines


def check_remote_heal(out: dict, world: int, dies: int, host: str = r"\S+") -> None:
    """A remote --heal job's driver line `out` (helpers/remote_jobs.py): rank `dies` on `host` died in
    step 20 and was started again there; the others kept their processes through both membership
    changes, the replacement joined at a later step boundary, every rank ended with the same weights,
    and the result is the first survivor's. `host`: a pattern where the target chooses the hosts."""
    assert out.get("state") == "succeeded", out
    lines = heal_lines(out["dir"], world)
    survivors = [r for r in range(world) if r != dies]
    for rank in survivors:  # one process from start to end, two membership changes
        (start, end) = lines[rank]
        assert start[2] == end[2] and start[3] == "first" and end[-2:] == ["[1,", "2]"], lines[rank]
    first, joined, _ = lines[dies]
    assert first[3] == "first" and joined[3] == "joined" and 20 < int(joined[4]) < 100, lines[dies]
    assert len({lines[r][-1][3] for r in range(world)}) == 1, lines  # the same model on every host at the end
    result = pickle.load(open(Path(out["dir"]) / "result.pkl", "rb"))  # saved by the first survivor
    assert repr(result) == lines[survivors[0]][-1][3]
    heals = out["status"]["heals"]
    assert [h["members"] for h in heals] == [list(range(world)), survivors, survivors + [dies]], heals
    log = (Path(out["dir"]) / "logs" / f"rank-{survivors[0]}.log").read_text()
    said = re.search(rf"heal 1 of 2: rank {dies} \(node {dies} on host ({host}), local rank 0\) was killed by "
                     rf"signal SIGKILL.*; the {world - 1} ranks left go on \(generation 1\); rank {dies} started "
                     r"again \(on host (\S+)\) joins them", log)
    assert said and said.group(1) == said.group(2), log  # started again where it ran
