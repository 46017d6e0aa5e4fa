"""dev.sh stops before installing anything when the disk is nearly full, and says which folder and how
much: a full disk once failed CI deep inside pip."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs")
def test_dev_sh_refuses_a_nearly_full_disk_before_installing(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(small)], check=True)
    try:
        shutil.copy(REPO / "dev.sh", small / "dev.sh")
        r = subprocess.run(["bash", str(small / "dev.sh"), "test"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"only 0 GiB free in {small}" in r.stderr and "a new .venv" in r.stderr and "about 4 GiB" in r.stderr
        assert not (small / ".venv").exists()  # nothing was started
    finally:
        subprocess.run(["umount", str(small)], check=True)
