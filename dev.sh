#!/usr/bin/env bash
# One entry point for a fresh machine.
#   ./dev.sh main   install what the main job needs, then run it
#   ./dev.sh test   install everything (test extras, browser, test hosts' tools), then run the whole test suite
#   ./dev.sh notebooks [NAME.ipynb ...]   run the notebooks that need no root and store their executed
#                   copies, outputs included, in notebooks/outputs/ (what GitHub and the docs site show)
# Everything goes into ./.venv. torch is installed first, and only when the venv has none, so that
# the `torch>=2.11` requirement never pulls a multi-GB CUDA build onto a CPU machine: 2.13.0, the
# version CI tests. On this project's machines pip finds its CPU build on local disk; on a plain
# PyPI setup `pip install torch==2.13.0` is a CUDA build on Linux, so install the CPU one into
# .venv yourself first if you want it (pip install torch==2.13.0 --index-url
# https://download.pytorch.org/whl/cpu), or any torch >= 2.11 you already use.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV="$ROOT/.venv"

need_space() {  # $1: a folder, $2: GiB it needs free, $3: what for. A full disk otherwise fails deep in pip or a test.
    local free
    free=$(df -Pk "$1" | awk 'NR == 2 {print int($4 / 1048576)}')
    if [ "$free" -lt "$2" ]; then
        echo "[dev.sh] only ${free} GiB free in $1; $3 needs about $2 GiB. Free some space (old clones, their .venv) and run again." >&2
        exit 1
    fi
}

bootstrap() {  # $1: the extras to install (test: everything the suite needs; notebooks: the main job's)
    [ -x "$VENV/bin/python" ] || need_space "$ROOT" 4 "a new .venv (torch, JupyterLab, Ray and the test extras)"
    need_space "${TMPDIR:-/tmp}" 1 "the jobs' and tests' temporary folders"
    [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
    "$VENV/bin/python" -c "import torch" 2>/dev/null || "$VENV/bin/pip" install -q torch==2.13.0
    echo "[dev.sh] installing sdp_jupyter[$1] into .venv (compiles native/: needs a C++17 compiler and Python headers)"
    "$VENV/bin/pip" install -q -e ".[$1]"
}

install_browser() {
    # Debian's chromium for the JupyterLab browser tests (Playwright drives it via executable_path).
    if ! command -v chromium >/dev/null 2>&1; then
        echo "[dev.sh] installing Debian's chromium for the browser tests"
        if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
        $SUDO apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q chromium >/dev/null
    fi
}

install_toolchains() {
    # Debian's clang for the engine's clang build (tools/build_matrix.py, tests/engine/test_native_builds.py).
    if ! command -v clang >/dev/null 2>&1 || ! command -v clang++ >/dev/null 2>&1; then
        echo "[dev.sh] installing Debian's clang for the engine's clang build test"
        if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
        $SUDO apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q clang >/dev/null
    fi
}

install_test_hosts() {
    # iproute2 (ip, tc) for the cluster-in-a-box test hosts (sdp_jupyter.testing.cluster),
    # openssh (client and sshd) for the SSH target's tests: an sshd runs on each test host, and
    # Slurm (slurm-wlm, munge) for the Slurm target's: slurmctld and slurmd run on the test hosts
    # (sdp_jupyter.testing.slurm), strace for the engine test that widens a race on purpose
    # (tests/engine/test_barrier_race.py). No daemon is started here; the tests start and stop them by PID.
    if ! command -v ip >/dev/null 2>&1 || ! command -v tc >/dev/null 2>&1 || ! command -v strace >/dev/null 2>&1 \
            || ! command -v ssh >/dev/null 2>&1 || [ ! -x /usr/sbin/sshd ] \
            || [ ! -x /usr/sbin/slurmctld ] || [ ! -x /usr/sbin/slurmd ] || [ ! -x /usr/sbin/munged ]; then
        echo "[dev.sh] installing iproute2, openssh, Slurm and strace for the test hosts and engine tests"
        if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
        $SUDO apt-get update -q >/dev/null
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends \
            iproute2 openssh-client openssh-server slurm-wlm munge strace >/dev/null
        # Debian's packages may start their own daemons where an init system runs: the tests want none
        $SUDO pkill -x slurmctld 2>/dev/null || true; $SUDO pkill -x slurmd 2>/dev/null || true
        $SUDO pkill -x munged 2>/dev/null || true
    fi
}

case "${1:-}" in
    main)
        bootstrap notebooks
        exec "$VENV/bin/python" tools/main_job.py
        ;;
    test)
        bootstrap test
        install_browser
        install_test_hosts
        install_toolchains
        shift
        # --durations=40: the slowest 40, where the suite's time goes. -n: pytest-xdist workers (SDP_TEST_WORKERS,
        # 3 by default, even on 2 cores: a third of the CPU sat idle on 2 workers while tests wait on heartbeats,
        # deadlines and daemons; 0 runs the suite in this one process); --dist loadgroup keeps the tests that share
        # a machine-wide thing (the test hosts, the notebooks, the browser) on one worker: tests/conftest.py
        exec "$VENV/bin/python" -m pytest -ra --durations=40 -n "${SDP_TEST_WORKERS:-3}" --dist loadgroup "$@"
        ;;
    notebooks)
        bootstrap test  # 04 runs on the moto stand-in and the SageMaker SDK, 06 on Ray: the test extra has them
        shift
        exec "$VENV/bin/python" tools/executed.py refresh "$@"
        ;;
    *)
        echo "usage: ./dev.sh main | ./dev.sh test [pytest args] | ./dev.sh notebooks [NAME.ipynb ...]" >&2
        exit 2
        ;;
esac
