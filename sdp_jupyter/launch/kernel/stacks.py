"""Every rank's Python stack, read from faulthandler's text (docs/failures.md, "Where is every rank?").

One parser of faulthandler's dumps for the kernel: a live rank's on request (Job.stacks(): each node's
agent signals its ranks, launch/host/rank_stacks.py, which write with launch/rank/stack_signal.py) and a
crashed rank's in its log (rank_report.crash_summary). Ranks whose stacks are equal are one group, and
each group says where it is: the innermost frame of the user's code, and the collective it waits in.

    found = job.stacks()
    found.where(3)   # 'in stuck_in_data_loading() at script.py:5'
    print(found)     # ranks 0-2: in torch.distributed.all_reduce(), from <module>() at script.py:9 ...
"""
from __future__ import annotations

import html
import json
import os
import re
from dataclasses import dataclass, field

FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
_THREAD = re.compile(r"^(?P<current>Current thread|Thread) (?P<id>0x[0-9a-fA-F]+) \(most recent call first\):")
_STACK = "Stack (most recent call first):"  # faulthandler's header when it dumps one thread
_HEADER = "# sdp-stacks "  # launch/rank/stack_signal.py's first line: {pid, main, library}
DEFAULT_WAIT = 5.0  # seconds Job.stacks() waits for every rank's answer


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    @property
    def short(self) -> str:
        """`stuck_in_data_loading() at script.py:5`."""
        return f"{self.func}() at {self.file.replace(chr(92), '/').rsplit('/', 1)[-1]}:{self.line}"


@dataclass
class Thread:
    ident: int | None  # None: a dump of one thread, or frames without a header (a log cut short)
    current: bool = False  # the thread that took the signal (or crashed)
    frames: list[Frame] = field(default_factory=list)  # innermost first, as faulthandler writes them


def parse(text: str) -> list[Thread]:
    """faulthandler's dump(s) in `text` as threads, in the order written; other lines are skipped."""
    threads: list[Thread] = []
    block: Thread | None = None
    for line in text.splitlines():
        head = _THREAD.match(line)
        if head:
            block = Thread(int(head.group("id"), 16), head.group("current") == "Current thread")
            threads.append(block)
            continue
        if line.startswith(_STACK):
            block = Thread(None, True)
            threads.append(block)
            continue
        m = FRAME.match(line)
        if m:
            if block is None:
                block = Thread(None)
                threads.append(block)
            block.frames.append(Frame(m.group("file"), int(m.group("line")), m.group("func")))
        elif not line.strip():
            block = None  # a blank line ends a thread's block
    return threads


def collective(frames: list[Frame]) -> str | None:
    """The collective a stack is in: the torch.distributed call if there is one, else the outermost call
    of sdp_jupyter's numpy face (sdp_jupyter.comm: all_reduce rather than the wait it called)."""
    comm = None
    for f in frames:
        path = f.file.replace("\\", "/")
        if path.endswith("torch/distributed/distributed_c10d.py") and not f.func.startswith("_") \
                and f.func != "wrapper":
            return f"torch.distributed.{f.func}"
        if "/sdp_jupyter/comm/" in path and not f.func.startswith("_"):  # communicator, routing, work
            comm = f"sdp_jupyter.comm {f.func}"
    return comm


def where(frames: list[Frame], library: list[str]) -> str:
    """Where a stack is, in words: its innermost frame of the user's code (a frame outside `library`,
    the rank's standard library, site-packages and sdp_jupyter) and the collective it waits in."""
    user = next((f for f in frames if _mine(f, library)), None)
    call = collective(frames)
    if call and user:
        return f"in {call}(), from {user.short}"
    if call:
        return f"in {call}()"
    if user:
        return f"in {user.short}"
    return f"in {frames[0].short}" if frames else "in C code (no Python frame)"


@dataclass
class RankStack:
    """One rank's answer: its threads (the main thread first) and where its main thread is; or `error`."""
    rank: int
    threads: list[Thread] = field(default_factory=list)
    where: str = ""
    error: str | None = None

    def key(self) -> tuple:
        """What equal stacks share: every thread's frames, thread ids aside."""
        return tuple(tuple(t.frames) for t in self.threads) if self.error is None else ("error", self.error)


def rank_stack(rank: int, dump: str, job_dir: str | None = None) -> RankStack:
    """A rank's stacks file's new part (its header line first, then one faulthandler dump) as a RankStack;
    the frames of files in the rank's job folder shown in `job_dir` (the kernel's copy of the job)."""
    head, _, body = dump.partition("\n")
    info = json.loads(head[len(_HEADER):]) if head.startswith(_HEADER) else {}
    theirs = info.get("job_dir")
    if theirs and job_dir:
        body = body.replace(f'File "{theirs}', f'File "{os.path.join(str(job_dir), "")}')
    threads = [t for t in parse(body) if t.frames]
    try:
        main = int(str(info.get("main")), 16)
    except ValueError:
        main = None
    # faulthandler lists the newest thread first, so the main thread (the oldest) is last without a header
    first = next((t for t in threads if t.ident == main), threads[-1] if threads else None)
    ordered = ([first] if first else []) + [t for t in threads if t is not first]
    if not ordered:
        return RankStack(rank, [], "in C code (no Python frame)")
    library = list(info.get("library") or [])
    first.frames = _trimmed(first.frames, library)
    return RankStack(rank, ordered, where(first.frames, library))


