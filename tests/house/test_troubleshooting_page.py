"""docs/troubleshooting.md stays true: every message it quotes (a ```text block) belongs to a section that
tests/launch/test_troubleshooting.py reproduces for real and checks against that quote, and every
section that test names exists on the page. Also: the page links only to docs pages that exist."""
from __future__ import annotations

import re
from pathlib import Path

from helpers.troubleshooting_page import PAGE, blocks, quoted, sections

REPRODUCED = Path(__file__).resolve().parent.parent / "launch" / "test_troubleshooting.py"


def _checked_sections() -> set[str]:
    """The headings whose quotes the launch tests assert (`_has_all(..., "heading"...)`)."""
    return set(re.findall(r'_has_all\(.*, "([^"]+)"(?:, \d+)?\)\s*$', REPRODUCED.read_text(), flags=re.M))


def test_every_quoted_message_is_reproduced_by_a_test():
    quoting = {head for head, body in sections().items() if "```text" in body}
    checked = _checked_sections()
    assert quoting, "the page quotes no message"
    assert quoting <= checked, f"quoted on the page but reproduced by no test: {sorted(quoting - checked)}"
    assert checked <= set(sections()), f"tests check sections the page lacks: {sorted(checked - set(sections()))}"


def test_every_block_of_a_section_with_several_is_checked_by_index():
    text = REPRODUCED.read_text()
    for head in _checked_sections():
        n = len(blocks(head))
        if n > 1:
            used = {int(i) for i in re.findall(rf'"{re.escape(head)}", (\d+)\)', text)}
            assert used == set(range(n)), f"{head!r}: {n} quotes, tests check {sorted(used)}"
        assert quoted(head), head


def test_links_go_to_pages_that_exist():
    for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", PAGE.read_text()):
        assert (PAGE.parent / target).is_file(), f"{target} is linked from the page and does not exist"
