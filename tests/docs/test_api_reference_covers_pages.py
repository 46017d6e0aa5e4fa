"""Every sdp_jupyter name README.md, docs/*.md and the notebooks tell a user to import or call has its entry
on the API page (docs/reference/api.md, made by tools/gen_reference.py from API_MODULES): the page says it
lists what this version has, so a guide cannot send a reader to a name the reference leaves out.

What counts as telling a user: the Python of a fenced code block (an untagged or python one) or a
notebook's code cell (imports, and the attributes reached through them: `from sdp_jupyter import parallel`
then `parallel.setup(...)` is sdp_jupyter.parallel.setup), and, in prose, a code span that calls a
dotted name (`sdp_jupyter.parallel.setup()`) or imports one. `python -m sdp_jupyter...` is a command line
(reference/cli.md), not an API use. Private names (a segment with a leading underscore) and the test
helpers (sdp_jupyter.testing) are not public API: they are left out here."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
API_PAGE = ROOT / "docs" / "reference" / "api.md"
DOTTED = re.compile(r"\bsdp_jupyter(?:\.[A-Za-z_]\w*)+")
FROM = re.compile(r"^\s*from\s+(sdp_jupyter(?:\.\w+)*)\s+import\s+([\w ,]+)", re.M)
COMMAND = re.compile(r"\bpython3?(?: -u)? -m \S+")

#: used by a page, public, but without a docstring in the code (a dataclass's generated one does not count):
#: the generator refuses an entry without a meaning, so each needs its docstring (or `#:` comment) first
NO_DOCSTRING = {"sdp_jupyter.advisor.Workload", "sdp_jupyter.advisor.REFERENCES", "sdp_jupyter.parallel.gpt.GPT",
                "sdp_jupyter.parallel.gpt.GPTConfig"}


def fenced(text: str) -> tuple[list[tuple[str, str]], str]:
    """(language, code) of each fenced block of a Markdown text, and the prose outside them."""
    blocks, prose, body, lang, fence = [], [], None, "", ""
    for line in text.splitlines():
        opening = re.match(r"^\s*(`{3,}|~{3,})\s*([\w+-]*)", line)
        if body is None and opening:
            body, fence, lang = [], opening.group(1), opening.group(2)
        elif body is not None and line.strip() and not line.strip().strip(fence[0]) and line.strip().startswith(fence):
            blocks.append((lang, "\n".join(body)))
            body = None
        elif body is not None:
            body.append(line)
        else:
            prose.append(line)
    return blocks, "\n".join(prose)


def python_uses(code: str) -> set[str]:
    """The sdp_jupyter names a piece of Python imports or reaches (magics and shell lines left out); code
    that does not parse (an excerpt with `...`) by its dotted names and from-imports."""
    lines = ["" if ln.lstrip().startswith(("%", "!", ">>>")) else ln for ln in code.splitlines()]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        text = COMMAND.sub("", code)
        found = set(DOTTED.findall(text))
        for module, names in FROM.findall(text):
            found |= {f"{module}.{n.split(' as ')[0].strip()}" for n in names.split(",") if n.strip()}
        return found
    bound, found = {}, set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in (a for a in node.names if a.name.split(".")[0] == "sdp_jupyter"):
                found.add(a.name)
                bound[a.asname or "sdp_jupyter"] = a.name if a.asname else "sdp_jupyter"
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] == "sdp_jupyter":
            for a in node.names:
                found.add(f"{node.module}.{a.name}")
                bound[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        chain = []
        while isinstance(node, ast.Attribute):
            chain.insert(0, node.attr)
            node = node.value
        if chain and isinstance(node, ast.Name) and node.id in bound:
            found.add(".".join([bound[node.id]] + chain))
    return found


def prose_uses(prose: str) -> set[str]:
    found = set()
    for span in re.findall(r"`([^`\n]+)`", COMMAND.sub("", prose)):
        found |= set(re.findall(r"\b(sdp_jupyter(?:\.[A-Za-z_]\w*)+)\s*\(", span))
        if span.startswith(("from sdp_jupyter", "import sdp_jupyter")):
            found |= python_uses(span)
    return found


def markdown_uses(text: str) -> set[str]:
    blocks, prose = fenced(text)
    found = prose_uses(prose)
    for lang, code in blocks:
        if lang in ("", "python", "py", "ipython"):
            found |= python_uses(code)
    return found


def page_uses() -> dict[str, set[str]]:
    """sdp_jupyter name -> the pages that tell a user to import or call it."""
    uses: dict[str, set[str]] = {}
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    for path in pages + sorted((ROOT / "notebooks").glob("*.ipynb")):
        if path.suffix == ".md":
            found = markdown_uses(path.read_text())
        else:
            found = set()
            for c in json.loads(path.read_text())["cells"]:
                source = "".join(c["source"])
                found |= python_uses(source) if c["cell_type"] == "code" else markdown_uses(source)
        for name in found:
            uses.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return uses


def is_public(name: str) -> bool:
    parts = name.split(".")
    return not any(p.startswith("_") for p in parts) and parts[:2] != ["sdp_jupyter", "testing"]


def resolve(name: str):
    """The object a dotted name names: the longest importable module, then attributes."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def entries(page: str) -> dict[str, str]:
    """qualname -> the text of its entry (a `##` module section or a `###` name) on the API page."""
    found = {}
    for chunk in re.split(r"^(?=#{2,3} )", page, flags=re.M)[1:]:
        heading, _, body = chunk.partition("\n")
        found[heading.lstrip("#").strip()] = body
    return found


