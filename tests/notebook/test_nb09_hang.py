"""Issue 40, item 6: notebook 09's evaluation cell (`X @ w["0.weight"].T` on the weights an SSH job sent
back) hung forever in a full run of the suite, printing nothing.

The cause: when an SSH (or Slurm) job ends, the kernel starts the hosts' warm pools, one ssh client
each, and it used to start them with `subprocess.Popen(..., preexec_fn=...)` (for the parent-death
signal). A preexec_fn makes Python fork() the kernel rather than vfork(), and fork() runs OpenBLAS's
pthread_atfork handler, which shuts OpenBLAS's thread pool down. When that happens while the notebook's
next cell is inside a multi-threaded BLAS call on the main thread, the work it handed a pool thread is
dropped and the call spins in exec_blas() forever. A fresh interpreter (with OpenBLAS's pool of 2
threads) plays the kernel here: the main thread does the cell's product over and over while another
thread starts clients the way the launcher does (ssh._start_ssh; `true` stands in for ssh).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO

SECONDS = 5.0  # of products and clients together; without the fix this hangs within a second

KERNEL = r"""
import faulthandler, sys, threading, time
import numpy as np
import threadpoolctl
from sdp_jupyter.launch.targets.ssh import launcher as ssh

seconds = float(sys.argv[1])
faulthandler.dump_traceback_later(seconds + 20, exit=True)  # a hang: say where, then exit 1
blas = [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas"]
if not blas or max(blas) < 2:
    print("single-threaded BLAS", blas)
    sys.exit(3)
done = threading.Event()
clients = []

def start_clients():  # what a finished SSH job does: one ssh client per host's warm pool
    while not done.is_set():
        ssh._start_ssh(["true"]).communicate()
        clients.append(1)

threading.Thread(target=start_clients, daemon=True).start()
rng = np.random.default_rng(0)
X = rng.random((450, 64), dtype=np.float32)  # the notebook's shapes: X_test @ w["0.weight"].T
W = rng.random((64, 64), dtype=np.float32)
products = 0
t0 = time.monotonic()
while time.monotonic() - t0 < seconds:
    X @ W.T
    products += 1
done.set()
print(products, len(clients))
"""


def test_numpy_in_the_kernel_does_not_hang_while_ssh_clients_start():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("OpenBLAS runs single-threaded on one CPU: it has no thread pool to lose")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "GOTO_NUM_THREADS")}
    env.update(OPENBLAS_NUM_THREADS="2", PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    try:
        done = subprocess.run([sys.executable, "-c", KERNEL, str(SECONDS)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=SECONDS + 45)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the kernel stand-in hung and did not even dump its stacks: {e.stderr}")
    if done.returncode == 3:
        pytest.skip(done.stdout.strip())
    assert done.returncode == 0, ("numpy's product on the main thread hung while ssh clients started "
                                  f"(exit {done.returncode}):\n{done.stderr[-3000:]}")
    products, clients = map(int, done.stdout.split())
    assert products > 100 and clients > 5, (products, clients)  # both ran, side by side
