"""The errors the guides quote are the errors this version prints.

A page that quotes an error (docs/ssh.md's install error, the "it prints:" blocks) teaches the reader what
to look for; when the code's wording changes, the quote must change with it. This finds, in docs/*.md (not
benchmarks*.md: those are records of past runs), every line of a fenced code block and every code span of
the prose that looks like one of our errors: one naming an exception class the package defines
(`SpecError:`, `JobError:`, `SmddpBackendError:`, ...) or IPython's `UsageError:` (what the magics raise),
or holding `Fix: `. Each is checked against the package's string literals (sdp_jupyter/: every str
constant, the literal parts of f-strings included) and native/'s text (C++). A quote's variable parts
(numbers, quoted names, paths, host names) are unknowable, so the line is split at the ones that look
variable, and each remaining piece of 20 or more characters must be covered by fragments of 20+
characters that occur in a literal, or be one f-string's output; what is left over must be shorter."""
from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIN = 20
#: what a quote's variable parts look like: quoted values, subscripts, paths, `...`, words holding digits,
#: names with a dot or an underscore (train.log, all_reduce, sdp_jupyter), an exception's class (Python's)
VARIABLE = re.compile(r"\w*\[[^\]]*\]|'[^']*'|\"[^\"]*\"|`[^`]*`|\S*/\S*|\.\.\.+|…|\S*\d\S*"
                      r"|\w+(?:\.\w+)+|\w*_\w*|\b\w+Error\b:?")


@functools.lru_cache(maxsize=None)
def error_classes() -> frozenset[str]:
    """The exception classes sdp_jupyter defines (a class whose base is an Error or Exception)."""
    found = set()
    for path in (ROOT / "sdp_jupyter").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    re.search(r"(Error|Exception)$", ast.unparse(b)) for b in node.bases):
                found.add(node.name)
    return frozenset(found)


@functools.lru_cache(maxsize=None)
def templates() -> tuple[re.Pattern, ...]:
    """Each f-string of sdp_jupyter/ as a pattern: its literal parts, any text (a value) for each `{...}`, and
    up to MIN - 1 characters of the literals around it at either end."""
    found = []
    for path in sorted((ROOT / "sdp_jupyter").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.JoinedStr) and len(node.values) > 1:
                parts = [re.escape(v.value) if isinstance(v, ast.Constant) else ".{1,60}?" for v in node.values]
                found.append(re.compile(f".{{0,{MIN - 1}}}?" + "".join(parts) + f".{{0,{MIN - 1}}}?", re.S))
    return tuple(found)


def fits_a_template(piece: str, patterns=None) -> bool:
    """`piece` is one f-string's output: its literals (at least half of `piece`) with values in between."""
    for pattern in templates() if patterns is None else patterns:
        literal = len(re.sub(r"\.\{[^}]*\}\??|\\", "", pattern.pattern))
        if literal * 2 >= len(piece) and pattern.fullmatch(piece):
            return True
    return False


@functools.lru_cache(maxsize=None)
def literals() -> str:
    """Every string literal of sdp_jupyter/ (f-strings' literal parts included) and the text of native/."""
    parts = []
    for path in sorted((ROOT / "sdp_jupyter").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                parts.append(node.value)
    for pattern in ("*.cpp", "*.h", "*.hpp"):
        parts += [p.read_text() for p in sorted((ROOT / "native").rglob(pattern))]
    return "\n\0".join(parts)


def looks_like_ours(line: str) -> bool:
    """A line with `Fix: `, or naming one of our exception classes (or IPython's UsageError, what the magics
    raise) followed by its message."""
    return re.search(r"(^|\s)Fix: ", line) is not None or any(f"{name}: " in line
                                                              for name in error_classes() | {"UsageError"})


def quoted_errors(page: str) -> list[tuple[int, str]]:
    """(line number, text) of every line of a fenced code block of `page`, and every code span of its prose,
    that looks like our error."""
    found, fence = [], None
    for number, line in enumerate(page.splitlines(), 1):
        opening = re.match(r"^\s*(`{3,}|~{3,})", line)
        if opening and (fence is None or line.strip().strip(fence[0]) == ""):
            fence = opening.group(1) if fence is None else None
        elif fence is not None and looks_like_ours(line):
            found.append((number, line.strip()))
        elif fence is None:
            found += [(number, span) for span in re.findall(r"`([^`]+)`", line) if looks_like_ours(span)]
    return found


def unmatched(line: str, corpus: str | None = None) -> list[str]:
    """The pieces (20+ characters) of a quoted line that no literal of the code holds; [] when it matches."""
    corpus = literals() if corpus is None else corpus
    left = []
    for piece in VARIABLE.split(line):
        left += uncovered(piece.strip(), corpus)
    return left


def uncovered(piece: str, corpus: str) -> list[str]:
    """Take out of `piece` its longest fragment found in `corpus` (20+ characters), then do the same to what
    is left on each side; what is left of 20+ characters with no such fragment is returned."""
    if len(piece) < MIN:
        return []
    start, length = 0, 0
    for i in range(len(piece) - MIN + 1):
        while i + length < len(piece) and piece[i:i + length + 1] in corpus:
            start, length = i, length + 1
    if length < MIN:
        return [] if fits_a_template(piece) else [piece]
    return uncovered(piece[:start].strip(), corpus) + uncovered(piece[start + length:].strip(), corpus)


def pages() -> list[Path]:
    return [p for p in sorted((ROOT / "docs").glob("*.md")) if not p.name.startswith("benchmarks")]


def test_every_quoted_error_is_what_the_code_prints():
    checked, wrong = 0, []
    for path in pages():
        for number, line in quoted_errors(path.read_text()):
            checked += 1
            for piece in unmatched(line):
                wrong.append(f"{path.relative_to(ROOT)}:{number}: {piece!r} (in: {line})")
    assert checked >= 10, checked  # the scan found the pages' quotes
    assert not wrong, "quoted errors the code no longer prints (fix the page):\n" + "\n".join(wrong)


def test_a_changed_message_fails_and_a_quote_with_other_values_passes():
    page = ("It prints:\n\n```\n"
            "UsageError: --push: variable 'cfg' (dict) cannot be sent to the ranks: a lock\n"
            "UsageError: --push: variable 'cfg' (dict) is something the ranks can never ever receive\n"
            "```\n\nUsageError: in prose, not a quote; `SpecError: --nodes: a span` is one\n")
    found = quoted_errors(page)
    assert [n for n, _ in found] == [4, 5, 8] and found[2][1] == "SpecError: --nodes: a span"
    code = "raise UsageError(f\"--push: variable {name!r} ({kind}) cannot be sent to the ranks: {why}\")"
    corpus = "\n\0".join(n.value for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Constant))
    assert unmatched(found[0][1], corpus) == []
    assert unmatched(found[1][1], corpus) == ["(dict) is something the ranks can never ever receive"]


def test_the_real_pages_would_fail_on_a_changed_quote():
    """A quote of docs/ssh.md with its wording changed, as a page would have it after the code changed."""
    page = (ROOT / "docs" / "ssh.md").read_text()
    number, line = next((n, q) for n, q in quoted_errors(page) if "is not installed for" in q)
    assert unmatched(line) == []
    changed = line.replace("is not installed for", "cannot be imported by")
    assert unmatched(changed), changed
