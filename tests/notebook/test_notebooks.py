"""Every notebook in notebooks/ runs top to bottom in a real kernel (nbclient), and its executed copy,
scrubbed, is kept as notebooks/executed/<name>.ipynb. The executed copies stored in the repository
(notebooks/outputs/, made by `python tools/executed.py refresh`) are checked here too: each is made from
its notebook's current cells by the current sdp_jupyter version, and names nothing of the machine that
made it.

The runs themselves (the kernel's environment, the test hosts 07_slurm, 09_ssh and 11_elastic run on, the check for
leftover processes) are helpers.notebooks.notebook_run: a notebook that test_newcomer_path.py already
ran in this session is not run again. What each notebook must have shown is checked here.
"""
from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from conftest import REPO
from helpers.notebooks import notebook_run
from tools import executed
from tools.main_job import cell_seconds

NOTEBOOKS = sorted(p for p in (REPO / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_runs(path: Path, request):
    run = notebook_run(path.name, request)  # raises CellExecutionError naming the failing cell
    nb, jobs = run.nb, run.jobs
    check_executed_copy(path.name, jobs)
    if path.name == "01_quickstart.ipynb":
        check_quickstart(nb, jobs)
    if path.name == "07_slurm.ipynb":
        check_slurm(nb, jobs, run.hosts)
    if path.name == "09_ssh.ipynb":
        check_ssh(nb, jobs, run.hosts)
    if path.name == "11_elastic.ipynb":
        check_elastic(nb, jobs, run.hosts)
    if path.name == "04_sagemaker.ipynb":
        check_rehearsal(nb)
    if path.name == "12_notebook_is_the_program.ipynb":
        check_notebook_code(nb)
    if path.name == "05_model_parallel.ipynb":  # tp x pp with --backend smddp: no gloo group at all
        logs = (jobs / "gpt_tp2_pp2" / "logs")
        said = [(logs / f"rank-{r}.log").read_text() for r in range(4)]
        assert all("process groups on: smddp\n" in s for s in said), said[0][-2000:]


def check_notebook_code(nb):
    """Notebook code by value, run(fn), the session object, every rank's stack and a post-mortem: each
    cell said what it should."""
    said = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "sending Net, loss_fn, shard from the notebook by value" in said, said[:3000]
    assert re.search(r"accuracy on every rank: \[(0\.\d+), \1\]", said), said[:3000]
    assert "samples per rank: [898, 898]" in said
    assert "rank 1 is in stuck_in_data_loading()" in said and "in torch.distributed.all_reduce()" in said
    assert "(Pdb) p secret\n12\n" in said and "(Pdb) p values\n[1, 2, 3]\n" in said
    assert "[(0, 'still here'), (1, 'still here')]" in said


def check_executed_copy(name: str, jobs: Path):
    """The copy the docs show: written, and nothing of this machine in it."""
    text = (executed.EXECUTED / name).read_text()
    assert json.loads(text)["cells"], name
    for leak in (str(REPO), str(jobs), "/tmp/pytest-of-", "\x1b[", "\\u001b["):
        assert leak not in text, f"notebooks/executed/{name} still holds {leak!r}"
    assert not re.search(r"\b[0-9a-f]{64}\b", text), f"notebooks/executed/{name} holds what looks like a job secret"


def stream_text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


def shows_widget(cell) -> bool:
    return any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in cell.outputs)


def check_quickstart(nb, jobs: Path):
    outputs = {c.source.splitlines()[0]: c for c in nb.cells if c.cell_type == "code"}
    train = next(c for first, c in outputs.items() if first.startswith("%%sdp_train --nodes 4"))
    text = stream_text(train)
    assert "Job quickstart: succeeded" in text and "4 node(s)" in text
    assert shows_widget(train), "the job view widget was not displayed"
    print(f"\nquickstart training cell: {cell_seconds(train):.1f} s from a fresh kernel")
    all_text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "test accuracy on 450 held-out digits: 0." in all_text
    job = jobs / "quickstart"
    assert sorted(p.name for p in (job / "logs").glob("rank-*.log")) == [f"rank-{r}.log" for r in range(4)]
    assert (job / "result.pkl").is_file() and (job / "script.py").read_text().startswith("# %%sdp_train")
    assert any((job / "metrics").glob("rank-*.jsonl")), "sdp_jupyter.report() wrote no metrics"


def check_slurm(nb, jobs: Path, slurm_hosts):
    code = [c for c in nb.cells if c.cell_type == "code"]
    train = next(c for c in code if c.source.startswith("%%sdp_train --target slurm --nodes 3"))
    text = stream_text(train)
    assert "Job slurm-quickstart: succeeded" in text, text[-3000:]
    assert shows_widget(train), "the job view widget was not displayed"
    print(f"\nslurm training cell (3 nodes of the Slurm test cluster): {cell_seconds(train):.1f} s "
          "from a fresh kernel, queue and allocation included")
    sinfo = next(c for c in code if c.source == "!sinfo")
    said = "".join(o.get("text", "") for o in sinfo.outputs)
    assert "debug*" in said and "h[1-3]" in said, said
    all_text = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "test accuracy on 450 held-out digits: 0." in all_text
    status = json.loads((jobs / "slurm-quickstart" / "status.json").read_text())
    assert status["state"] == "succeeded" and sorted(status["host_names"]) == ["h1", "h2", "h3"], status
    assert f"Slurm job {status['slurm_job_id']} ran on: " in all_text
    assert (jobs / "slurm-quickstart" / "result.pkl").is_file()
    assert any((jobs / "slurm-quickstart" / "metrics").glob("rank-*.jsonl")), "sdp_jupyter.report() wrote no metrics"
    assert slurm_hosts.wait_clean(30) == {}, "a rank, an agent or a Slurm job outlived the notebook"


def check_elastic(nb, jobs: Path, ssh_hosts):
    """A cut link costs a re-formation, not the job: the notebook's own asserts checked the formations and
    the accuracy; here, that it ran on the suite's hosts, said so, and left nothing running there."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in code), "the suite's hosts were not used"
    all_text = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "s later the job goes on with h1, h2; lost: {'h3': " in all_text, all_text[-3000:]
    # the 2-node attempt may be cut short by h3's return before rank 0 prints; the 3-node one resumes
    assert re.search(r"attempt 2: 3 ranks, rank 0 on h1, from step [1-9]", all_text), all_text[-3000:]
    assert "test accuracy on 450 held-out digits: 0." in all_text
    # the summary (the job view's text) and the dashboard's markers show each change
    from sdp_jupyter.launch import Job
    from sdp_jupyter.monitor import reader

    job = Job.open(next(d for d in jobs.iterdir() if (d / "status.json").is_file()))
    summary = job.summary()
    assert "(3 of 2:3 node(s) x 1 proc(s) on ssh" in summary and "membership: " in summary, summary
    assert "node h3 lost: " in summary and "host h3 is reachable again and joins: 3 node(s) from then" in summary
    labels = [label for _, label in reader.read(job.dir).changes]
    assert labels == ["h3 lost: 2 nodes", "host h3 is reachable again and joins: 3 nodes"], labels
    assert ssh_hosts.wait_clean(30) == {}


def check_ssh(nb, jobs: Path, ssh_hosts):
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in code), "the suite's hosts were not used"
    login = next(c for c in code if "!ssh " in c.source)
    assert "".join(o.get("text", "") for o in login.outputs).split() == ["h1", "h2", "h3"]
    train = next(c for c in code if c.source.startswith("%%sdp_train --target ssh"))
    text = stream_text(train)
    assert "Job ssh-quickstart: succeeded" in text, text[-3000:]
    for rank, host in enumerate(["h1", "h2", "h3"]):  # each rank's output, streamed back into its log here
        said = (jobs / "ssh-quickstart" / "logs" / f"rank-{rank}.log").read_text()
        assert f"rank {rank} of 3 on {host}\n" in said, said[-2000:]
    assert shows_widget(train), "the job view widget was not displayed"
    print(f"\nssh training cell (3 SSH test hosts): {cell_seconds(train):.1f} s from a fresh kernel")
    all_text = "".join(o.get("text", "") for c in code for o in c.outputs)
    assert "test accuracy on 450 held-out digits: 0." in all_text
    job = jobs / "ssh-quickstart"
    assert json.loads((job / "status.json").read_text())["state"] == "succeeded"
    assert (job / "result.pkl").is_file() and any((job / "metrics").glob("rank-*.jsonl"))
    left = ssh_hosts.wait_clean(30)
    # the pools end when the kernel's ssh clients do, a fraction of a second after the kernel: wait for them
    deadline = time.monotonic() + 15
    while True:
        pools = {i: ssh_hosts.processes(i, "sdp_jupyter.launch.host.warm") for i in ssh_hosts.nodes}
        if not any(pools.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert left == {} and not any(pools.values()), f"outlived the notebook: ranks/agents {left}, pools {pools}"


def check_rehearsal(nb):
    code = [c for c in nb.cells if c.cell_type == "code"]
    rehearse = next(c for c in code if c.source.startswith("%%sdp_train") and "--rehearse " in c.source)
    text = stream_text(rehearse)
    assert "Job sm-demo-rehearsal: succeeded" in text, text[-3000:]
    assert "Rehearsal on this machine" in text and "nothing was sent to AWS" in text and "Not checked" in text, text
    assert shows_widget(rehearse), "the rehearsal's job view was not displayed"


def test_stored_outputs_are_current():
    """notebooks/outputs/ holds a copy of every notebook of tools/executed.py's PUBLISHED, each made from
    the notebook's current cells by the current sdp_jupyter version, and nothing else."""
    stale = executed.stale()
    assert stale == {}, ("stored executed copies to refresh (.venv/bin/python tools/executed.py refresh "
                         f"{' '.join(n for n in stale if n in executed.PUBLISHED)}):\n"
                         + "\n".join(f"  {name}: {why}" for name, why in stale.items()))


def test_stored_outputs_name_nothing_of_this_machine():
    for path in sorted(executed.OUTPUTS.glob("*.ipynb")):
        text = path.read_text()
        assert json.loads(text)["cells"], path.name
        assert executed.leaks(text) == [], f"notebooks/outputs/{path.name} holds {executed.leaks(text)[:5]}"


def test_a_stored_copy_of_other_cells_or_another_version_is_stale(tmp_path, monkeypatch):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook

    name = executed.PUBLISHED[0]
    monkeypatch.setattr(executed, "NOTEBOOKS", tmp_path)
    monkeypatch.setattr(executed, "OUTPUTS", tmp_path / "outputs")
    monkeypatch.setattr(executed, "PUBLISHED", (name,))
    monkeypatch.setattr(executed, "REPO", tmp_path)
    nb = new_notebook(cells=[new_code_cell("print(1)")])
    nbformat.write(nb, tmp_path / name)
    assert executed.stale() == {name: f"no stored copy outputs/{name}"}
    stored = new_notebook(cells=[new_code_cell("print(1)")], metadata={executed.STAMP: executed.stamp(tmp_path / name)})
    (tmp_path / "outputs").mkdir()
    nbformat.write(stored, tmp_path / "outputs" / name)
    assert executed.stale() == {}
    nbformat.write(new_notebook(cells=[new_code_cell("print(2)")]), tmp_path / name)
    assert executed.stale() == {name: "the notebook's cells changed since its copy was made"}
    nbformat.write(nb, tmp_path / name)
    monkeypatch.setattr(executed, "version", lambda: "9.9.9")
    assert "made by sdp_jupyter" in executed.stale()[name]
    nbformat.write(nb, tmp_path / "outputs" / "gone.ipynb")
    assert executed.stale()["gone.ipynb"] == "not a PUBLISHED notebook: delete it"


def test_prose_copies_changed_markdown_into_a_stored_copy_and_refuses_changed_code(tmp_path, monkeypatch):
    import nbformat
    from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

    name = executed.PUBLISHED[0]
    for attr, value in (("NOTEBOOKS", tmp_path), ("OUTPUTS", tmp_path / "outputs"), ("PUBLISHED", (name,)),
                        ("REPO", tmp_path)):
        monkeypatch.setattr(executed, attr, value)
    nbformat.write(new_notebook(cells=[new_markdown_cell("old words"), new_code_cell("print(1)")]), tmp_path / name)
    ran = new_notebook(cells=[new_markdown_cell("old words"), new_code_cell("print(1)", outputs=[
        new_output("stream", name="stdout", text="1\n")])], metadata={executed.STAMP: executed.stamp(tmp_path / name)})
    (tmp_path / "outputs").mkdir()
    nbformat.write(ran, tmp_path / "outputs" / name)
    nbformat.write(new_notebook(cells=[new_markdown_cell("new words"), new_code_cell("print(1)")]), tmp_path / name)
    assert executed.stale() and executed.prose(name) is None and executed.stale() == {}
    stored = nbformat.read(tmp_path / "outputs" / name, as_version=4)
    assert stored.cells[0].source == "new words" and stored.cells[1].outputs[0].text == "1\n"
    nbformat.write(new_notebook(cells=[new_markdown_cell("new words"), new_code_cell("print(2)")]), tmp_path / name)
    assert executed.prose(name) == "code cell 1 changed: run refresh" and executed.stale()


def test_scrub_takes_out_planted_secrets_paths_and_colour_codes(tmp_path, monkeypatch):
    import nbformat
    from nbformat.v4 import new_code_cell, new_notebook, new_output

    job_secret = "ab12" * 16  # the shape of a job secret: secrets.token_hex(32)
    monkeypatch.setenv("SDP_TEST_SESSION_TOKEN", "kept-in-the-environment-42")
    home = str(Path.home())
    host = "planted-host-name"
    monkeypatch.setattr(executed.socket, "gethostname", lambda: host)
    import psutil
    from types import SimpleNamespace

    monkeypatch.setattr(psutil, "net_if_addrs", lambda: {"eth9": [
        SimpleNamespace(family=executed.socket.AF_INET, address="10.11.12.13"),
        SimpleNamespace(family=executed.socket.AF_INET, address="127.0.0.1")]})
    said = (f"SDP_JOB_SECRET={job_secret}\naws_secret_access_key='testing' AKIAIOSFODNN7EXAMPLE\n"
            f"token leaked: kept-in-the-environment-42\nlogs in {REPO}/notebooks/sdp_jobs/quickstart and "
            f"/tmp/pytest-of-root/pytest-7/test_x0/jobs/a, config {home}/.ssh/config\n"
            f"data in /tmp/sm-train-x1y2/part-0.txt, kept in /var/tmp/sm-cache; ranks on {host}, {host}\n"
            "head at 10.11.12.13:6379, not 10.11.12.134 nor 127.0.0.1\n")
    cell = new_code_cell("print(1)", outputs=[
        new_output("stream", name="stdout", text=said),
        new_output("error", ename="ValueError", evalue="bad", traceback=[
            f"\x1b[0;31mValueError\x1b[0m in \x1b[0;32m{REPO}/sdp_jupyter/launch/__init__.py\x1b[0m"]),
        new_output("display_data", data={"application/vnd.jupyter.widget-view+json": {"model_id": "a" * 32}})])
    nb = new_notebook(cells=[cell])
    nb.metadata["widgets"] = {executed.WIDGET_STATE: {"state": {"a" * 32: {"big": "x" * executed.WIDGET_STATE_MAX}}}}
    path = executed.write(nb, tmp_path / "out" / "n.ipynb")
    text = path.read_text()
    for leak in (job_secret, "testing", "AKIAIOSFODNN7EXAMPLE", "kept-in-the-environment-42", str(REPO),
                 "/tmp/pytest-of-root", "/tmp/sm-train", home + "/", host, "10.11.12.13:", "\\u001b", '"big"'):
        assert leak not in text, f"{leak!r} survived the scrub"
    out = nbformat.read(path, as_version=4).cells[0].outputs
    assert out[0].text == ("SDP_JOB_SECRET=<secret>\naws_secret_access_key='<secret>' <secret>\ntoken leaked: <secret>\n"
                           "logs in <checkout>/notebooks/sdp_jobs/quickstart and <tmp>/jobs/a, config ~/.ssh/config\n"
                           "data in <tmp>/part-0.txt, kept in /var/tmp/sm-cache; ranks on <host>, <host>\n"
                           "head at <address>:6379, not 10.11.12.134 nor 127.0.0.1\n")
    assert out[1].traceback == ["ValueError in <checkout>/sdp_jupyter/launch/__init__.py"]
    assert out[2].data["application/vnd.jupyter.widget-view+json"]["model_id"] == "a" * 32  # views still find their model
    assert nb.cells[0].outputs[0].text == said, "the notebook given was changed"
    small = {"state": {"a" * 32: {"value": 1}}}
    nb.metadata["widgets"] = {executed.WIDGET_STATE: small}
    kept = nbformat.read(executed.write(nb, tmp_path / "small.ipynb"), as_version=4)
    assert kept.metadata["widgets"][executed.WIDGET_STATE] == small
