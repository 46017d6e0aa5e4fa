"""What one cross-memory read costs against a memcpy on this machine (the single-copy path's unit cost).

    python benchmarks/cross_memory.py            # 4 MiB and 32 MiB, median of 11
    python benchmarks/cross_memory.py --sizes 67108864

A forked child holds the source; the parent copies it with process_vm_readv (what the engine's
single-copy gather, scatter and all_to_all do) and, for reference, memcpy of a buffer of its own.
Prints a table with the ratio memcpy time / read time and writes benchmarks/results/cross_memory.json.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _spawn import timed  # noqa: E402


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def measure(size: int, reps: int) -> dict:
    libc = ctypes.CDLL(None, use_errno=True)
    src, dst = np.ones(size, dtype=np.uint8), np.zeros(size, dtype=np.uint8)
    r, w = os.pipe()
    child = os.fork()
    if child == 0:  # holds its copy of src until told to go
        os.read(r, 1)
        os._exit(0)
    try:
        def cma():
            mine, theirs = _IOVec(dst.ctypes.data, size), _IOVec(src.ctypes.data, size)
            got = libc.process_vm_readv(child, ctypes.byref(mine), 1, ctypes.byref(theirs), 1, 0)
            if got != size:
                raise OSError(ctypes.get_errno(), f"process_vm_readv read {got} of {size} bytes")
        # one untimed call first touches every page
        return {"bytes": size, "memcpy_s": timed(lambda: np.copyto(dst, src), reps)[0], "cma_s": timed(cma, reps)[0]}
    finally:
        os.write(w, b"x")
        os.waitpid(child, 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default=f"{4 << 20},{32 << 20}", help="comma list of bytes")
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cross_memory.json"))
    a = ap.parse_args()
    rows = [measure(int(s), a.reps) for s in a.sizes.split(",")]
    print(f"{'size':>10} | {'memcpy':>10} {'GB/s':>6} | {'process_vm_readv':>16} {'GB/s':>6} | memcpy/read")
    for row in rows:
        b, m, c = row["bytes"], row["memcpy_s"], row["cma_s"]
        print(f"{b >> 10:>6} KiB | {m * 1e3:>7.2f} ms {b / m / 1e9:>6.2f} | {c * 1e3:>13.2f} ms {b / c / 1e9:>6.2f} | x{m / c:.2f}")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"cpus": os.cpu_count(), "rows": rows}, f, indent=1)
    print(f"results: {a.out}")


if __name__ == "__main__":
    main()