def _mine(f: Frame, library: list[str]) -> bool:
    """Whether a frame is the user's code: outside the rank's library folders (launch/rank/stack_signal.py)."""
    return not f.file.startswith(tuple(library)) and not f.file.startswith("<frozen")


def _trimmed(frames: list[Frame], library: list[str]) -> list[Frame]:
    """A main thread's frames without the launcher's below the user's outermost (the worker, runpy), as a
    rank's traceback is trimmed (bootstrap.user_frames)."""
    outer = max((i for i, f in enumerate(frames) if _mine(f, library)), default=None)
    return frames if outer is None else frames[:outer + 1]


def _label(ranks: list[int]) -> str:
    from sdp_jupyter.launch.kernel.rank_groups import label

    return label(ranks)


class Stacks:
    """Every rank's stack at one moment (Job.stacks()): `ranks` {rank: RankStack}, `groups` [(ranks, RankStack)]
    with equal stacks together (lowest rank first), `where(rank)`; printed, each group's stacks."""

    def __init__(self, job_name: str, ranks: dict[int, RankStack], seconds: float):
        self.job_name, self.ranks, self.seconds = job_name, dict(sorted(ranks.items())), seconds
        groups: dict[tuple, list[int]] = {}
        for r, st in self.ranks.items():
            groups.setdefault(st.key(), []).append(r)
        self.groups = [(members, self.ranks[members[0]]) for members in groups.values()]

    def where(self, rank: int) -> str:
        st = self.ranks[rank]
        return st.error if st.error is not None else st.where

    def text(self) -> str:
        lines = [f"job {self.job_name}: {len(self.ranks)} rank(s), {len(self.groups)} distinct stack(s), "
                 f"asked in {self.seconds:.2f} s (most recent call first)"]
        for members, st in self.groups:
            if st.error is not None:
                lines.append(f"{_label(members)}: no stack: {st.error}")
                continue
            lines.append(f"{_label(members)}: {st.where}")
            for i, t in enumerate(st.threads):
                lines.append("  main thread:" if i == 0 else "  another thread:")
                lines += [f'    File "{f.file}", line {f.line} in {f.func}' for f in t.frames]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()

    def __repr__(self) -> str:
        return f"<Stacks of job {self.job_name}: " + "; ".join(
            f"{_label(m)} {self.where(m[0])}" for m, _ in self.groups) + ">"

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.text())}</pre>"

    def _repr_pretty_(self, p, cycle):  # IPython in a terminal
        p.text(self.text())


def gather(run, job_dir, ranks: list[int] | None = None, wait: float = DEFAULT_WAIT) -> Stacks:
    """Ask `run` (the supervisor of the job in `job_dir`: launch/kernel/agent_run/rank_requests.py) for `ranks`'
    stacks (None: every rank) and read its answers."""
    import time

    t0 = time.monotonic()
    dumps, errors = run.request_stacks(ranks, wait)
    found = {r: rank_stack(r, text, str(job_dir)) for r, text in dumps.items()}
    found.update({r: RankStack(r, error=why) for r, why in errors.items()})
    return Stacks(os.path.basename(str(job_dir)), found, time.monotonic() - t0)


def of_job(job, ranks: list[int] | None, wait: float, JobError=RuntimeError) -> Stacks:
    """Job.stacks(): a running job's, asked of its run; else `JobError` (Job's, passed in: job.py imports this
    module) naming why not and what to read instead."""
    run = job.supervisor
    if job.done or job.state not in ("pending", "running"):
        raise JobError(f"job {job.name} is {job.state}: only a running job's ranks have stacks to show; a rank that "
                       f"crashed left its stacks in its log (job.logs(rank)), a hang its flight recorder (job.flight())",
                       job)
    if run is None or not hasattr(run, "request_stacks"):
        where = "in another process" if run is None else "on a target without node agents (SageMaker)"
        raise JobError(f"job {job.name} runs {where}: its ranks' stacks are asked of the node agents of the "
                       "kernel that started it", job)
    bad = [r for r in ranks or [] if not 0 <= int(r) < job.world_size]
    if bad:
        raise ValueError(f"stacks(ranks={ranks}): job {job.name} has ranks 0-{job.world_size - 1}")
    return gather(run, job.dir, list(range(job.world_size)) if ranks is None else [int(r) for r in ranks], wait)
