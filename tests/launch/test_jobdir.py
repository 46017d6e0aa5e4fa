"""The job directory's contract (sdp_jupyter/jobdir.py): its names, the one JSON-lines tailer and
the one mirror writer, which the reader, the agent, the SageMaker entry and job and the agent run use."""
from __future__ import annotations

import io
import json
import os
import stat
import threading

import pytest

from sdp_jupyter import jobdir


def _line(i: int, **more) -> bytes:
    return json.dumps({"t": float(i), "kind": "step", "rank": 0, "step": i, **more}).encode() + b"\n"


# ---------------------------------------------------------------- names

def test_every_metrics_name_is_made_and_recognised_here(tmp_path):
    assert jobdir.rank_metrics_path(tmp_path, 3) == tmp_path / "metrics" / "rank-3.jsonl"
    assert jobdir.node_metrics_path(tmp_path, 1) == tmp_path / "metrics" / "system-node-1.jsonl"
    for path in (jobdir.rank_metrics_path(tmp_path, 12), jobdir.node_metrics_path(tmp_path, 0)):
        assert jobdir.is_metrics_name(path.name)
    # what an agent may send is a name, never a path or another file
    for name in ("../rank-0.jsonl", "rank-0.jsonl/x", "rank-a.jsonl", "status.json", "rank-0.jsonl.tmp", ""):
        assert not jobdir.is_metrics_name(name)
    (tmp_path / "metrics").mkdir()
    for path in (jobdir.node_metrics_path(tmp_path, 0), jobdir.rank_metrics_path(tmp_path, 1),
                 jobdir.rank_metrics_path(tmp_path, 0)):
        path.write_text("")
    assert [p.name for p in jobdir.metrics_paths(tmp_path)] == ["rank-0.jsonl", "rank-1.jsonl", "system-node-0.jsonl"]
    assert [p.name for p in jobdir.metrics_paths(tmp_path, ranks_only=True)] == ["rank-0.jsonl", "rank-1.jsonl"]
    assert jobdir.log_path(tmp_path, 2).relative_to(tmp_path).as_posix() == "logs/rank-2.log"
    assert jobdir.host_log_path(tmp_path, 0).name == "algo-1.log"  # SageMaker's hosts count from 1


def test_the_sagemaker_names_are_the_job_directorys():
    from sdp_jupyter.launch.targets.sagemaker.options import REQUEST_FILE, SOURCE_DIR
    from sdp_jupyter.launch.targets.sagemaker import rehearse

    assert SOURCE_DIR == jobdir.SAGEMAKER_SOURCE and SOURCE_DIR in jobdir.KNOWN_ENTRIES
    assert REQUEST_FILE == jobdir.SAGEMAKER_REQUEST and rehearse.REHEARSAL_DIR == jobdir.REHEARSAL


# ---------------------------------------------------------------- the tailer

