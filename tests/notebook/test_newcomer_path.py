"""A newcomer's path, step by step: README's first job, run as shown -> install (or the migration guide) -> a first job (01_quickstart) -> their own
machines over SSH (09_ssh) -> SageMaker, rehearsed first (04_sagemaker).

Each step reads what the pages tell the reader (links, shell commands, `%%sdp_train` lines) and checks
it against the code: a link to a page that is not there, a `./dev.sh` command dev.sh does not have, a
`pip install` extra pyproject.toml does not define, a `python -m` module that does not exist, or a
magic line the option table refuses fails here. Then it runs the step's notebook through
helpers.notebooks.notebook_run, so a notebook test_notebooks.py checks too runs once per session.
The steps are in order; each says which page it followed.
"""
from __future__ import annotations

import importlib.util
import re
import shlex
import tomllib
from pathlib import Path

import pytest

from conftest import REPO
from helpers.notebooks import notebook_run
from tools.executed import EXECUTED

README = REPO / "README.md"
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"```(\w*)\n(.*?)```", re.S)
INLINE = re.compile(r"`([^`\n]+)`")
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def links(page: Path) -> list[Path]:
    """The pages and files `page` links to (relative links; anchors dropped)."""
    out = []
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith(("#", "mailto:")):
            continue
        out.append((page.parent / target.split("#")[0]).resolve())
    return out


def logical_lines(block: str) -> list[str]:
    """A code block's lines with `\\` continuations joined, prompts and trailing comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line.strip()).strip()
        line = line[2:] if line.startswith("$ ") else line
        if line:
            out.append(line)
    return out


def shell_commands(page: Path) -> list[str]:
    text = page.read_text()
    fenced = [line for lang, body in FENCE.findall(text) if lang in ("bash", "sh", "shell", "console")
              for line in logical_lines(body)]
    inline = [m for m in INLINE.findall(text) if m.startswith(("python -m ", "./dev.sh ", "pip install "))]
    return [c for c in fenced + inline if not c.startswith(("%", "import ", "from "))]


def magic_lines(page: Path, magic: str = "%%sdp_train") -> list[str]:
    return [line for _, body in FENCE.findall(page.read_text()) for line in logical_lines(body)
            if line.startswith(magic + " ")]


def dev_sh_commands() -> set[str]:
    return set(re.findall(r"^    (\w+)\)$", (REPO / "dev.sh").read_text(), re.M))


def check_command(command: str) -> str | None:
    """Why `command` cannot work as the page gives it, or None."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        return f"not a shell command ({e})"
    if argv[0] == "./dev.sh":
        if len(argv) < 2 or argv[1] not in dev_sh_commands():
            return f"dev.sh has no command {argv[1:2]} (it has {sorted(dev_sh_commands())})"
    if argv[:2] == ["pip", "install"] or argv[:4] == ["python", "-m", "pip", "install"]:
        extras = set(PYPROJECT["project"]["optional-dependencies"])
        for arg in argv:
            if re.fullmatch(r"sdp_jupyter(\[[\w,-]+\])?", arg):  # pip would look for it on an index
                return f"{arg}: no package index serves sdp_jupyter; install from a checkout (pip install -e '.[...]')"
            m = re.fullmatch(r"\.\[([\w,-]+)\]", arg)
            if m and not set(m.group(1).split(",")) <= extras:
                return f"{arg}: pyproject.toml defines the extras {sorted(extras)}"
    elif argv[:2] == ["python", "-m"] and argv[2].startswith("sdp_jupyter"):
        if importlib.util.find_spec(argv[2]) is None:
            return f"no module {argv[2]}"
    elif argv[0] == "python" and len(argv) > 1 and argv[1].endswith(".py") and not (REPO / argv[1]).is_file():
        return f"{argv[1]} does not exist"
    elif argv[0] == "sdp-train" and "sdp-train" not in PYPROJECT["project"]["scripts"]:
        return "pyproject.toml installs no sdp-train"
    return None


def check_magic(line: str):
    """The JobSpec a page's `%%sdp_train` line makes (SpecError or a usage error if it is wrong)."""
    from sdp_jupyter.launch import JobSpec
    from sdp_jupyter.magics import SdpMagics, parse_line

    args = parse_line(SdpMagics.sdp_train, line[len("%%sdp_train "):])
    return JobSpec.from_options(vars(args), code="pass")


def follow(page: Path, to: str) -> Path:
    """The page `page` links to whose path ends with `to`; fails when there is no such link."""
    found = [p for p in links(page) if p.as_posix().endswith(to)]
    assert found, f"{page.name} does not link to {to}"
    assert found[0].exists(), f"{page.name} links to {to}, which does not exist"
    return found[0]


def stream_text(nb, starts: str) -> str:
    cell = next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(starts))
    return "".join(o.get("text", "") for o in cell.outputs if o.get("output_type") == "stream")


def test_check_command_can_fail():
    assert check_command("./dev.sh deploy") and check_command("pip install '.[nonesuch]'")
    assert check_command("pip install 'sdp_jupyter[rehearse]'")  # no index serves it
    assert check_command("python -m sdp_jupyter.nonesuch") and check_command("python benchmarks/nonesuch.py")
    assert check_command("./dev.sh main") is None and check_command("pip install -e '.[rehearse]'") is None
    with pytest.raises(Exception, match="--nodes"):
        check_magic("%%sdp_train --nodes zero")


