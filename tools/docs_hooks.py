"""MkDocs hooks for the docs site (mkdocs.yml `hooks:`): the notebooks become pages, and links that
point out of docs/ work in the site as they do on GitHub.

- Every `notebooks/<name>.ipynb` becomes the page `notebooks/<name>.md` with its outputs, rendered from
  the executed copy stored in the repository, `notebooks/outputs/<name>.ipynb` (kept current by
  `python tools/executed.py refresh`; a test fails when one is older than its notebook), else from the
  executed copy a local run left in `notebooks/executed/<name>.ipynb` (the notebook tests leave one for
  every notebook, 07_slurm, 09_ssh and 11_elastic included, which need root to run), else from the stored notebook
  with a note that outputs are not included. Nothing is executed at build time.
- In every page (docs and notebooks alike), a relative link is resolved from where the page lives in
  the repository: to a notebook, it becomes a link to the notebook's page; to a page under docs/, a
  link to that page; to any other file of the repository (code, benchmarks, README), the path as a
  code span, since the site has no copy of it. A link to nothing is left as written, so strict mode
  reports it.
"""
from __future__ import annotations

import base64
import posixpath
import re
from pathlib import Path

import nbformat
from mkdocs.structure.files import File

NOTEBOOKS = "notebooks"
OUTPUTS = "outputs"    # executed copies stored in the repository (tools/executed.py refresh)
EXECUTED = "executed"  # executed copies a local run left (ignored by git)
# [text](target) or [text](target "title"), not an image; the target has no spaces
LINK_RE = re.compile(r"(?<!!)\[(?P<text>[^\]\n]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
FENCE_RE = re.compile(r"^(`{3,}|~{3,})", re.M)


def _repo(config) -> Path:
    return Path(config.config_file_path).resolve().parent


def _docs(config) -> Path:
    return Path(config.docs_dir).resolve()


def notebook_source(repo: Path, name: str) -> tuple[Path, bool]:
    """The file the page of notebook `name` is rendered from, and whether it carries outputs: the stored
    executed copy, else a local run's, else the notebook itself."""
    for folder in (OUTPUTS, EXECUTED):
        executed = repo / NOTEBOOKS / folder / f"{name}.ipynb"
        if executed.is_file():
            return executed, True
    return repo / NOTEBOOKS / f"{name}.ipynb", False


def on_files(files, config):
    repo = _repo(config)
    for stored in sorted((repo / NOTEBOOKS).glob("*.ipynb")):
        source, executed = notebook_source(repo, stored.stem)
        page = File.generated(config, f"{NOTEBOOKS}/{stored.stem}.md",
                              content=notebook_markdown(nbformat.read(source, as_version=4), executed))
        files.append(page)
    return files


def on_page_markdown(markdown, page, config, files):
    repo, docs = _repo(config), _docs(config)
    src = page.file.src_uri
    if page.file.generated_by and src.startswith(f"{NOTEBOOKS}/"):
        where = repo / NOTEBOOKS  # a notebook's own links are relative to notebooks/ in the repository
    else:
        where = (docs / src).parent
    return rewrite_links(markdown, where, src, repo, docs)


def rewrite_links(markdown: str, where: Path, page_uri: str, repo: Path, docs: Path) -> str:
    """Links resolved from `where` (the page's folder in the repository) made to work in the site."""
    def fix(m):
        target = m.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith(("#", "/")):
            return m.group(0)
        path, _, anchor = target.partition("#")
        resolved = (where / path).resolve()
        if not resolved.exists() or not resolved.is_relative_to(repo):
            return m.group(0)
        if resolved.is_relative_to(docs):
            uri = resolved.relative_to(docs).as_posix()
        elif resolved.parent == repo / NOTEBOOKS and resolved.suffix == ".ipynb":
            uri = f"{NOTEBOOKS}/{resolved.stem}.md"
        else:
            shown = resolved.relative_to(repo).as_posix() + ("/" if resolved.is_dir() else "")
            text = m.group("text")
            return f"`{shown}`" if text.strip("`") in (shown, shown.rstrip("/"), path) else f"{text} (`{shown}`)"
        rel = posixpath.relpath(uri, posixpath.dirname(page_uri) or ".")
        return f"[{m.group('text')}]({rel}{'#' + anchor if anchor else ''}{m.group('title') or ''})"

    return LINK_RE.sub(fix, markdown)


def fenced(text: str, lang: str = "") -> str:
    """`text` in a code fence longer than any fence inside it."""
    longest = max((len(f) for f in FENCE_RE.findall(text)), default=2)
    fence = "`" * max(3, longest + 1)
    return f"{fence}{lang}\n{text.rstrip()}\n{fence}"


def output_markdown(out) -> str:
    kind = out.output_type
    if kind == "stream":
        return fenced(ANSI_RE.sub("", out.text), "text")
    if kind == "error":
        return fenced(ANSI_RE.sub("", "\n".join(out.traceback)), "text")
    data = out.get("data", {})
    if "image/png" in data:
        png = data["image/png"]
        png = png if isinstance(png, str) else base64.b64encode(png).decode()
        return f'<img alt="output" src="data:image/png;base64,{png.strip()}">'
    if "text/markdown" in data:
        return data["text/markdown"]
    text = ANSI_RE.sub("", data.get("text/plain", ""))
    if "application/vnd.jupyter.widget-view+json" in data:
        return f"*A live widget in Jupyter; its text form:*\n\n{fenced(text, 'text')}"
    return fenced(text, "text") if text else ""


def notebook_markdown(nb, executed: bool) -> str:
    parts = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            parts.append(cell.source)
        elif cell.cell_type == "code":
            parts.append(fenced(cell.source, "python"))
            parts.extend(filter(None, (output_markdown(o) for o in cell.get("outputs", []))))
        if i == 0 and not executed:
            parts.append('!!! note "Outputs are not included"\n    This page shows the notebook as stored, '
                         "without outputs: no executed copy was found when the site was built (the "
                         "notebooks that start test hosts need root to run, so the repository stores "
                         "none of theirs). Run it "
                         "yourself in JupyterLab to see them.")
    return "\n\n".join(parts) + "\n"
