"""--heal: a rank that dies costs the others a redone step, not their processes (sdp_jupyter.heal)."""
from __future__ import annotations

import pytest

from helpers.heal_job import HEAL_JOB, check_remote_heal, heal_lines
from helpers.remote_jobs import drive, next_line
from sdp_jupyter.launch import launch
from sdp_jupyter.launch.spec import JobSpec, SpecError

@pytest.mark.parametrize("dies, sig", [(2, "SIGKILL"), (0, "SIGKILL"), (1, "SIGSTOP")],
                         ids=["rank-2", "rank-0", "rank-1-stopped"])
def test_a_dead_rank_is_replaced_while_the_others_keep_their_processes(tmp_path, jobs_dir, dies, sig):
    """Rank 0 too: the group's store lives in its own process, and the survivors renumber so the new
    group's rank 0 is one of them; the replacement gets the state from that live peer. A rank stopped
    by SIGSTOP holds its peers' collective until the launcher kills it (SDP_STOPPED_RANK_S), then heals
    as a death does."""
    script = tmp_path / "heal_job.py"
    script.write_text(HEAL_JOB)
    job = launch(str(script), nodes=4, heal=True, max_restarts=2, backend="smddp", name="heal", ranks_output="all",
                 env={"DIES": str(dies), "SIG": sig, "SDP_STOPPED_RANK_S": "2"})
    assert job.wait(240) == "succeeded", job.summary() + job.logs()
    lines = heal_lines(job.dir, 4)
    survivors = [r for r in range(4) if r != dies]
    for rank in survivors:  # one process from start to end, two membership changes
        (start, end) = lines[rank]
        assert start[2] == end[2] and start[3] == "first", lines[rank]
        assert end[-2:] == ["[1,", "2]"], lines[rank]
    first, joined, end2 = lines[dies]
    assert first[3] == "first" and joined[3] == "joined" and joined[2] != first[2], lines[dies]
    assert 20 < int(joined[4]) < 100, joined  # let in at a step boundary after the death, with the step from a peer
    assert end2[2] == joined[2]
    assert len({lines[r][-1][3] for r in range(4)}) == 1, lines  # the same model everywhere at the end
    assert repr(job.result()) == lines[0][-1][3]
    heals = job.status["heals"]
    assert [h["members"] for h in heals] == [[0, 1, 2, 3], survivors, survivors + [dies]], heals
    assert "killed by signal SIGKILL" in heals[1]["left"][str(dies)] and heals[2]["joined"] == [dies]
    if sig == "SIGSTOP":
        assert "was stopped by a signal (SIGSTOP) for 2 s: killed" in (job.dir / "logs" / f"rank-{dies}.log").read_text()
    log = (job.dir / "logs" / f"rank-{survivors[0]}.log").read_text()
    assert f"heal 1 of 2: rank {dies} (node {dies}, local rank 0) was killed by signal SIGKILL" in log
    assert (f"[sdp_jupyter.heal] rank {survivors[0]}: generation 1, 3 ranks {survivors} from step 20") in log


@pytest.mark.slow
def test_a_dead_rank_on_an_ssh_host_is_replaced_there_while_the_others_keep_their_processes(ssh_hosts, tmp_path):
    """The same on three SSH test hosts, one rank each: rank 0 SIGSTOPs itself in step 20 and its agent
    kills it after 2 s (a SIGKILLed rank takes the same path from there); the ranks on the other hosts go
    on in their processes, node 0's agent starts rank 0 again (the job's store runs beside that agent,
    not in the rank), and it gets its state from a live peer (the records and the ranks' answers travel
    through the agents' links)."""
    d = drive(ssh_hosts.cluster, {
        "target": "ssh", "ssh": {"hosts": ssh_hosts.hosts, "config": str(ssh_hosts.config)}, "jobs_dir": str(tmp_path),
        "code": HEAL_JOB, "heal": True, "max_restarts": 2, "backend": "smddp", "name": "ssh-heal",
        "ranks_output": "all", "env": {"DIES": "0", "SIG": "SIGSTOP", "SDP_STOPPED_RANK_S": "2"}})
    check_remote_heal(next_line(d, timeout=240), 3, dies=0, host="h1")
    assert ssh_hosts.wait_clean(10) == {}
    assert not any(ssh_hosts.agent_dir(i).joinpath("ssh-heal").exists() for i in ssh_hosts.nodes)


