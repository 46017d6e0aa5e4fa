"""Many ranks read as one (sdp_jupyter/launch/kernel/rank_groups.py): identical lines merged with the ranks
they came from, failures grouped by identical exception and stack, and the job's error that says a rank
lost a peer only when its own last line says so. Pure functions: no processes."""
from __future__ import annotations

from sdp_jupyter.launch.kernel import rank_groups as rg


def merged(lines, ranks=None) -> list:
    """Lines already written, (rank, text) in arrival order, merged at once (the job or cell ended)."""
    m = rg.LineMerger(ranks if ranks is not None else {r for r, _ in lines})
    for rank, text in lines:
        m.add(rank, text)
    return m.flush()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def tb(message: str, line: int = 3, kind: str = "ValueError") -> str:
    return ("Traceback (most recent call last):\n"
            f'  File "/jobs/j/script.py", line {line}, in <module>\n'
            f"    raise {kind}({message!r})\n"
            f"{kind}: {message}\n")


def test_rank_sets_read_as_people_write_them():
    assert rg.span(range(8)) == "0-7"
    assert rg.span([6, 1, 3, 5]) == "1,3,5-6"
    assert rg.span([0, 2, 3, 4, 9, 10, 11, 15]) == "0,2-4,9-11,15"
    assert rg.label([3]) == "rank 3" and rg.label(range(16)) == "ranks 0-15"
    assert rg.prefixed({0, 1, 2, 3}, "epoch 1 done\n") == "[ranks 0-3] epoch 1 done\n"


def test_the_same_line_from_every_rank_is_one_line_and_own_lines_keep_their_rank():
    clock = Clock()
    m = rg.LineMerger(range(4), window=1.0, clock=clock)
    for r in range(4):
        m.add(r, "hello\n")
        m.add(r, f"I am rank {r}\n")
    # "hello" is complete; rank 0's own line too (every rank has a different line waiting: none can
    # join it); rank 1's waits, as rank 0 might still print it, until its window has passed
    assert m.ready() == [(frozenset(range(4)), "hello\n"), (frozenset({0}), "I am rank 0\n")]
    clock.t = 1.0
    assert m.ready() == [(frozenset({r}), f"I am rank {r}\n") for r in range(1, 4)]
    # a line some ranks have not printed yet waits for them, up to the window
    m.add(0, "step 1\n")
    m.add(2, "step 1\n")
    assert m.ready() == []
    clock.t = 1.5
    m.add(1, "step 1\n")
    assert m.ready() == []
    clock.t = 2.0
    assert m.ready() == [(frozenset({0, 1, 2}), "step 1\n")]


def test_the_same_traceback_merges_after_each_rank_s_own_lines():
    clock = Clock()
    m = rg.LineMerger(range(4), window=1.0, clock=clock)
    trace = tb("boom").splitlines(keepends=True)
    for r in (1, 3, 2):  # each rank's output comes in one piece: its own line, then its traceback
        for text in [f"I am rank {r}\n"] + trace:
            m.add(r, text)
    m.add(0, "I am rank 0\n")
    clock.t = 1.0
    out = [rg.prefixed(rs, t) for rs, t in m.ready()]
    assert out[:3] == ["[rank 1] I am rank 1\n", "[rank 3] I am rank 3\n", "[rank 2] I am rank 2\n"]
    assert out[3:] == [rg.prefixed({1, 2, 3}, t) for t in trace] + ["[rank 0] I am rank 0\n"]


def test_a_rank_s_lines_keep_their_order_and_a_late_rank_starts_a_new_group():
    clock = Clock()
    m = rg.LineMerger(range(2), window=1.0, clock=clock)
    m.add(0, "B\n")      # rank 0 prints B first
    m.add(1, "A\n")
    m.add(1, "B\n")      # rank 1's B must not print before its A: a group of its own, after A
    m.add(0, "A\n")      # rank 0's A: into the A group, which comes after its B
    m.add(1, "C\n")
    m.add(0, "C\n")
    m.add(0, "B\n")      # rank 0's second B: not into rank 1's B group (older than rank 0's C)
    out = m.flush()
    assert out == [(frozenset({0}), "B\n"), (frozenset({0, 1}), "A\n"), (frozenset({1}), "B\n"),
                   (frozenset({0, 1}), "C\n"), (frozenset({0}), "B\n")]
    for rank in (0, 1):  # each rank's lines in the order it wrote them
        assert [t for rs, t in out if rank in rs] == (["B\n", "A\n", "C\n", "B\n"] if rank == 0 else ["A\n", "B\n", "C\n"])
    # outside the window the same text is a new group (the next epoch's line, not this one's)
    m.add(0, "step\n")
    clock.t = 5.0
    m.add(1, "step\n")
    assert m.flush() == [(frozenset({0}), "step\n"), (frozenset({1}), "step\n")]


def test_a_repeated_line_of_one_rank_is_not_merged_with_itself():
    out = merged([(0, "x\n"), (0, "x\n"), (1, "x\n"), (1, "x\n")])
    assert out == [(frozenset({0, 1}), "x\n"), (frozenset({0, 1}), "x\n")]


