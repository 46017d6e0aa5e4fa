"""A target is one registered record (launch/target_options.py, its launcher in launch/kernel/targets.py):
a throwaway target registered with one call shows up in every list derived from the registry (the
magic's --target, the CLI's help, the setup form, the session check, the reference page) and a cell
run with %%sdp_train --target NAME goes through its launcher. And no module keeps a hand-written list
of target names or backends."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

TOY = '''
from sdp_jupyter.launch.kernel.local import LocalLauncher


class ToyLauncher(LocalLauncher):
    """Runs jobs like the local target, and counts them."""
    started = 0

    def start(self, spec, push=None):
        ToyLauncher.started += 1
        return super().start(spec, push)
'''

PROBE = r'''
import contextlib, io, json, sys
from sdp_jupyter.launch.kernel import targets
from sdp_jupyter.launch.target_options import Target
targets.register("toy", Target(warm=True, sessions=True), "toy_target:ToyLauncher")

found = {}
from sdp_jupyter import cli
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text):
    try:
        cli.main(["--help"])
    except SystemExit:
        pass
found["cli help"] = "toy" in help_text.getvalue()

from sdp_jupyter.launch.kernel import session
found["session targets"] = "toy" in session.TARGETS

from sdp_jupyter import JobSetup
from sdp_jupyter.ui.setup import JobSetupView
found["setup form"] = "toy" in JobSetupView(JobSetup("train.py")).w_target.options

sys.path.insert(0, "tools")
import gen_reference
found["reference page"] = "toy" in gen_reference.magics_page()

from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "sdp_jupyter")
import sdp_jupyter.magics as magics
found["magic help"] = "toy" in magics.SdpMagics.sdp_train.parser.format_help()
shell.run_cell_magic("sdp_train", "--target toy --nodes 2 --name toy-job", "print('hello from the toy target')")
import toy_target
from sdp_jupyter.launch import jobs
found["magic ran through the toy launcher"] = toy_target.ToyLauncher.started == 1
job = jobs()[-1]
job.wait(timeout=120)  # outside a kernel the magic returns once the job started
found["job succeeded, 2 nodes"] = (job.spec.target, job.spec.nodes, job.state) == ("toy", 2, "succeeded")
found["job output"] = "hello from the toy target" in job.logs(1)
print("FOUND", json.dumps(found))
'''


def test_a_throwaway_target_registered_once_is_everywhere(tmp_path):
    (tmp_path / "toy_target.py").write_text(TOY)
    env_path = f"{tmp_path}:{ROOT}"
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=str(ROOT), capture_output=True, text=True, timeout=180,
                       env={**__import__("os").environ, "PYTHONPATH": env_path, "SDP_JOBS_DIR": str(tmp_path / "jobs")})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("FOUND ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    found = json.loads(lines[0][len("FOUND "):])
    assert all(found.values()), found


# Hand-written lists the registries replaced: a tuple or list of two or more target names or backend
# names written out. The registries themselves (and the catalogue of SageMaker instance defaults,
# which maps backends to instance types) are where they belong.
_TARGET_NAMES = ("local", "ssh", "ray", "slurm", "sagemaker")
_BACKEND_NAMES = ("smddp", "gloo", "nccl")
_OWNERS = {"sdp_jupyter/launch/target_options.py", "sdp_jupyter/launch/kernel/targets.py", "sdp_jupyter/backends.py"}


def _literal_lists(names: tuple[str, ...]) -> list[str]:
    quoted = "|".join(re.escape(n) for n in names)
    pattern = re.compile(rf"[(\[]\s*[\"']({quoted})[\"']\s*,\s*[\"']({quoted})[\"']")
    hits = []
    for path in sorted((ROOT / "sdp_jupyter").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in _OWNERS or rel.startswith("sdp_jupyter/testing/"):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line) and not line.lstrip().startswith("#"):
                hits.append(f"{rel}:{n}: {line.strip()}")
    return hits


def test_no_hand_written_list_of_targets_or_backends_outside_the_registries():
    assert not _literal_lists(_TARGET_NAMES), _literal_lists(_TARGET_NAMES)
    assert not _literal_lists(_BACKEND_NAMES), _literal_lists(_BACKEND_NAMES)