def missing_from(page: str, names) -> list[str]:
    """The names not documented on `page`: under their own name, under another one for the same object
    (sdp_jupyter.launch.Job is sdp_jupyter.Job), or as a member of a documented class (Job.open)."""
    documented = entries(page)
    objects = {id(resolve(q)): q for q in documented}
    missing = []
    for name in sorted(names):
        owner, _, member = name.rpartition(".")
        if name in documented or id(resolve(name)) in objects:
            continue
        home = objects.get(id(resolve(owner))) if owner != "sdp_jupyter" else None
        if home and re.search(rf"^\| `{re.escape(member)}[(`]", documented[home], re.M):
            continue
        missing.append(name)
    return missing


def test_every_public_name_a_page_uses_is_on_the_api_page():
    uses = page_uses()
    public = {n: pages for n, pages in uses.items() if is_public(n) and n not in NO_DOCSTRING}
    missing = missing_from(API_PAGE.read_text(), public)
    assert not missing, ("the guides use these but docs/reference/api.md lacks them: add them to API_MODULES of "
                         "tools/gen_reference.py and run it: " + "; ".join(f"{n} ({', '.join(sorted(public[n]))})"
                                                                            for n in missing))


def test_the_names_without_a_docstring_still_have_none():
    """NO_DOCSTRING is true: once a name gets its docstring, it goes on the page (and off this list)."""
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "tools" / "gen_reference.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    uses = page_uses()
    for name in NO_DOCSTRING:
        assert name in uses, f"{name}: no page uses it any more; take it off NO_DOCSTRING"
        module, _, attr = name.rpartition(".")
        obj = resolve(name)
        doc = gen.constant_doc(resolve(module), attr) if not callable(obj) else gen.own_doc(obj)
        assert not doc.strip(), f"{name} has a docstring now: add it to API_MODULES and take it off NO_DOCSTRING"


def test_the_scan_finds_what_the_guides_tell_users_to_call():
    uses = page_uses()
    for name, page in [("sdp_jupyter.heal.Healer", "docs/failures.md"),
                       ("sdp_jupyter.parallel.setup", "notebooks/05_model_parallel.ipynb"),
                       ("sdp_jupyter.advisor.estimate", "docs/model_parallel.md"),
                       ("sdp_jupyter.scaling.warmup_lr", "notebooks/02_job_setup.ipynb")]:
        assert page in uses.get(name, ()), (name, page)
    assert not any(n.startswith("sdp_jupyter.flight") for n in uses)  # `python -m sdp_jupyter.flight`: a command


def test_a_name_missing_from_the_page_is_found():
    page = ("## sdp_jupyter\n\n### sdp_jupyter.Job\n\n| member | kind | what it does |\n| --- | --- | --- |\n"
            "| `open(name)` | classmethod | reopen |\n\n## sdp_jupyter.heal\n\n### sdp_jupyter.heal.HealError\n")
    uses = markdown_uses("```python\nfrom sdp_jupyter import heal\nfrom sdp_jupyter.launch import Job\n"
                         "healer = heal.Healer(model)\nJob.open('x')\n```\n"
                         "Call `sdp_jupyter.parallel.setup()` first; `python -m sdp_jupyter.flight DIR` says more.\n")
    assert uses == {"sdp_jupyter.heal", "sdp_jupyter.heal.Healer", "sdp_jupyter.launch.Job",
                    "sdp_jupyter.launch.Job.open", "sdp_jupyter.parallel.setup"}
    assert missing_from(page, uses) == ["sdp_jupyter.heal.Healer", "sdp_jupyter.parallel.setup"]
