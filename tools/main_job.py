"""The main job (`./dev.sh main`): run notebooks/01_quickstart.ipynb headless and say where the result is.

It executes every cell in a fresh kernel with nbclient (4 local nodes train on scikit-learn's digits
through %%sdp_train), then, in the same kernel, `%sdp_warm` and the training and evaluation cells once
more (added to the executed copy only, under a note): the first run of the cell is the kernel's first
job and starts cold, the second starts warm (docs/warm.md). It writes the executed copy to
notebooks/executed/01_quickstart.ipynb (scrubbed: tools/executed.py) and prints the cold and the
warm training cell's wall time, the test accuracy line and the job directory, then the one-line summary of `python -m
sdp_jupyter.doctor` (run after the notebook, so it takes no CPU from the timed cells).
"""
from __future__ import annotations

import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python tools/main_job.py`: tools.executed is found from the checkout
    sys.path.insert(0, str(REPO))
from tools.executed import EXECUTED, execute  # noqa: E402

NOTEBOOK = REPO / "notebooks" / "01_quickstart.ipynb"


WARM_TAG = "sdp-main-warm-rerun"


def add_warm_rerun(nb) -> None:
    """Append `%sdp_warm` and the training and evaluation cells again (tagged WARM_TAG): the same
    cell a second time in the same kernel, which starts warm."""
    from nbformat.v4 import new_code_cell, new_markdown_cell

    code = [c for c in nb.cells if c.cell_type == "code"]
    train = next(c for c in code if c.source.startswith("%%sdp_train"))
    evaluate = next(c for c in code if "test accuracy" in c.source)
    meta = {"tags": [WARM_TAG]}
    nb.cells += [new_markdown_cell("*Added by `./dev.sh main`:* the training cell once more in the same "
                                   "kernel. The first run was this kernel's first job (cold); the pool "
                                   "started after it, `%sdp_warm` waits until it is ready, and the second "
                                   "run forks its ranks from it (warm).", metadata=meta),
                 new_code_cell("%sdp_warm", metadata=meta),
                 new_code_cell(train.source, metadata=meta),
                 new_code_cell(evaluate.source, metadata=meta)]


def cell_seconds(cell) -> float | None:
    ex = cell.get("metadata", {}).get("execution") or {}
    try:
        start = datetime.fromisoformat(ex["iopub.execute_input"].replace("Z", "+00:00"))
        end = datetime.fromisoformat(ex["shell.execute_reply"].replace("Z", "+00:00"))
    except (KeyError, ValueError):
        return None
    return (end - start).total_seconds()


def doctor_line(timeout: float = 90.0) -> str:
    """`python -m sdp_jupyter.doctor`'s one-line summary (smoke all_reduce included), run in a fresh
    process after the notebook, so it takes no CPU from the timed cells; it costs a few seconds and
    at most `timeout`."""
    t0 = time.monotonic()
    try:
        from sdp_jupyter.doctor import report_in_subprocess, summary_line

        line = summary_line(report_in_subprocess(timeout=timeout))
    except Exception as e:  # noqa: BLE001 - the doctor's own failure must not fail the main job
        line = f"doctor: could not run ({type(e).__name__}: {e})"
    return f"{line} [{time.monotonic() - t0:.1f} s; the whole report: python -m sdp_jupyter.doctor]"


def main() -> int:
    out_dir = EXECUTED
    print(f"[main] executing {NOTEBOOK.relative_to(REPO)} headless (nbclient, fresh kernel)")
    t0 = time.monotonic()
    try:
        nb = execute(NOTEBOOK, out_dir, prepare=add_warm_rerun)
    except Exception as e:
        print(f"[main] the notebook failed: {type(e).__name__}: {str(e)[-2000:]}", file=sys.stderr)
        print(f"[main] partial executed copy: {out_dir / NOTEBOOK.name}", file=sys.stderr)
        print(f"[main] {doctor_line()}", file=sys.stderr)
        return 1
    said = set()
    times = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        text = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
        if cell.source.startswith("%%sdp_train"):
            times.append(cell_seconds(cell))
        if cell.source == "%sdp_warm":
            print(f"[main] %sdp_warm (waits for the pool started after the first job): {cell_seconds(cell):.1f} s")
        for line in text.splitlines():
            if line.startswith(("test accuracy", "Job quickstart")) and line not in said:
                said.add(line)
                print(f"[main] {line}")
    cold, warm = times  # the quickstart's training cell, then its re-run (add_warm_rerun)
    print(f"[main] training cell (%%sdp_train --nodes 4): cold {cold:.1f} s (a fresh kernel's first job), "
          f"warm {warm:.1f} s (the same cell again in that kernel)")
    print(f"[main] whole notebook: {time.monotonic() - t0:.1f} s")
    print(f"[main] executed copy: {out_dir / NOTEBOOK.name}")
    print(f"[main] job directory: {REPO / 'notebooks' / 'sdp_jobs' / 'quickstart'}")
    print(f"[main] {doctor_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
