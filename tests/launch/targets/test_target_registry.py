"""A target is one folder (sdp_jupyter/launch/targets/NAME/: its record in __init__, its launcher beside
it) plus one line of the registry. A throwaway target written as such a folder outside the package,
with an option of its own and a field of the setup form, and registered with one call, shows up in
every list derived from the registry (the magic's --target and options, the CLI's help, the setup
form, the session check, the reference page); a cell run with %%sdp_train --target NAME goes through
its launcher with its option in the spec. And no module keeps a hand-written list of target names or
backends, or names a target outside its folder."""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

TOY_RECORD = '''
from sdp_jupyter.launch.options import Option
from sdp_jupyter.launch.targets.record import FormField, Target

OPTIONS = (Option("--flavour", "toy.flavour", "--target toy: which flavour of toy", metavar="NAME"),)
RECORD = Target("toy", ".launcher:ToyLauncher", "toy", "toy_target:OPTIONS", frozenset({"flavour"}),
                form=(FormField("toy_flavour", OPTIONS[0], "Flavour", "vanilla"),),
                warm=True, sessions=True, exclusive=True)
'''

TOY_LAUNCHER = '''
from sdp_jupyter.launch.targets.local.launcher import LocalLauncher


class ToyLauncher(LocalLauncher):
    """Runs jobs like the local target, and keeps the options each job had."""
    options = []

    def start(self, spec, push=None):
        ToyLauncher.options.append(spec.options_of("toy"))
        return super().start(spec, push)
'''

PROBE = r'''
import contextlib, io, json, sys
from sdp_jupyter.launch import targets
targets.register("toy_target")

found = {}
from sdp_jupyter import cli
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text):
    try:
        cli.main(["--help"])
    except SystemExit:
        pass
found["cli help"] = "toy" in help_text.getvalue() and "--flavour" in help_text.getvalue()

from sdp_jupyter.launch.kernel import session
found["session targets"] = "toy" in session.TARGETS

from sdp_jupyter import JobSetup
from sdp_jupyter.jobsetup import setup_from_line
from sdp_jupyter.ui.setup import JobSetupView
view = JobSetupView(JobSetup(code="pass"))
found["setup form"] = "toy" in view.w_target.options and "toy_flavour" in view.w_form
view.w_target.value = "toy"
view.w_form["toy_flavour"].value = "mint"
found["form field shown and in the spec"] = (view.w_form_boxes["toy"].layout.display is None
                                             and view.model.spec.options_of("toy") == {"flavour": "mint"})
found["%sdp_setup option"] = setup_from_line("train.py --target toy --flavour lime").values["toy_flavour"] == "lime"

from sdp_jupyter.launch import JobSpec, SpecError
try:
    JobSpec(code="pass", target_options={"toy": {"flavour": "x"}})
    found["its option refused with another target"] = False
except SpecError as e:
    found["its option refused with another target"] = "--flavour" in str(e)

sys.path.insert(0, "tools")
import gen_reference
found["reference page"] = "toy" in gen_reference.magics_page()

from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "sdp_jupyter")
import sdp_jupyter.magics as magics
found["magic help"] = "toy" in magics.SdpMagics.sdp_train.parser.format_help()
shell.run_cell_magic("sdp_train", "--target toy --flavour mint --nodes 2 --name toy-job",
                     "print('hello from the toy target')")
from toy_target.launcher import ToyLauncher
from sdp_jupyter.launch import jobs
found["magic ran through the toy launcher, its option in the spec"] = ToyLauncher.options == [{"flavour": "mint"}]
job = jobs()[-1]
job.wait(timeout=120)  # outside a kernel the magic returns once the job started
found["job succeeded, 2 nodes"] = (job.spec.target, job.spec.nodes, job.state) == ("toy", 2, "succeeded")
found["job output"] = "hello from the toy target" in job.logs(1)
print("FOUND", json.dumps(found))
'''


def test_a_throwaway_target_in_one_folder_registered_with_one_line_is_everywhere(tmp_path):
    folder = tmp_path / "toy_target"
    folder.mkdir()
    (folder / "__init__.py").write_text(TOY_RECORD)
    (folder / "launcher.py").write_text(TOY_LAUNCHER)
    env_path = f"{tmp_path}:{ROOT}"
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=str(ROOT), capture_output=True, text=True, timeout=180,
                       env={**__import__("os").environ, "PYTHONPATH": env_path, "SDP_JOBS_DIR": str(tmp_path / "jobs")})
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("FOUND ")]
    assert p.returncode == 0 and lines, p.stdout[-3000:] + p.stderr[-3000:]
    found = json.loads(lines[0][len("FOUND "):])
    assert all(found.values()), found


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def files_naming(name: str) -> list[str]:
    """The package's files outside the paths that carry `name` whose code (not a docstring) has a string
    naming it as a word ("slurm", "--target slurm", "slurm job ...")."""
    word = re.compile(rf"(?<![A-Za-z]){re.escape(name)}(?![A-Za-z])")
    hits = []
    for path in sorted((ROOT / "sdp_jupyter").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if name in rel:
            continue
        tree = ast.parse(path.read_text())
        skip = _docstrings(tree)
        if any(isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in skip and word.search(n.value)
               for n in ast.walk(tree)):
            hits.append(rel)
    return hits


def test_outside_a_target_s_folder_only_the_registry_names_it():
    for name in ("ssh", "ray", "slurm"):
        assert files_naming(name) == ["sdp_jupyter/launch/targets/__init__.py"], (name, files_naming(name))


# Hand-written lists the registries replaced: a tuple or list of two or more target names or backend
# names written out. The registries themselves (and the catalogue of SageMaker instance defaults,
# which maps backends to instance types) are where they belong.
_TARGET_NAMES = ("local", "ssh", "ray", "slurm", "sagemaker")
_BACKEND_NAMES = ("smddp", "gloo", "nccl")
_OWNERS = {"sdp_jupyter/launch/targets/__init__.py", "sdp_jupyter/backends.py"}


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
