"""Healing without a restart: a rank that dies costs its peers one redone step, not the job.

In a job started with `--heal --max-restarts K` (local, SSH, Ray or Slurm target), train through a `Healer`:

    from sdp_jupyter.heal import Healer
    healer = Healer(model, optimizer, wrap=lambda m: DistributedDataParallel(m))  # makes the process group
    for step in healer.steps(100):
        def train_step():
            optimizer.zero_grad()
            loss = loss_fn(healer.model(x_of(step)), y_of(step))  # healer.model: the wrapped model
            loss.backward()
            optimizer.step()
            return loss.item()
        loss = healer.run(train_step)

When a rank dies, the collectives of the others fail within milliseconds (the smddp engine names the
dead rank). Their processes go on: each waits for the launcher's next membership record (the launcher
saw the death), leaves the old process group, makes a new one of the ranks left, wraps the model again
and runs the step again with them (the members of a generation first meet on the job's store, so a
member that dies before it gets there sends the others to the next record at once). The launcher starts the dead rank again at once; that replacement
builds its model and optimizer, says it is ready, and joins at the next step boundary after the others
have formed their group: the launcher writes a record with it, every member makes the group again, and
the replacement receives the model's state, the optimizer's state, the step and `healer.state` from a
live peer by broadcast, never from disk.

The contract a step function keeps: every collective comes before the optimizer's step (DDP's
gradient all_reduce runs inside backward), so a step that failed changed no weights and can be run
again. Use `healer.model`, not a wrapped model kept from before: each membership change wraps it
anew. `dist.get_rank()` and `dist.get_world_size()` give the position in the current group, so a
data shard computed from them follows the membership; `healer.rank` is the job's rank, which never
changes. Replacements count against `--max-restarts`.

The records (jobdir.heal_record_path) are JSON files the launcher writes in the job directory:
{generation, members, joining, left}; `members` lists the ranks left first, in job order, then those
joining, so the group's rank 0 is always a rank that lived through the change. On a remote target each
host's agent writes them into its own job folder and sends back what the ranks write there (ready,
formed, finished; launch/kernel/agent_run/heal_channel.py), so a rank reads and writes files wherever it runs.
"""
from __future__ import annotations

import datetime
import gc
import os
import sys
import time
from typing import Any, Callable, Iterator

from sdp_jupyter import backends, jobdir
from sdp_jupyter._env import env_float, env_str

WAIT_S = 60.0  # how long a rank whose collective failed waits for the launcher's next record (SDP_HEAL_WAIT)
JOIN_WAIT_S = 600.0  # how long a replacement waits to be let in (a step boundary of the others)


class HealError(RuntimeError):
    """The job cannot heal: not a --heal job, or no membership record came in time."""


def refuse_own_groups() -> None:
    """In a --heal job (the worker calls this before the script runs): the script's own
    init_process_group, one without the store the Healer passes, fails at once naming the fix. It would
    clash with the group the Healer makes (rank 0 cannot listen on the port the job's store holds), and a
    replacement would wait there for peers that never come."""
    import functools

    import torch.distributed as dist

    init = dist.init_process_group
    if getattr(init, "_sdp_heal_guard", False):
        return

    @functools.wraps(init)
    def guarded(*args, **kwargs):
        if kwargs.get("store") is None:
            raise HealError("in a --heal job the Healer makes the process group, and makes it again at each "
                            "membership change. Fix: remove dist.init_process_group(...) from the script and "
                            "create Healer(model, optimizer, wrap=...) first (docs/failures.md)")
        return init(*args, **kwargs)

    guarded._sdp_heal_guard = True
    dist.init_process_group = guarded


