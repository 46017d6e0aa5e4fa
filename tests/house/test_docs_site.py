"""The docs site (mkdocs.yml) builds in strict mode: a broken link or anchor, a page missing from the
nav or a nav entry without its page fails here, with MkDocs' warnings in the message.

The notebook pages show the executed copies stored in notebooks/outputs/ (tools/executed.py), and for
the notebooks that have none (07_slurm, 09_ssh: they need root) the copies a run left in
notebooks/executed/; the test runs last in the session (the `last` marker, tests/conftest.py), so
those are the ones the suite's notebook tests just made."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="mkdocs comes with the test extra (pip install '.[test]')")

ROOT = Path(__file__).resolve().parents[2]


def build(project: Path, site: Path) -> tuple[int, list[str]]:
    """`mkdocs build --strict` of `project`'s mkdocs.yml into `site`: the exit status and the warnings."""
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site),
                          "--config-file", str(project / "mkdocs.yml")],
                         capture_output=True, text=True, timeout=300)
    out = run.stdout + run.stderr
    return run.returncode, [line for line in out.splitlines() if line.startswith(("WARNING", "ERROR", "Aborted"))] \
        or ([] if run.returncode == 0 else out.splitlines()[-20:])


@pytest.mark.last
def test_the_site_builds_strict(tmp_path):
    code, problems = build(ROOT, tmp_path / "site")
    assert code == 0, "mkdocs build --strict failed:\n" + "\n".join(problems)
    notebooks = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))
    pages = sorted(p.parent.name for p in (tmp_path / "site" / "notebooks").glob("*/index.html"))
    assert pages == notebooks, "every notebook has its page in the site"


def copy_project(dest: Path) -> Path:
    """What the site is built from (mkdocs.yml, docs/, the hook, the notebooks) copied to `dest`."""
    dest.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", dest / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", dest / "docs")
    (dest / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "docs_hooks.py", dest / "tools" / "docs_hooks.py")
    shutil.copytree(ROOT / "notebooks", dest / "notebooks", ignore=shutil.ignore_patterns("sdp_jobs"))
    return dest


def test_a_broken_link_fails_the_build(tmp_path):
    project = copy_project(tmp_path / "project")
    page = project / "docs" / "install.md"
    page.write_text(page.read_text() + "\nSee [the missing page](no_such_page.md).\n")
    code, problems = build(project, tmp_path / "site")
    assert code != 0, "a link to a missing page must fail the strict build"
    assert any("no_such_page.md" in line for line in problems), problems


def test_notebook_pages_show_outputs_only_from_an_executed_copy(tmp_path):
    """The hook renders the stored copy (notebooks/outputs/) with its outputs, else a local run's
    (notebooks/executed/); without either, the notebook as stored and a note."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import docs_hooks
    finally:
        sys.path.remove(str(ROOT / "tools"))
    import nbformat

    def notebook(said: str):
        return nbformat.v4.new_notebook(cells=[
            nbformat.v4.new_markdown_cell("# Title\n\nSee [setup](02_job_setup.ipynb) and "
                                          "[the engine](../docs/engine.md)."),
            nbformat.v4.new_code_cell("print('hi')", outputs=[nbformat.v4.new_output("stream", text=said)]),
        ])

    nb = notebook("hi\n")
    (tmp_path / "notebooks" / "executed").mkdir(parents=True)
    (tmp_path / "notebooks" / "outputs").mkdir(parents=True)
    nbformat.write(nb, tmp_path / "notebooks" / "x.ipynb")
    source, executed = docs_hooks.notebook_source(tmp_path, "x")
    assert (source.name, executed) == ("x.ipynb", False)
    stored = docs_hooks.notebook_markdown(nbformat.read(source, as_version=4), executed)
    assert "Outputs are not included" in stored and "```python\nprint('hi')\n```" in stored

    nbformat.write(nb, tmp_path / "notebooks" / "executed" / "x.ipynb")
    source, executed = docs_hooks.notebook_source(tmp_path, "x")
    assert source.parent.name == "executed" and executed
    shown = docs_hooks.notebook_markdown(nbformat.read(source, as_version=4), executed)
    assert "Outputs are not included" not in shown and "```text\nhi\n```" in shown

    nbformat.write(notebook("hi from the stored copy\n"), tmp_path / "notebooks" / "outputs" / "x.ipynb")
    source, executed = docs_hooks.notebook_source(tmp_path, "x")
    assert source.parent.name == "outputs" and executed, "the stored copy comes before a local run's"
    shown = docs_hooks.notebook_markdown(nbformat.read(source, as_version=4), executed)
    assert "```text\nhi from the stored copy\n```" in shown

    (tmp_path / "notebooks" / "02_job_setup.ipynb").write_text("{}")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "engine.md").write_text("# Engine\n")
    (tmp_path / "setup.py").write_text("")
    fixed = docs_hooks.rewrite_links(stored + "[build](../setup.py) [gone](../nowhere.py)",
                                     tmp_path / "notebooks", "notebooks/x.md", tmp_path, tmp_path / "docs")
    assert "[setup](02_job_setup.md)" in fixed and "[the engine](../engine.md)" in fixed
    assert "build (`setup.py`)" in fixed and "[gone](../nowhere.py)" in fixed  # a link to nothing stays, to fail
