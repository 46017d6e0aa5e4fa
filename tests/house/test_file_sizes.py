"""No Python file of the project is longer than 500 lines (issue 41): past that, a module holds more than
one idea, and the next reader has to find which part is theirs."""
from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 500


def test_no_python_file_is_longer_than_500_lines():
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = tracked.stdout.split()
    assert len(files) > 50, files  # the listing found the project, not an empty folder
    long = {f: n for f in files if (n := len((ROOT / f).read_text().splitlines())) > LIMIT}
    assert not long, f"files over {LIMIT} lines (split each by idea): {long}"
