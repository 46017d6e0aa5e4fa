"""Markdown text for the reference pages (tools/gen_reference.py): table cells, code spans, escaped prose,
and whole docstrings as Markdown blocks or as one table cell."""
from __future__ import annotations

import inspect
import re
import textwrap


def cell(text) -> str:
    """Text for a Markdown table cell: one line, with |, <, > and * kept literal."""
    s = " ".join(str(text).split())
    return s.replace("\\", "\\\\").replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("*", "\\*")


def code(text) -> str:
    s = " ".join(str(text).split()).replace("|", "\\|")
    return f"`` {s} ``" if "`" in s else f"`{s}`"


def first_paragraph(doc: str | None) -> str:
    doc = inspect.cleandoc(doc or "")
    return " ".join(doc.split("\n\n")[0].split())


CODE_SPAN = re.compile(r"(``.+?``|`[^`\n]+`)")
ITEM = re.compile(r"^(?:[-*] |\d+\. )")
DEFINITION = re.compile(r"^`?\*{0,2}[A-Za-z_][\w.]*\*{0,2}`?(?: \([^)]*\))?: ")


def escape(text: str, table: bool = False) -> str:
    """Prose as Markdown shows it literally: outside `code spans`, backslashes, * < > and __ are escaped
    (| too in a table, where it would end the cell); a code span stays as written."""
    out = []
    for i, part in enumerate(CODE_SPAN.split(text)):
        if i % 2 == 0:
            part = (part.replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;").replace(">", "&gt;")
                    .replace("__", "\\_\\_"))
        if table:
            part = part.replace("|", "\\|")
        out.append(part)
    s = "".join(out)
    return "\\" + s if s.startswith("#") else s


def doc_blocks(doc: str | None) -> list[tuple[str, str]]:
    """A whole docstring as ("p", paragraph), ("li", list item) and ("code", block) parts, in order.

    Blank lines part paragraphs. A line that starts with "- ", "* " or "1. " starts an item, and so does
    every "name: ..." line of a paragraph whose first line is one (a list of arguments). Indented lines
    (4 spaces or more, or >>>) are code. The underline of an RST heading (---, ===) is dropped."""
    parts: list[tuple[str, str]] = []
    for block in re.split(r"\n\s*\n", inspect.cleandoc(doc or "")):
        lines = [ln.rstrip() for ln in block.splitlines() if ln.strip()]
        lines = [ln for ln in lines if not re.fullmatch(r"\s*[-=~]{3,}", ln)]
        definitions = bool(lines) and bool(DEFINITION.match(lines[0]))
        code: list[str] = []
        open_part = False  # whether the next prose line continues the last part
        for ln in lines + [None]:
            if ln is not None and (ln.startswith("    ") or ln.lstrip().startswith(">>>")):
                code.append(ln)
                continue
            if code:
                parts.append(("code", textwrap.dedent("\n".join(code))))
                code, open_part = [], False
            if ln is None:
                break
            text = ln.strip()
            if ITEM.match(text) or (definitions and DEFINITION.match(text)):
                parts.append(("li", ITEM.sub("", text, count=1)))
            elif open_part:
                parts[-1] = (parts[-1][0], parts[-1][1] + " " + text)
            else:
                parts.append(("p", text))
            open_part = True
    return parts


def doc_markdown(doc: str | None) -> str:
    """A whole docstring as Markdown: paragraphs, lists and fenced code, the prose escaped."""
    out, last = [], None
    for kind, text in doc_blocks(doc):
        if kind == "code":
            try:
                compile(text, "<doc>", "exec")
                lang = "python"
            except SyntaxError:
                lang = "text"
            out.append(f"```{lang}\n{text}\n```\n\n")
        elif kind == "li":
            if last != "li":
                out.append("\n" if out and not out[-1].endswith("\n\n") else "")
            out.append(f"- {escape(text)}\n")
        else:
            out.append(("\n" if last == "li" else "") + escape(text) + "\n\n")
        last = kind
    return "".join(out).strip() + ("\n\n" if out else "")


def doc_cell(doc: str | None) -> str:
    """A whole docstring in one table cell: its parts joined by <br>, code lines as code spans."""
    parts = []
    for kind, text in doc_blocks(doc):
        if kind == "code":
            parts += [code(ln) for ln in text.splitlines() if ln.strip()]
        else:
            parts.append(("- " if kind == "li" else "") + escape(" ".join(text.split()), table=True))
    return "<br>".join(parts)


def fence(text: str) -> str:
    return f"```text\n{text.rstrip()}\n```\n"


def anchor(heading: str) -> str:
    """The id MkDocs (Python-Markdown's toc) gives a heading."""
    return re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", heading).strip().lower())