def test_sixteen_ranks_printing_the_same_lines_read_as_one_column():
    lines = [(r, f"epoch {e} done\n") for e in range(3) for r in range(16)] + [(5, "rank 5 is slow\n")]
    out = merged(lines)
    assert [rg.prefixed(rs, t) for rs, t in out] == [f"[ranks 0-15] epoch {e} done\n" for e in range(3)] \
        + ["[rank 5] rank 5 is slow\n"]


def test_failures_are_grouped_by_identical_exception_and_stack():
    texts = {1: "rank 1 here\n" + tb("boom on a worker"), 2: "rank 2 here\n" + tb("boom on a worker"),
             3: tb("boom on a worker"), 4: tb("boom on a worker", line=9), 5: tb("other")}
    groups = rg.group_failures(texts)
    assert [g.ranks for g in groups] == [[1, 2, 3], [4], [5]]
    assert groups[0].headline() == "ranks 1-3 raised ValueError: boom on a worker"
    assert groups[0].text.count("Traceback") == 1
    assert rg.describe(groups) == ("ranks 1-3 raised ValueError: boom on a worker; rank 4 raised ValueError: "
                                   "boom on a worker; rank 5 raised ValueError: other")
    # a message over several lines is part of the exception; a chained one: the last traceback counts
    two = tb("first") + "\nDuring handling of the above exception, another exception occurred:\n\n" + tb("a\nb")
    assert rg.last_traceback(two)[1] == "ValueError: a\nb"
    # without a traceback (SystemExit's message) the rank "failed", saying its last line
    assert rg.group_failures({0: "step 1\nbye now\n"})[0].headline() == "rank 0 failed: bye now"
    assert rg.describe([{"ranks": [0, 4], "error": "", "kind": "lost a peer"}]) == "ranks 0,4 lost a peer"


class TailsJob:
    """What job_error reads of a job: its ranks' logs, and the status it records."""

    def __init__(self, tails: dict):
        self.tails, self.status = tails, {}
        self.dir = "/jobs/j"

    def logs(self, rank, tail=None):
        lines = self.tails.get(rank, "").splitlines(keepends=True)
        return "".join(lines[-tail:] if tail else lines)

    def update_status(self, **kw):
        self.status.update(kw)


LOST = "Traceback ...\nsdp_jupyter.torch.work.SmddpBackendError: rank 1 (node 1 at 10.0.0.3) shut down its process group\n"


def test_ranks_that_raised_the_same_error_are_one_group_never_a_cascade():
    from sdp_jupyter.launch.kernel.supervise import job_error

    job = TailsJob({r: f"own line {r}\n" + tb("boom on a worker") for r in (1, 2, 3)} | {0: LOST})
    error = job_error(job, [0, 2, 1, 3], [1, 1, 1, 1], lambda r: f"rank {r}", lambda r: "h")
    lines = error.splitlines()
    assert lines[0] == "ranks 1-3 raised ValueError: boom on a worker, each itself; the first to end:", error
    assert lines[1] == "rank 2 exited with code 1; its last lines:", error
    assert error.count("Traceback") == 1 and "own line 2" in error
    assert "(rank 0 failed too, after it: its collectives lost a peer." in error
    assert "ranks 1, 3" not in error and "rank(s)" not in error and "1-3 failed too" not in error
    assert job.status["first_failure"]["rank"] == 2
    assert rg.describe(job.status["failure_groups"]) == \
        "ranks 1-3 raised ValueError: boom on a worker; rank 0 lost a peer"


def test_a_rank_with_its_own_different_error_is_named_with_it_not_as_a_lost_peer():
    from sdp_jupyter.launch.kernel.supervise import job_error

    job = TailsJob({2: tb("bad batch"), 3: tb("'k'", kind="KeyError"), 0: LOST, 1: LOST})
    error = job_error(job, [0, 2, 3, 1], [1, 1, 1, 1, None], lambda r: f"rank {r}", lambda r: "h")
    assert error.startswith("rank 2 exited with code 1; its last lines:"), error  # one rank: as before
    assert "(also rank 3 raised KeyError: 'k': its own error. Its log is in the job's logs/.)" in error
    assert "(ranks 0-1 failed too, after it: their collectives lost a peer." in error
    # a rank killed by a signal is grouped by the signal, not by whatever it printed last
    job = TailsJob({2: tb("bad batch"), 3: "step 4\n", 4: "step 5\n"})
    error = job_error(job, [2, 3, 4], [0, 0, 1, -9, -9], lambda r: f"rank {r}", lambda r: "h")
    assert "(also ranks 3-4 was killed by signal SIGKILL: each its own." in error, error


def test_the_stream_writes_by_ranks_output():
    lines = [(r, "same\n") for r in range(3)] + [(1, "own\n")]

    def written(mode, world=3):
        stream = rg.Stream(world, mode)
        for rank, text in lines:
            stream.add(rank, text)
        return stream.take(final=True)

    assert written("all") == "[ranks 0-2] same\n[rank 1] own\n"
    assert written("raw") == "[rank 0] same\n[rank 1] same\n[rank 2] same\n[rank 1] own\n"  # never merged
    assert written("0") == "same\n"  # rank 0's lines alone, as they are
    assert written("all", world=1) == "same\nsame\nsame\nown\n"  # one rank: no labels
    raw = rg.Stream(2, "raw")  # raw lines go out at once, not after a window
    raw.add(1, "x\n")
    assert raw.take() == "[rank 1] x\n"
