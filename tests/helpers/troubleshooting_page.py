"""What docs/troubleshooting.md quotes: each section's ```text blocks, cut into the fragments a test
asserts (a quoted message may elide a variable part, a path or a port, with "...")."""
from __future__ import annotations

import re
from pathlib import Path

PAGE = Path(__file__).resolve().parent.parent.parent / "docs" / "troubleshooting.md"


def sections() -> dict[str, str]:
    """Heading (without the #'s) -> the section's text, for every ## and ### heading."""
    text = PAGE.read_text()
    found: dict[str, str] = {}
    parts = re.split(r"^(#{2,3} .+)$", text, flags=re.M)
    for head, body in zip(parts[1::2], parts[2::2]):
        found[head.lstrip("#").strip()] = body
    return found


def blocks(heading: str) -> list[str]:
    """The ```text blocks under `heading`; an unknown heading or a section without one is an error."""
    found = re.findall(r"^```text\n(.*?)^```", sections()[heading], flags=re.S | re.M)
    assert found, f"the section {heading!r} quotes no message"
    return found


def quoted(heading: str, block: int | None = None) -> list[str]:
    """The fragments of the ```text blocks under `heading` (only the `block`-th one when given),
    lines cut at "...", each long enough to mean something."""
    found = blocks(heading)
    if block is not None:
        found = [found[block]]
    frags = []
    for text in found:
        for piece in re.split(r"\.\.\.|\n", text):
            piece = piece.strip()
            if len(piece) >= 12:
                frags.append(piece)
    return frags
