"""What a rank puts on its PYTHONPATH: this package's parent folder, and the smdistributed stand-in
(sdp_jupyter/_compat) when AWS's library is not installed. One definition for the local launcher
and the warm pool; a leaf module, so `python -m sdp_jupyter.launch.rank.worker` imports nothing twice."""
from __future__ import annotations

from pathlib import Path

PACKAGE_PARENT = str(Path(__file__).resolve().parents[3])
COMPAT_DIR = str(Path(__file__).resolve().parents[2] / "_compat")


def smdistributed_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("smdistributed") is not None
    except (ImportError, ValueError):
        return False
