"""Engine alone (numpy face, no torch): wall time and CPU time per all_reduce, for profiles.

    python benchmarks/engine_cpu.py WORLD PER_NODE BYTES [DTYPE] [ITERS]
    python benchmarks/engine_cpu.py 2 2 67108864 float32 20      # 2 ranks, 1 node, 64 MiB
    perf record -g python benchmarks/engine_cpu.py 2 1 67108864  # where the CPU goes (TCP path)
    SDP_PKG=/path/to/other/checkout python benchmarks/engine_cpu.py ...   # A/B against another build

CPU time per collective (summed over the ranks, all threads) is the figure that survives a loaded
machine: wall time there mostly measures the scheduler. Prints one line; no JSON.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.environ.get("SDP_PKG", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))  # _spawn, after the checkout measured


def worker(size: int, dtype: str, iters: int) -> None:
    import numpy as np

    from sdp_jupyter import comm

    c = comm.init()
    a = np.ones(size // np.dtype(dtype).itemsize, dtype=dtype)
    c.all_reduce(a)
    c.all_reduce(a)
    c.barrier()
    times = []
    c0 = time.process_time()
    for _ in range(iters):
        t0 = time.perf_counter()
        c.all_reduce(a)
        times.append(time.perf_counter() - t0)
    cpu = (time.process_time() - c0) / iters
    times.sort()
    print(json.dumps({"median_s": times[len(times) // 2], "min_s": times[0], "cpu_s": cpu}))
    comm.shutdown()


def main() -> None:
    args = sys.argv[1:]
    is_worker = args[:1] == ["--worker"]  # a rank, started by run_ranks below
    args = args[1:] if is_worker else args
    if len(args) < 3:
        sys.exit(__doc__)
    world, per_node, size = int(args[0]), int(args[1]), int(args[2])
    dtype = args[3] if len(args) > 3 else "float32"
    iters = int(args[4]) if len(args) > 4 else 20
    if is_worker:
        worker(size, dtype, iters)
        return
    from _spawn import run_ranks

    outs = run_ranks(os.path.abspath(__file__), world, per_node, args, extra_env={"OPENBLAS_NUM_THREADS": "1"})
    med = max(o["median_s"] for o in outs)
    busbw = size / med * 2 * (world - 1) / world / 1e9
    print(f"{world} ranks, {per_node} per node, {size} B {dtype}: median {med * 1e6:.0f} us, busbw {busbw:.2f} GB/s, "
          f"CPU per all_reduce (all ranks) {sum(o['cpu_s'] for o in outs) * 1e6:.0f} us, load {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
