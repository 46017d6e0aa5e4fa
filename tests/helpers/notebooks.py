"""`notebook_run(name, request)`: each notebook of notebooks/ executed at most once per test session.

test_notebooks.py checks every notebook; test_newcomer_path.py walks 01 -> 09 -> 04 as a newcomer
would. Whichever asks first runs the notebook; the other reads the same run. Each run writes its
scrubbed executed copy to notebooks/executed/<name>.ipynb (tools/executed.py), which the docs show for a
notebook whose executed copy is not stored in notebooks/outputs/ (07_slurm, 09_ssh: they need root).

The kernel's environment lacks PYTEST_CURRENT_TEST (with it, ipykernel stops capturing subprocess
output) and points SDP_JOBS_DIR at a private folder, so the jobs a notebook starts are checked for
leftover processes after the kernel has shut down. 04_sagemaker runs against the local moto server,
never AWS, even where credentials exist.

07_slurm's kernel runs on h0 of the Slurm test cluster (the `slurm_hosts` fixture), as a notebook's
kernel on a login node would: Slurm's commands reach slurmctld only from the test hosts' network, and
SLURM_CONF is the kernel's environment, not the notebook's. 09_ssh and 11_elastic use the suite's
`ssh_hosts` (sshd on h1..h3) instead of starting hosts of its own: its parameters cell is followed by one
naming them (and, for 11_elastic, which cuts h3's link, the running test hosts' name).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import REPO, wait_no_processes
from tools.executed import EXECUTED


@dataclass
class NotebookRun:
    nb: object          # the notebook as executed (nbformat), unscrubbed
    jobs: Path          # SDP_JOBS_DIR of its kernel
    hosts: object = None  # the test hosts it ran on (slurm_hosts, ssh_hosts), if any


def inject_parameters(nb, source: str) -> None:
    """Add a cell setting `source` right after the cell tagged "parameters" (papermill's convention)."""
    from nbformat.v4 import new_code_cell

    at = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(at + 1, new_code_cell(source, metadata={"tags": ["injected-parameters"]}))


_DONE: dict[str, NotebookRun | BaseException] = {}  # by notebook name, for the whole session


def notebook_run(name: str, request) -> NotebookRun:
    """The run of notebooks/<name>; run it now if no test of this session has yet (a failed run is
    not tried again: the test that asked second fails with its error)."""
    if name not in _DONE:
        try:
            _DONE[name] = _run(REPO / "notebooks" / name, request)
        except BaseException as e:
            _DONE[name] = e
            raise
    run = _DONE[name]
    if isinstance(run, BaseException):
        pytest.fail(f"{name} failed earlier in this session: {type(run).__name__}: {str(run)[-3000:]}")
    return run


def _run(path: Path, request) -> NotebookRun:
    from tools.executed import execute

    folder = request.getfixturevalue("tmp_path_factory").mktemp(path.stem)
    jobs = folder / "jobs"
    km = hosts = prepare = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SDP_JOBS_DIR", str(jobs))
        mp.setenv("SDP_SAGEMAKER_MOTO", "1")
        if path.name == "07_slurm.ipynb":
            hosts = request.getfixturevalue("slurm_hosts")
            for key, value in hosts.env({}).items():  # the kernel's environment (kernel_env) carries it
                mp.setenv(key, value)
            mp.delenv("SLURM_JOB_ID", raising=False)  # the kernel submits, as on a login node
            km = hosts.cluster.kernel_manager(0, folder, cwd=path.parent)
        if path.name in ("09_ssh.ipynb", "11_elastic.ipynb"):
            hosts = request.getfixturevalue("ssh_hosts")
            config = hosts.outside_config()
            prepare = lambda nb: inject_parameters(  # noqa: E731
                nb, f"HOSTS = {','.join(hosts.hosts)!r}\nSSH_CONFIG = {str(config)!r}\nCLUSTER = {hosts.cluster.name!r}")
        try:
            nb = execute(path, EXECUTED, km=km, prepare=prepare)  # raises CellExecutionError naming the cell
        finally:
            if path.name == "11_elastic.ipynb":  # it cuts a link of the shared test hosts: healed whatever happened
                hosts.cluster.heal(3)
    left = wait_no_processes(jobs)
    assert left == [], f"a job process outlived {path.name}'s kernel: {[p.cmdline() for p in left]}"
    return NotebookRun(nb, jobs, hosts)
