"""The main job (`./dev.sh main`): run notebooks/01_quickstart.ipynb headless and say where the result is.

It executes every cell in a fresh kernel with nbclient (4 local nodes train on scikit-learn's digits
through %%sdp_train), writes the executed copy to notebooks/executed/01_quickstart.ipynb, and prints
the training cell's wall time, the test accuracy line and the job directory.
"""
from __future__ import annotations

import os
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "01_quickstart.ipynb"


def kernel_env() -> dict:
    """The kernel's environment: ours without PYTEST_CURRENT_TEST (ipykernel would stop capturing
    subprocess output) and with this checkout importable."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def execute(path: Path, out_dir: Path, timeout: int = 600):
    """Execute a notebook in a fresh kernel (cwd: its folder); write the executed copy to out_dir."""
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute(env=kernel_env())
    finally:
        out_dir.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out_dir / path.name)
    return nb


def cell_seconds(cell) -> float | None:
    ex = cell.get("metadata", {}).get("execution") or {}
    try:
        start = datetime.fromisoformat(ex["iopub.execute_input"].replace("Z", "+00:00"))
        end = datetime.fromisoformat(ex["shell.execute_reply"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return (end - start).total_seconds()


def main() -> int:
    out_dir = REPO / "notebooks" / "executed"
    print(f"[main] executing {NOTEBOOK.relative_to(REPO)} headless (nbclient, fresh kernel)")
    t0 = time.monotonic()
    try:
        nb = execute(NOTEBOOK, out_dir)
    except Exception as e:
        print(f"[main] the notebook failed: {type(e).__name__}: {str(e)[-2000:]}", file=sys.stderr)
        print(f"[main] partial executed copy: {out_dir / NOTEBOOK.name}", file=sys.stderr)
        return 1
    said = set()
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
        if cell.source.startswith("%%sdp_train"):
            print(f"[main] training cell (%%sdp_train --nodes 4): {cell_seconds(cell):.1f} s from a fresh kernel")
        for line in text.splitlines():
            if line.startswith(("test accuracy", "Job quickstart")) and line not in said:
                said.add(line)
                print(f"[main] {line}")
    print(f"[main] whole notebook: {time.monotonic() - t0:.1f} s")
    print(f"[main] executed copy: {out_dir / NOTEBOOK.name}")
    print(f"[main] job directory: {REPO / 'notebooks' / 'sdp_jobs' / 'quickstart'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
