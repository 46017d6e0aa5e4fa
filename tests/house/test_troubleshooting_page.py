"""docs/troubleshooting.md stays true: every message it quotes (a ```text block) belongs to a section that
tests/launch/test_troubleshooting.py, or this file (CHECKED_HERE), reproduces for real and checks against
that quote, and every section that test names exists on the page. The doctor's section names each of the
doctor's lines as it prints them. Also: the page links only to docs pages that exist."""
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
    checked = _checked_sections() | CHECKED_HERE
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


# ---------------------------------------------------------------- quotes this file reproduces itself
# Sections whose ```text quotes are checked here rather than in tests/launch/test_troubleshooting.py.
CHECKED_HERE = {"No free port in the range for MASTER_PORT"}


def test_sections_checked_here_exist_and_are_not_checked_twice():
    assert CHECKED_HERE <= set(sections()), sorted(CHECKED_HERE - set(sections()))
    assert not CHECKED_HERE & _checked_sections()


def test_a_full_range_for_master_port_says_what_the_page_quotes(tmp_path, monkeypatch):
    """The launcher's own message (MASTER_PORT), as the job's error: a real local job whose range is one
    port that is taken fails before any rank starts."""
    import socket

    import sdp_jupyter

    monkeypatch.setenv("SDP_JOBS_DIR", str(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        job = sdp_jupyter.launch(code="print(1)", nodes=2, backend="gloo", env={"SDP_PORT_RANGE": f"{port}-{port}"})
        assert job.wait(60) == "failed"
    said = job.error.replace(f"{port}-{port}", "31400-31449")
    for fragment in quoted("No free port in the range for MASTER_PORT"):
        assert fragment in said, f"the page's quote {fragment!r} is not what the job says: {job.error!r}"


def _doctor_names() -> list[str]:
    """The doctor's line names in the order it prints them: the checks as this machine runs them (the
    smoke runs skipped) and the smoke lines' names as smoke.py makes them."""
    from sdp_jupyter.doctor import collect

    names = [c.name for c in collect(smoke=False).checks if c.name != "smoke all_reduce"]
    return names + [f"smoke all_reduce ({device})" for device in ("cpu", "cuda")]


def test_the_doctor_table_names_every_line_as_the_doctor_prints_it():
    body = sections()["Start here: the doctor"]
    rows = [line.split("|")[1].strip() for line in body.splitlines()
            if line.startswith("| `")]
    on_page = [name for row in rows for name in re.findall(r"`([^`]+)`", row)]
    assert on_page == _doctor_names()


def test_the_doctor_header_and_the_peer_reads_quote_are_word_for_word(monkeypatch):
    """The header the page names, and the peer memory reads WARN and its fix, from the doctor's own code
    (the refused probe stubbed; tests/launch/test_troubleshooting.py makes it refused for real, as root)."""
    from sdp_jupyter.doctor import checks
    from sdp_jupyter.doctor.report import OK, Report

    monkeypatch.setattr(checks, "_probe_peer_read", lambda: (False, "Operation not permitted"))
    report = Report()
    report.add("smoke all_reduce (cpu)", OK, "...")  # the full report's widest name sets the padding
    checks.check_peer_reads(report, scope_path="/nonexistent/ptrace_scope")
    text = report.text()
    assert "`sdp_jupyter doctor: paste this into a bug report`" in sections()["Start here: the doctor"]
    assert text.splitlines()[0] == "sdp_jupyter doctor: paste this into a bug report"
    for fragment in quoted("Peer memory reads are refused"):
        assert fragment in text, f"the page's quote {fragment!r} is not what the doctor prints:\n{text}"