class Healer:
    """The process group, the wrapped model and the step of a --heal job's rank; see the module's text."""

    def __init__(self, model, optimizer=None, *, wrap: Callable | None = None, state: dict | None = None,
                 backend: str | None = None):
        if not env_str("SDP_HEAL"):
            raise HealError("Healer needs a job started with --heal (its launcher keeps the membership "
                            "records and starts dead ranks again). Fix: %%sdp_train --heal --max-restarts 3 ...")
        import torch.distributed as dist

        self.job_dir = os.environ["SDP_JOB_DIR"]
        self.rank = int(os.environ["RANK"])  # the job's number for this rank: never changes
        self.backend = backend or backends.job_backend()
        if self.backend == "smddp":
            import sdp_jupyter.torch  # noqa: F401  registers the backend
        self.base, self.optimizer, self.wrap = model, optimizer, wrap
        self.model = model
        self.state: dict = dict(state or {})
        self.step = 0
        self.generation = -1
        self.members: list[int] = []
        self.joined = bool(env_str("SDP_HEAL_JOIN"))  # a replacement: it joins the others' group
        self.changes: list[dict] = []  # each membership change this rank went through: {generation, seconds, ...}
        self.wait_s = env_float("SDP_HEAL_WAIT", WAIT_S, min=0.1)
        self._store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None, False,
                                    timeout=datetime.timedelta(seconds=max(self.wait_s, 60.0)))
        if self.joined:
            jobdir.write_private(jobdir.heal_ready_path(self.job_dir, self.rank), str(os.getpid()))
            record = self._wait_record(JOIN_WAIT_S, lambda r: self.rank in r.get("joining", ()))
            if record is None:
                raise HealError(f"rank {self.rank} started again but was not let in within {JOIN_WAIT_S:g} s "
                                "(the other ranks reached no step boundary)")
            self._form(record, why="joined")
        else:
            record = self._newest()
            if record is None:
                raise HealError(f"no membership record in {self.job_dir}/{jobdir.HEAL}: was the job started "
                                "with --heal?")
            self._form(record, why=None)

    # ------------------------------------------------------------------ the loop
    def steps(self, total: int) -> Iterator[int]:
        """The step numbers from where this rank is (a replacement: where its peers are) to `total`."""
        while self.step < total:
            yield self.step

    def run(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run one step (`fn`) on the current members, at a step boundary first letting a replacement in;
        when a collective fails because a rank died, re-form without it and run the step again."""
        while True:
            newest = self._newest()
            if newest is not None:
                self._form(newest, why="boundary")
            try:
                out = fn(*args, **kwargs)
            except RuntimeError as e:  # torch's DistBackendError and the engine's errors are RuntimeErrors
                record = self._wait_record(self.wait_s)
                if record is None:
                    raise
                # the engine's own words, without what torch put before them (DDP's "Cannot extract
                # tensors from value: SmddpBackendError: ...")
                said = (str(e).splitlines() or [type(e).__name__])[0].rpartition("SmddpBackendError: ")[2]
                self._form(record, why=f"step {self.step} failed: {said[:300]}")
                continue
            self.step += 1
            return out

    def close(self) -> None:
        """The end of training: a replacement still waiting to be let in leaves (exit 0); then this rank
        leaves the process group."""
        jobdir.write_private(jobdir.heal_finished_path(self.job_dir), str(self.step))
        self._leave()

    def _check_finished(self) -> None:
        if self.joined and self.generation < 0 and jobdir.heal_finished_path(self.job_dir).exists():
            print(f"[sdp_jupyter.heal] rank {self.rank}: training ended before this replacement was let in; "
                  "it leaves", file=sys.stderr, flush=True)
            raise SystemExit(0)

    # ------------------------------------------------------------------ membership
    def _newest(self, after: int | None = None) -> dict | None:
        """The launcher's newest record after generation `after` (default: this rank's), None when there
        is none (the records are numbered without gaps): one stat per step while nothing changes."""
        return jobdir.newest_heal_record(self.job_dir, self.generation if after is None else after)

    def _wait_record(self, seconds: float, accept: Callable[[dict], bool] = lambda r: True,
                     after: int | None = None) -> dict | None:
        """The launcher's newest record after generation `after` (default: this rank's) once one is there
        that `accept`s; None after `seconds`."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._check_finished()
            record = self._newest(after)
            if record is not None and accept(record):
                return record
            time.sleep(0.005)
        return None

    def _leave(self) -> None:
        from sdp_jupyter.torch.generations import leave_every_group

        leave_every_group(self.backend)

    def _form(self, record: dict, why: str | None) -> None:
        """Make the group of `record`'s members (again), wrap the model anew and, with a replacement in
        it, send it the state from the group's rank 0 (a rank that lived through the change)."""
        from sdp_jupyter.torch.generations import make_default_group

        started = time.monotonic()
        while True:
            generation, members = int(record["generation"]), [int(r) for r in record["members"]]
            if self.rank not in members:
                raise HealError(f"rank {self.rank} is not a member of generation {generation} ({members})")
            self.model = self.base  # the old wrapper goes (its hooks hold the old group)
            gc.collect()
            self._leave()
            newer = self._arrive(generation, members)
            if newer is not None:  # a member died before it reached this generation: form the next one
                record = newer
                continue
            try:
                make_default_group(self.backend, self._store, "heal", generation, members.index(self.rank),
                                   len(members), timeout=datetime.timedelta(seconds=max(self.wait_s, 30.0)))
                joining = [int(r) for r in record.get("joining", ())]
                if joining:
                    self._share_state(receive=self.rank in joining)
                break
            except RuntimeError:  # a member died in the handshake or the state's broadcast: the next record
                self._check_finished()
                newer = self._wait_record(self.wait_s, after=generation)
                if newer is None:
                    raise
                record = newer
        self.generation, self.members = generation, members
        if self.wrap is not None:
            self.model = self.wrap(self.base)
        jobdir.write_private(jobdir.heal_formed_path(self.job_dir, generation, self.rank), str(os.getpid()))
        if why is not None:
            seconds = time.monotonic() - started
            self.changes.append({"generation": generation, "members": members, "step": self.step,
                                 "seconds": seconds, "why": why})
            left = ", ".join(f"rank {r}: {w}" for r, w in record.get("left", {}).items())
            print(f"[sdp_jupyter.heal] rank {self.rank}: generation {generation}, {len(members)} ranks "
                  f"{members} from step {self.step} ({why}; {seconds:.2f} s)" + (f"; left: {left}" if left else ""),
                  file=sys.stderr, flush=True)

    def _arrive(self, generation: int, members: list[int]) -> dict | None:
        """Say on the store that this rank reached `generation`'s formation and wait until every member
        has (None), or until the launcher writes a newer record (returned): a member that dies before it
        arrives costs the others milliseconds, where the handshake would wait for its timeout."""
        keys = [f"heal-arrived/{generation}/{m}" for m in members]
        self._store.set(keys[members.index(self.rank)], str(os.getpid()))
        waited = max(self.wait_s, 30.0)
        deadline = time.monotonic() + waited
        while not self._store.check(keys):
            newer = self._newest(after=generation)
            if newer is not None:
                return newer
            self._check_finished()
            if time.monotonic() > deadline:
                missing = [m for m, k in zip(members, keys) if not self._store.check([k])]
                raise HealError(f"rank {self.rank}: ranks {missing} did not reach generation {generation}'s "
                                f"group within {waited:g} s and the launcher wrote no newer membership")
            time.sleep(0.005)
        return None

    def _share_state(self, receive: bool) -> None:
        """The model's tensors, the optimizer's state, the step and `state`, from the group's rank 0."""
        import torch.distributed as dist

        for tensor in self.base.state_dict().values():
            dist.broadcast(tensor, 0)
        box = [None] if receive else [{"step": self.step, "state": self.state,
                                      "optimizer": self.optimizer.state_dict() if self.optimizer else None}]
        dist.broadcast_object_list(box, 0)
        if receive:
            self.step, self.state = int(box[0]["step"]), dict(box[0]["state"])
            if self.optimizer is not None and box[0]["optimizer"] is not None:
                self.optimizer.load_state_dict(box[0]["optimizer"])
