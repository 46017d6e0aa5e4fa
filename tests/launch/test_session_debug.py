"""A post-mortem pdb on one rank of a session (Session.debug, launch/kernel/session_debug.py and
launch/rank/postmortem.py) without a kernel: a local gloo session of 2 ranks whose cell fails on rank 1
only; pdb on rank 1 reads the failed frame and its caller, both forms (commands, and line by line), a
command interrupted; breakpoint() on one rank and on both served through input() (monkeypatched, as
the frontend's input box), `q` there, no one to type, another thread; the session goes on with every
variable."""
from __future__ import annotations

import time

import pytest

from helpers.debug_cells import BREAKS_ON_1, FAILS_ON_1
from sdp_jupyter.launch import JobSpec
from sdp_jupyter.launch.kernel import session as sessions



@pytest.fixture
def session(jobs_dir):
    s = sessions.Session.start(JobSpec(code="pass", nodes=2, backend="gloo"))
    try:
        failed = s.run(FAILS_ON_1, label="In[3]")
        assert failed.failed == [1], failed.message()
        yield s
    finally:
        s.stop()


def test_pdb_on_the_failed_rank_reads_the_frame_and_its_caller_and_the_session_goes_on(session):
    generation = session.generation  # after the failed cell's own mending (gloo: always a reconnect)
    out = session.debug(1, ["p secret", "up", "p v", "ll", "q"])
    assert "'s-21-1'" in out and "(Pdb) p v\n7\n" in out, out
    # the cell's source, registered in the rank's linecache, is what `ll` lists
    assert "def outer(v):" in out and "return inner(v * 3)" in out, out
    assert out.splitlines()[0].startswith("> <cell In[3]>(8)inner()"), out
    # every rank keeps its variables and the group works: no reconnect was needed
    after = session.run("import torch, torch.distributed as dist\nt = torch.ones(1) * kept\ndist.all_reduce(t)\n"
                        "(kept, t.item())", want="gather")
    assert after.failed == [] and [after.value(0), after.value(1)] == [(10, 21.0), (11, 21.0)]
    assert session.generation == generation  # the debugging needed no reconnect
    # the failed cell stays the last one to debug, as %debug's does: again, and `q` added when missing
    assert "(Pdb) p x\n21\n(Pdb) q" in session.debug(1, ["p x"])
    # pdb's `interact` reads the same lines, and what runs out of them ends too
    out = session.debug(1, ["interact", "print('in interact', x * 2)"])
    assert "in interact 42" in out, out


def test_a_rank_without_a_failed_cell_says_which_one_has_and_commands_after_c_are_named(session):
    with pytest.raises(sessions.SessionError, match=r"rank 0 has had no failed cell.*%sdp_debug 1"):
        session.debug(0, ["p 1"])
    with pytest.raises(sessions.SessionError, match="rank 5 is not in session"):
        session.debug(5, ["q"])
    out = session.debug(1, ["p secret", "c", "p v"])
    assert "pdb ended before these commands: p v" in out, out
    assert session.run("kept", want="gather").value(1) == 11


def test_line_by_line_through_ask_until_q(session):
    lines = iter(["p secret", "up", "p v", "!print('from a statement', v)", "q"])
    prompts, shown = [], []

    def ask(prompt):
        prompts.append(prompt)
        return next(lines)

    assert session.debug(1, ask=ask, show=shown.append) == ""
    text = "\n".join(shown)
    assert prompts == ["(Pdb) "] * 5
    assert shown[0] == "post-mortem of cell In[3] on rank 1 (the other ranks wait; q ends it)"
    assert "'s-21-1'" in text and "\n7" in text and "from a statement 7" in text, text
    assert session.run("kept", want="gather").value(0) == 10


def test_a_command_interrupted_returns_to_the_prompt_and_pdb_is_ended(session):
    # Ctrl-C in the notebook while a pdb command runs on the rank: on_wait raises it, as the kernel would
    t0 = time.monotonic()

    def on_wait():
        if time.monotonic() - t0 > 1.5:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        session.debug(1, ["p __import__('time').sleep(60)", "p 'after the sleep'"], on_wait=on_wait)
    assert time.monotonic() - t0 < 30
    # the rank is out of pdb and takes cells again, every variable kept
    again = session.run("kept", want="gather")
    assert again.failed == [] and [again.value(0), again.value(1)] == [10, 11]




def _typing(monkeypatch, lines):
    """input() answers with `lines` (as the frontend's input box would), recording each prompt."""
    import builtins

    lines, prompts = iter(lines), []

    def ask(prompt=""):
        prompts.append(prompt)
        return next(lines)

    monkeypatch.setattr(builtins, "input", ask)
    return prompts


def test_breakpoint_on_one_rank_is_served_from_the_notebook_and_the_cell_goes_on(session, monkeypatch, capsys):
    prompts = _typing(monkeypatch, ["p local", "n", "p local * 2", "ll", "c"])
    r = session.run(BREAKS_ON_1, want="gather", label="In[9]")
    out = capsys.readouterr().out
    assert r.failed == [] and [r.value(0), r.value(1)] == [10.0, 10.0], r.message()
    assert prompts == ["(Pdb) "] * 5
    assert "breakpoint() on rank 1 in cell In[9]" in out and "> <cell In[9]>(7)g()" in out, out
    # the stop, `p local`, `n` (a second stop, the next line), `p local * 2`, `ll` (the cell's source)
    assert "\n5\n" in out and "-> t = torch.ones(1) * local" in out and "-> dist.all_reduce(t)" in out, out
    assert "\n10\n" in out and "def g(a):" in out, out
    # the session goes on with every variable
    assert session.run("kept", want="gather").value(1) == 11


def test_q_at_a_breakpoint_fails_the_cell_there_and_end_of_input_goes_on(session, monkeypatch, capsys):
    _typing(monkeypatch, ["p local", "q"])
    r = session.run(BREAKS_ON_1, want="gather", label="In[10]")
    text = r.message()  # rank 0 left in its all_reduce fails too, after rank 1 (the cause)
    assert 1 in r.failed and text.splitlines()[1] == "rank 1 failed:" and "bdb.BdbQuit" in text, text
    assert "bdb.py" not in text, text  # the cell's frames only

    import builtins

    def no_frontend(prompt=""):
        raise EOFError

    monkeypatch.setattr(builtins, "input", no_frontend)  # a script: no one to type, so pdb goes on
    r = session.run(BREAKS_ON_1, want="gather", label="In[11]")
    assert r.failed == [] and [r.value(0), r.value(1)] == [10.0, 10.0], r.message()


def test_breakpoints_on_both_ranks_are_served_one_after_the_other(session, monkeypatch, capsys):
    _typing(monkeypatch, ["p ('at', dist.get_rank())", "c", "p ('at', dist.get_rank())", "c"])
    r = session.run("import torch.distributed as dist\nbreakpoint()\ndone = dist.get_rank()\nthreads = []\n"
                    "import threading\ndef in_a_thread():\n    try:\n        breakpoint()\n    except RuntimeError as e:\n"
                    "        threads.append(str(e))\nt = threading.Thread(target=in_a_thread)\nt.start()\nt.join()\n"
                    "(done, threads)", want="gather", label="In[12]")
    out = capsys.readouterr().out
    assert r.failed == [] and [v[0] for v in (r.value(0), r.value(1))] == [0, 1], r.message()
    assert "('at', 0)" in out and "('at', 1)" in out, out
    assert "only in the cell's own thread" in r.value(1)[1][0]
