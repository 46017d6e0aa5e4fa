"""The job tells the truth about its backend (issue 19, items 5 and 6): real local jobs whose ranks make
another group than asked, make none, never run a collective, or get theirs from --init-process-group."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO
from sdp_jupyter.launch import Job, JobSpec, SpecError, launch
from sdp_jupyter.launch.kernel import backend_verdict

pytestmark = pytest.mark.slow

# A DDP step whose ranks start from different weights and feed different data: equal weights at the end
# prove that the broadcast and the gradient all_reduce ran on the group the script got.
DDP_STEP = """
    import torch, torch.distributed as dist
    torch.manual_seed(dist.get_rank())
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(8, 4) * (dist.get_rank() + 1)).sum().backward()
    opt.step()
    w = model.module.weight.detach().clone()
    got = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(got, w)
    assert all(torch.equal(g, got[0]) for g in got), "replicas diverged"
"""


def write(path, *parts):
    path.write_text("".join(textwrap.dedent(part) for part in parts))
    return path


def records(job) -> dict:
    return backend_verdict.read_records(job.dir)


def test_a_script_that_makes_its_own_gloo_group_under_smddp_is_reported_as_gloo(tmp_path, jobs_dir):
    """What an unchanged Trainer script does under sdp-train: the summary must not say `backend smddp`."""
    from sdp_jupyter.ui.jobview import JobView

    script = write(tmp_path / "own_gloo.py", """
        import torch.distributed as dist
        dist.init_process_group("gloo")
    """, DDP_STEP, """
        dist.destroy_process_group()   # the record survives the script's own destroy
    """)
    run = subprocess.run([sys.executable, "-m", "sdp_jupyter.cli", "--nodes", "2", "--name", "own-gloo",
                          str(script)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "backend gloo (asked: smddp)" in run.stderr
    assert "warning: the ranks created a gloo process group, not smddp as asked (--backend smddp)" in run.stderr
    assert "--init-process-group" in run.stderr and "trained independently" not in run.stderr
    job = Job.open("own-gloo")
    st = job.status
    assert st["backend_used"] == "gloo" and st["collectives"] >= 4  # DDP's set-up, one bucket, the all_gather
    assert job.backend_label == "gloo (asked: smddp)" and len(job.warnings) == 1
    assert {r: rec["groups"] for r, rec in records(job).items()} == {0: {"gloo": 1}, 1: {"gloo": 1}}
    view = JobView(job)
    assert "gloo (asked: smddp)" in view.header.value
    assert "warning: the ranks created a gloo process group" in view.error.value


def test_ranks_that_never_run_a_collective_end_with_a_warning(tmp_path, jobs_dir):
    """Three ways to train alone: an smddp group never used, a gloo group never used (torch's counter),
    no group at all; and the control: ranks that ran a collective get no such warning."""
    idle_smddp = write(tmp_path / "idle_smddp.py", """
        import torch.distributed as dist
        dist.init_process_group("smddp")
        print("group", dist.get_backend())
    """)
    idle_gloo = write(tmp_path / "idle_gloo.py", """
        import torch.distributed as dist
        dist.init_process_group()   # no backend: torch says "undefined", its CPU backend is gloo
    """)
    no_group = write(tmp_path / "no_group.py", """
        import os
        print("alone", os.environ["RANK"])
    """)
    talked = write(tmp_path / "talked.py", """
        import torch, torch.distributed as dist
        dist.init_process_group("smddp")
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [2.0, 2.0]
    """)
    jobs = {"idle-smddp": launch(idle_smddp, nodes=2, name="idle-smddp"),
            "idle-gloo": launch(idle_gloo, nodes=2, backend="gloo", name="idle-gloo"),
            "no-group": launch(no_group, nodes=2, backend="gloo", name="no-group"),
            "talked": launch(talked, nodes=2, name="talked")}
    for job in jobs.values():
        assert job.wait(120) == "succeeded", job.summary() + job.logs(0) + job.logs(1)
    for name in ("idle-smddp", "idle-gloo", "no-group"):
        job = Job.open(name)  # from status.json alone
        assert job.status["collectives"] == 0, name
        (warning,) = job.warnings
        assert warning.startswith("the ranks trained independently: "), warning
        assert f"warning: {warning}" in job.summary()
    assert "created a smddp group but never ran a collective on it after set-up" in jobs["idle-smddp"].warnings[0]
    assert "created a gloo group but never ran a collective" in jobs["idle-gloo"].warnings[0]
    assert "none of the 2 ranks created a process group" in jobs["no-group"].warnings[0]
    assert jobs["no-group"].backend_label == "gloo (no process group)"
    assert jobs["idle-smddp"].backend_label == "smddp" and jobs["idle-gloo"].backend_label == "gloo"
    assert jobs["talked"].warnings == [] and jobs["talked"].status["collectives"] == 1
    assert "warning" not in jobs["talked"].summary()


def test_init_process_group_option_puts_an_unchanged_script_on_the_jobs_backend(tmp_path, jobs_dir):
    """The script never calls init_process_group (as Trainer and accelerate skip it when a group exists)."""
    script = write(tmp_path / "unchanged.py", """
        import torch.distributed as dist
        assert dist.is_initialized(), "the launcher should have made the default group"
    """, DDP_STEP, """
        dist.get_backend()
    """)
    job = launch(script, nodes=2, init_process_group=True, name="unchanged")
    assert job.wait(120) == "succeeded", job.summary() + job.logs(0) + job.logs(1)
    assert job.result() == "smddp"
    assert job.status["backend_used"] == "smddp" and job.status["collectives"] >= 4 and job.warnings == []
    assert "backend smddp," in job.summary() and "warning" not in job.summary()
    assert {rec.get("init_by") for rec in records(job).values()} == {"launcher"}
    assert json.loads((job.dir / "spec.json").read_text())["init_process_group"] is True


def test_init_process_group_option_with_a_script_that_initializes_itself(tmp_path, jobs_dir):
    """As docs/integrations.md says: the same backend (or none) returns at once with a note; another
    backend raises ValueError naming the option; the group the launcher made is the one used."""
    script = write(tmp_path / "initializes.py", """
        import os, torch, torch.distributed as dist
        from torch.distributed import init_process_group   # the name as the script imports it
        try:
            dist.init_process_group("gloo")
            raise SystemExit("a gloo init should have been refused")
        except ValueError as e:
            print("refused:", e)
        assert init_process_group("smddp") is None
        dist.init_process_group(backend=os.environ["SDP_BACKEND"], timeout=__import__("datetime").timedelta(60))
        dist.init_process_group()
        t = torch.ones(3) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        t.tolist()
    """)
    job = launch(script, nodes=2, init_process_group=True, name="initializes")
    assert job.wait(120) == "succeeded", job.summary() + job.logs(0) + job.logs(1)
    assert job.result() == [3.0, 3.0, 3.0]
    log = job.logs(1)
    assert ("refused: init_process_group('gloo'): --init-process-group already initialized the default process "
            "group with smddp (the job's --backend). Fix: run with --backend gloo") in log
    assert log.count("returned at once: --init-process-group already made the default group (smddp)") == 3
    assert "[sdp_jupyter] init_process_group() returned at once" in log
    assert job.status["backend_used"] == "smddp" and job.warnings == []


def test_the_option_in_the_magic_line_the_cli_and_the_spec():
    from sdp_jupyter.cli import build_parser
    from sdp_jupyter.magics import SdpMagics, parse_line

    spec = JobSpec(code="x", init_process_group=True, backend="gloo")
    line = spec.to_magic_line()
    assert line == "%%sdp_train --backend gloo --init-process-group"
    values = vars(parse_line(SdpMagics.sdp_train, line[len("%%sdp_train"):]))
    assert JobSpec.from_options(values, code="x") == spec
    ns = build_parser().parse_args(["--init-process-group", "train.py"])
    assert JobSpec.from_options(vars(ns), script=ns.script).init_process_group is True
    assert JobSpec.from_json(spec.to_json()) == spec and JobSpec(code="x").init_process_group is False
    with pytest.raises(SpecError, match=r"^--init-process-group: is a flag"):
        JobSpec(code="x", init_process_group="yes")
    assert JobSpec(code="x", init_process_group=True, target="sagemaker").init_process_group  # the entry makes it


def _write_records(job_dir, rows):
    (job_dir / "metrics").mkdir(parents=True, exist_ok=True)
    for row in rows:
        with open(job_dir / "metrics" / f"rank-{row['rank']}.jsonl", "a") as f:
            f.write(json.dumps({"t": 1.0, "kind": "backend", **row}, separators=(",", ":")) + "\n")


def test_verdict_warns_only_on_what_it_knows(tmp_path):
    """No independence warning from a single rank, a missing rank's record, an uncounted backend or a failed job;
    a restart's records replace the failed attempt's."""
    one = tmp_path / "one"
    _write_records(one, [{"rank": 0, "backend": None, "collectives": 0}])
    assert backend_verdict.verdict(one, "smddp", 1) == {"backend_used": None, "collectives": 0, "warnings": []}
    missing = tmp_path / "missing"
    _write_records(missing, [{"rank": 0, "backend": "smddp", "collectives": 0}])
    assert backend_verdict.verdict(missing, "smddp", 2)["warnings"] == []
    idle = tmp_path / "idle"
    _write_records(idle, [{"rank": r, "backend": "smddp", "collectives": 0} for r in range(2)])
    assert backend_verdict.verdict(idle, "smddp", 2, "failed")["warnings"] == []  # its error says more
    assert "trained independently" in backend_verdict.verdict(idle, "smddp", 2, "succeeded")["warnings"][0]
    uncounted = tmp_path / "uncounted"
    _write_records(uncounted, [{"rank": r, "backend": "mpi", "collectives": None} for r in range(2)])
    v = backend_verdict.verdict(uncounted, "mpi", 2)
    assert v == {"backend_used": "mpi", "collectives": None, "warnings": []}
    restarted = tmp_path / "restarted"
    _write_records(restarted, [{"rank": r, "backend": "gloo", "collectives": 0, "attempt": 0} for r in range(2)]
                   + [{"rank": r, "backend": "smddp", "collectives": 7, "attempt": 1} for r in range(2)])
    assert backend_verdict.verdict(restarted, "smddp", 2) == {"backend_used": "smddp", "collectives": 7,
                                                              "warnings": []}
    assert backend_verdict.verdict(tmp_path / "none", "smddp", 2) == {}  # no records (SageMaker, killed ranks)
