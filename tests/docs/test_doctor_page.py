"""docs/doctor.md: its full sample report is laid out exactly as the doctor prints one, names the
doctor's lines in its order, and explains each; its WARN example is the doctor's own words."""
from __future__ import annotations

import re

from conftest import REPO

PAGE = REPO / "docs" / "doctor.md"


def _blocks() -> list[str]:
    return re.findall(r"^```text\n(.*?)^```$", PAGE.read_text(), flags=re.S | re.M)


def _names_on_this_machine() -> list[str]:
    from sdp_jupyter.doctor import collect

    return [c.name for c in collect(smoke=False).checks if c.name != "smoke all_reduce"]


def test_the_full_sample_is_a_report_as_the_doctor_prints_it():
    from sdp_jupyter.doctor.report import Report

    sample = _blocks()[0].rstrip("\n").splitlines()
    names = _names_on_this_machine() + ["smoke all_reduce (cpu)"]  # the sample's machine has no GPU
    width = max(map(len, names))
    rows = sample[1:-1]
    assert [row[6:6 + width].rstrip() for row in rows] == names
    report = Report()
    for row in rows:
        report.add(row[6:6 + width].rstrip(), row[:4].strip(), row[8 + width:])
    assert report.text() == "\n".join(sample)  # header, padding, summary line: word for word


def test_every_line_of_the_sample_is_explained():
    text = PAGE.read_text()
    sample = _blocks()[0].rstrip("\n").splitlines()
    explained = re.findall(r"^\*\*`([^`]+)`\*\*", text, flags=re.M)
    assert explained[0] == sample[0] and explained[-1] == sample[-1]
    assert explained[1:-1] == _names_on_this_machine() + ["smoke all_reduce (cpu)"]


def test_the_warn_example_is_the_doctors_own_words(monkeypatch):
    from sdp_jupyter.doctor import checks
    from sdp_jupyter.doctor.report import OK, Report

    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    report = Report()
    report.add("peer memory reads", OK, "...")  # the widest name of a --no-smoke report sets the padding
    checks.check_backend_registration(report)
    warn = report.text().splitlines()[2:4]
    example = _blocks()[1].splitlines()
    assert example[:2] == warn
    assert f"1 WARN ({report.checks[-1].brief})" in example[-1]