def readme_first_job() -> tuple[list[str], list[str]]:
    """README's "A first job": its python cells and the text blocks that show what they print, in order."""
    text = README.read_text()
    section = text[text.index("## A first job"):]
    section = section[:section.index("\n## ", 3)]
    blocks = FENCE.findall(section)
    return [b for lang, b in blocks if lang == "python"], [b for lang, b in blocks if lang == "text"]


def printed_shape(text: str) -> str:
    """What a job's line says with its timing and folder taken out."""
    text = re.sub(r"\d+(\.\d+)? s\b", "N s", text.strip())
    return re.sub(r" in \S*/sdp_jobs/", " in .../sdp_jobs/", text)


def test_printed_shape_can_fail():
    line = "Job first-job: succeeded after 17.3 s (4 node(s) x 1 proc(s), backend smddp) in /x/sdp_jobs/first-job"
    assert printed_shape(line) == printed_shape(line.replace("17.3", "9.0").replace("/x/", "/home/y/"))
    assert printed_shape(line) != printed_shape(line.replace("succeeded", "failed"))
    assert printed_shape(line) != printed_shape(line.replace("4 node(s)", "2 node(s)"))


@pytest.mark.slow
def test_step0_the_readme_first_job_prints_what_the_readme_shows(tmp_path, monkeypatch):
    """The README's cells, run as they are in a fresh kernel from a folder of its own, print what the
    README says they print: the job's line (timing and folder aside) and the trained weights exactly."""
    import nbformat
    from nbclient import NotebookClient

    from conftest import wait_no_processes
    from tools.executed import kernel_env

    cells, shown = readme_first_job()
    assert len(cells) == 3 and len(shown) == 2, "README's first job: load, train, show weights; two outputs"
    assert cells[1].startswith("%%sdp_train --nodes 4 ") and check_magic(cells[1].splitlines()[0]).nodes == 4
    monkeypatch.setenv("SDP_JOBS_DIR", str(tmp_path / "sdp_jobs"))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.rstrip("\n")) for c in cells])
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute(env=kernel_env(), cleanup_kc=True)
    printed = "".join(o.get("text", "") for o in nb.cells[1].outputs if o.get("output_type") == "stream")
    assert printed_shape(printed) == printed_shape(shown[0]), printed
    result = [o["data"]["text/plain"] for o in nb.cells[2].outputs if o.get("output_type") == "execute_result"]
    assert result == [shown[1].strip()], result
    assert wait_no_processes(tmp_path / "sdp_jobs") == []


def test_step1_readme_and_install_page_give_commands_that_exist():
    broken = [p for p in links(README) if not p.exists()]
    assert not broken, f"README links to pages that do not exist: {broken}"
    pages = [README]
    install = [p for p in links(README) if p.name == "install.md"]
    pages += install  # the install page, where the README sends the reader; else the README's own commands
    pages.append(follow(README, "docs/migration.md"))  # the reader who comes with a torchrun or SMDDP script
    commands = [(page.name, c) for page in pages for c in shell_commands(page)]
    assert any(c.startswith(("./dev.sh main", "pip install")) for _, c in commands), \
        f"no install command on {[p.name for p in pages]}: {commands}"
    wrong = [(page, c, why) for page, c in commands if (why := check_command(c))]
    assert not wrong, f"commands the pages give that cannot work: {wrong}"
    for page in pages:
        for line in magic_lines(page):
            check_magic(line)
    named = set(re.findall(r"\b(\d\d_\w+\.ipynb)", README.read_text()))
    have = {p.name for p in (REPO / "notebooks").glob("*.ipynb")}
    assert named == have, f"README's notebook list: names missing notebooks {named - have}, leaves out {have - named}"


@pytest.mark.slow
def test_step2_first_job_is_the_quickstart(request):
    assert "notebooks/01_quickstart.ipynb" in README.read_text()
    shown = [line for line in magic_lines(README) if "--target" not in line]  # the README's own first job
    assert shown and all(check_magic(line).nodes == 4 for line in shown), shown
    nb = notebook_run("01_quickstart.ipynb", request).nb
    assert "Job quickstart: succeeded" in stream_text(nb, "%%sdp_train --nodes 4")
    assert (EXECUTED / "01_quickstart.ipynb").is_file()


@pytest.mark.slow
def test_step3_own_machines_over_ssh(request):
    ssh_page = follow(README, "docs/ssh.md")
    specs = [check_magic(line) for line in magic_lines(ssh_page)]
    assert specs and all(s.target == "ssh" for s in specs), "docs/ssh.md shows no %%sdp_train --target ssh line"
    assert "09_ssh.ipynb" in README.read_text()
    nb = notebook_run("09_ssh.ipynb", request).nb
    assert "Job ssh-quickstart: succeeded" in stream_text(nb, "%%sdp_train --target ssh")
    assert (EXECUTED / "09_ssh.ipynb").is_file()


@pytest.mark.slow
def test_step4_sagemaker_rehearsed_first(request):
    pytest.importorskip("sagemaker.train")
    pytest.importorskip("moto.server")
    sm_page = follow(README, "docs/sagemaker.md")
    rehearsals = [s for s in map(check_magic, magic_lines(sm_page)) if s.sagemaker and s.sagemaker.get("rehearse")]
    assert rehearsals, "docs/sagemaker.md shows no %%sdp_train --target sagemaker --rehearse line"
    nb = notebook_run("04_sagemaker.ipynb", request).nb
    code = [c.source for c in nb.cells if c.cell_type == "code" and c.source.startswith("%%sdp_train")]
    assert "--rehearse " in code[0], "the notebook does not rehearse before it submits"
    assert "succeeded" in stream_text(nb, code[0].splitlines()[0])
    assert (EXECUTED / "04_sagemaker.ipynb").is_file()