def test_tail_reads_at_most_read_cap_bytes_a_call(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    path.write_bytes(b"".join(_line(i) for i in range(100)))
    size = path.stat().st_size
    tail = jobdir.JsonLinesTail(path, read_cap=256)
    got, reads = [], 0
    while True:
        before = tail.offset
        got += tail.read()
        reads += 1
        assert tail.offset - before <= 256
        if not tail.behind:
            break
    assert reads == -(-size // 256)
    assert [json.loads(x)["step"] for x in got] == list(range(100))
    # drain() is the same bounded reads until caught up
    again = jobdir.JsonLinesTail(path, read_cap=256)
    assert again.drain() == got and not again.behind


def test_tail_keeps_a_partial_line_until_its_newline(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    whole = _line(1)
    path.write_bytes(_line(0) + whole[:10])
    tail = jobdir.JsonLinesTail(path)
    assert [r["step"] for r in tail.records()] == [0]
    assert tail.records() == []  # nothing new: the half line waits
    with open(path, "ab") as f:
        f.write(whole[10:] + _line(2)[:5])
    assert [r["step"] for r in tail.records()] == [1]
    # its writer has ended: a last line without a newline counts as it is (here: cut, so bad)
    assert tail.records(final=True) == [] and tail.bad == 1


def test_tail_final_keeps_a_whole_unterminated_line(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    path.write_bytes(_line(0) + _line(1).rstrip(b"\n"))
    tail = jobdir.JsonLinesTail(path, read_cap=7)  # final applies once the file is read to its end
    assert [r["step"] for r in tail.records(final=True)] == [0, 1] and tail.bad == 0


def test_tail_starts_over_when_the_file_shrinks_or_is_replaced(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    path.write_bytes(_line(0) + _line(1))
    tail = jobdir.JsonLinesTail(path)
    assert [r["step"] for r in tail.records()] == [0, 1]
    path.write_bytes(_line(7))  # truncated and rewritten (shorter than what was read)
    assert [r["step"] for r in tail.records()] == [7]
    rotated = tmp_path / "new.jsonl"
    rotated.write_bytes(_line(8) + _line(9))
    os.replace(rotated, path)  # replaced by another file (another inode), even if it is longer
    assert [r["step"] for r in tail.records()] == [8, 9]
    path.unlink()
    assert tail.records() == [] and not tail.behind  # gone: nothing, no error


def test_tail_skips_and_counts_bad_lines(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    path.write_bytes(_line(0) + b"not json\n" + b"[1, 2]\n" + b"\n   \n" + b"\x00\x00{\"t\n" + b"[" * 100_000 + b"\n"
                     + _line(1))
    tail = jobdir.JsonLinesTail(path)
    assert [r["step"] for r in tail.records()] == [0, 1]
    assert tail.bad == 4  # blank lines are not bad; deep nesting is (RecursionError), never raised


def test_tail_drops_an_over_long_line_without_holding_it(tmp_path):
    path = tmp_path / "rank-0.jsonl"
    cap = 1000
    path.write_bytes(_line(0) + b'{"junk": "' + b"x" * (5 * cap) + b'"}\n' + _line(1))
    tail = jobdir.JsonLinesTail(path, read_cap=300, line_cap=cap)
    held = 0
    lines = []
    while True:
        lines += tail.read()
        held = max(held, len(tail.rest))
        if not tail.behind:
            break
    assert [json.loads(x)["step"] for x in lines] == [0, 1] and tail.bad == 1
    assert held <= cap


# ---------------------------------------------------------------- the mirror writer

def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_mirror_appends_privately_and_keeps_files_open(tmp_path):
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    mirror = jobdir.Mirror()
    old = os.umask(0o022)  # what a notebook usually runs with: plain open() would make 0644
    try:
        mirror.append(jobdir.log_path(job, 0), "a\n")
        mirror.append(jobdir.log_path(job, 0), b"b\n")
        mirror.append_record(jobdir.node_metrics_path(job, 1), {"t": 1.0, "kind": "system"}, flush=False)
        mirror.flush()
    finally:
        os.umask(old)
    assert jobdir.log_path(job, 0).read_text() == "a\nb\n"
    assert jobdir.node_metrics_path(job, 1).read_text() == '{"t":1.0,"kind":"system"}\n'
    for path in (jobdir.log_path(job, 0), jobdir.node_metrics_path(job, 1)):
        assert _mode(path) == 0o600
        assert _mode(path.parent) == 0o700  # folders it made are private too
    mirror.close()
    mirror.append(jobdir.log_path(job, 0), "c\n")  # after close: opens again, appends
    mirror.close()
    assert jobdir.log_path(job, 0).read_text() == "a\nb\nc\n"


def test_mirror_never_writes_through_a_planted_link(tmp_path):
    job = tmp_path / "job"
    (job / "logs").mkdir(parents=True, mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    os.symlink(victim, jobdir.log_path(job, 0))
    with pytest.raises(OSError):
        jobdir.Mirror().append(jobdir.log_path(job, 0), "x\n")
    assert victim.read_text() == "keep\n"


def test_mirror_replaces_whole_files_atomically_and_privately(tmp_path):
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    mirror = jobdir.Mirror()
    target = job / jobdir.RESULT
    target.write_bytes(b"old")
    os.chmod(target, 0o644)
    mirror.replace(target, b"new")
    assert target.read_bytes() == b"new" and _mode(target) == 0o600
    # from a binary file (a member of an output archive), into a folder it makes
    nested = job / jobdir.MODEL / "sub" / "weights.bin"
    mirror.replace(nested, io.BytesIO(b"w" * 100_000))
    assert nested.read_bytes() == b"w" * 100_000 and _mode(nested) == 0o600 and _mode(nested.parent) == 0o700

    # a reader never sees half a file: the old content stays until the new one is complete, and a
    # write that fails leaves the old file and no temporary behind
    class Breaks(io.RawIOBase):
        def readable(self):
            return True

        def readinto(self, b):
            assert target.read_bytes() == b"new"  # mid-write, the old content is still whole
            raise OSError("the archive broke")

    with pytest.raises(OSError, match="archive broke"):
        mirror.replace(target, io.BufferedReader(Breaks()))
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in job.iterdir()) == [jobdir.MODEL, jobdir.RESULT]


def test_mirror_and_tail_meet(tmp_path):
    """What the remote mirror appends, the reader's tailer reads, a piece at a time."""
    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    mirror = jobdir.Mirror()
    path = jobdir.rank_metrics_path(job, 0)
    tail = jobdir.JsonLinesTail(path, read_cap=64)
    seen = []
    done = threading.Event()

    def write():
        for i in range(200):
            text = _line(i).decode()
            mirror.append(path, text[:7])
            mirror.append(path, text[7:])
        mirror.close()
        done.set()

    writer = threading.Thread(target=write)
    writer.start()
    while not done.is_set():
        seen += tail.records()
    writer.join()
    seen += tail.records(final=True)
    assert [r["step"] for r in seen] == list(range(200)) and tail.bad == 0


def test_an_agents_metrics_frames_rebuild_the_files_in_the_notebooks_job_directory(tmp_path):
    """The agent tails its host's metrics files with the tailer, a frame per bounded read; the agent run
    writes them with the mirror writer: the notebook's files end up the same, names checked."""
    import types

    from sdp_jupyter.launch import channel
    from sdp_jupyter.launch.host.agent import Agent
    from sdp_jupyter.launch.kernel.agent_run.run import AgentRun

    host, notebook = tmp_path / "host", tmp_path / "notebook"
    (host / "metrics").mkdir(parents=True)
    notebook.mkdir(mode=0o700)
    big = b"".join(_line(i, loss=1.0 / (i + 1)) for i in range(70_000))  # over READ_CAP: several frames
    jobdir.rank_metrics_path(host, 0).write_bytes(big)
    jobdir.node_metrics_path(host, 1).write_bytes(b'{"t":1.0,"kind":"system","node":1}\n')
    (host / "metrics" / "notes.jsonl").write_bytes(b'{"t":1.0}\n')  # not a metrics file: never sent
    out = io.BytesIO()
    agent = Agent(io.BytesIO(), out)
    agent.job_dir = host
    stop = threading.Event()
    stop.set()  # the last sweep
    agent._tail_metrics(stop)
    frames, stream = [], io.BytesIO(out.getvalue())
    while stream.tell() < len(out.getvalue()):
        frames.append(channel.decode(stream))
    assert {f["file"] for f in frames} == {"rank-0.jsonl", "system-node-1.jsonl"}
    assert len(frames) > 2 and all(len(f["lines"]) <= jobdir.READ_CAP for f in frames)
    run = types.SimpleNamespace(_mirror_files=jobdir.Mirror(), job=types.SimpleNamespace(dir=notebook))
    run.write_metrics = lambda name, text: AgentRun.write_metrics(run, name, text)
    for frame in frames + [{"type": "metrics", "file": "../../escape.jsonl", "lines": "x\n"}]:
        AgentRun._metrics(run, frame)
    run._mirror_files.close()
    assert jobdir.rank_metrics_path(notebook, 0).read_bytes() == big
    assert jobdir.node_metrics_path(notebook, 1).read_bytes() == b'{"t":1.0,"kind":"system","node":1}\n'
    assert sorted(p.name for p in (notebook / "metrics").iterdir()) == ["rank-0.jsonl", "system-node-1.jsonl"]
    assert not (tmp_path / "escape.jsonl").exists()