def test_a_second_death_while_the_group_forms_costs_no_timeout(tmp_path, jobs_dir):
    """Rank 2 dies in step 20; rank 3 dies as the group of [0, 1, 3] forms, after ranks 0 and 1 reached it.
    They form [0, 1] at the launcher's next record within seconds (the handshake alone would have waited
    for its 60 s timeout), both replacements join, and every rank ends with the same weights."""
    import re

    script = tmp_path / "heal_job.py"
    script.write_text(HEAL_JOB)
    job = launch(str(script), nodes=4, heal=True, max_restarts=2, backend="smddp", name="heal2", ranks_output="all",
                 env={"DIES": "2", "SIG": "SIGKILL", "SECOND": "3"})
    assert job.wait(240) == "succeeded", job.summary() + job.logs()
    heals = job.status["heals"]
    assert [h["members"] for h in heals[:3]] == [[0, 1, 2, 3], [0, 1, 3], [0, 1]], heals
    assert sorted(heals[-1]["members"]) == [0, 1, 2, 3], heals
    log = (job.dir / "logs" / "rank-0.log").read_text()
    # formed when step 20's collective failed, or (on a loaded machine, rank 3 dying a moment later) at
    # the boundary before it: either way at the next record, not after the handshake's timeout
    formed = re.search(r"rank 0: generation 2, 2 ranks \[0, 1\] from step 20 \((?:step 20 failed: [^\n]*|boundary); "
                       r"([0-9.]+) s\)", log)
    assert formed, log
    assert float(formed.group(1)) < 20, formed.group(0)  # 1.5 s of rank 3's delay and the formation
    lines = heal_lines(job.dir, 4)
    for rank in (0, 1):  # one process from start to end
        assert lines[rank][0][2] == lines[rank][-1][2] and lines[rank][0][3] == "first", lines[rank]
    assert len({lines[r][-1][3] for r in range(4)}) == 1, lines  # the same model everywhere at the end


@pytest.mark.parametrize("kwargs, says", [
    ({"heal": True}, "--max-restarts is 0. Fix: --heal --max-restarts 3"),
    ({"heal": True, "max_restarts": 2, "target": "sagemaker"}, "built for the local, ssh, ray and slurm targets"),
    ({"heal": True, "max_restarts": 2, "nodes": "1:2", "target": "ssh", "ssh": {"hosts": ["a", "b"]}}, "--heal"),
    ({"heal": "yes", "max_restarts": 2}, "is a flag"),
    ({"heal": True, "max_restarts": 2, "init_process_group": True}, "Fix: remove --init-process-group"),
])
def test_heal_refusals_name_the_option_and_the_fix(kwargs, says):
    with pytest.raises(SpecError) as err:
        JobSpec(code="pass", **kwargs)
    assert err.value.option == "--heal" and says in str(err.value)


def test_a_heal_script_that_makes_its_own_group_is_told_the_healer_makes_it(tmp_path, jobs_dir):
    """Its init_process_group would fail on the port the job's store holds (rank 0), or wait for peers
    that never come (a replacement): it fails at once with the fix instead."""
    script = tmp_path / "own_group.py"
    script.write_text("import torch.distributed as dist\ndist.init_process_group('gloo')\n")
    job = launch(str(script), nodes=2, heal=True, max_restarts=1, backend="gloo", name="own-group")
    assert job.wait(120) == "failed", job.summary()
    fix = "Fix: remove dist.init_process_group(...) from the script and create Healer(model, optimizer, wrap=...) first"
    assert fix in job.status["error"], job.status["error"]


def test_a_healer_outside_a_heal_job_says_how_to_start_one(monkeypatch):
    from sdp_jupyter.heal import HealError, Healer

    monkeypatch.delenv("SDP_HEAL", raising=False)
    with pytest.raises(HealError, match=r"--heal --max-restarts 3"):
        Healer(object())


def test_the_result_is_saved_by_the_first_member_of_the_last_membership(tmp_path):
    """Rank 0 without records; a survivor when rank 0 died, whether its replacement joined or came after
    training ended (then the last record never lists it)."""
    from sdp_jupyter import jobdir
    from sdp_jupyter.launch.rank.worker import _result_rank

    assert _result_rank(str(tmp_path), heal=False) == 0
    assert _result_rank(str(tmp_path), heal=True) == 0  # no record yet
    records = [[0, 1, 2, 3], [1, 2, 3], [1, 2, 3, 0]]
    expected = [0, 1, 1]
    for generation, (members, first) in enumerate(zip(records, expected)):
        jobdir.heal_record_path(tmp_path, generation).parent.mkdir(parents=True, exist_ok=True)
        jobdir.write_json_atomic(jobdir.heal_record_path(tmp_path, generation),
                                 {"generation": generation, "members": members})
        assert _result_rank(str(tmp_path), heal=True) == first, members
    assert jobdir.newest_heal_record(tmp_path, after=2) is None
    assert jobdir.newest_heal_record(tmp_path, after=0)["members"] == [1, 2, 3, 0]
