#!/usr/bin/env bash
# The GPU checks as one command, for a bare GPU machine with no network, run from the checkout:
#
#     bash tools/gpu_check.sh            # GPU half if torch sees CUDA, else the CPU half
#     bash tools/gpu_check.sh --cpu      # the CPU half only (CUDA hidden), e.g. on a machine without a GPU
#     bash tools/gpu_check.sh --gpu      # insist on CUDA: fail at once if torch sees none
#     OUT=/tmp/r bash tools/gpu_check.sh # where logs, the benchmark's JSON and summary.txt go (default ./gpu_results)
#
# Uses the Python already there: $PYTHON if set, else $VIRTUAL_ENV/bin/python, else python3. Steps,
# each timed and logged to $OUT/<n>-<step>.log:
#   1. python   which interpreter; torch, numpy, psutil, pybind11, pytest importable (else what is missing)
#   2. install  pip install --no-deps --no-build-isolation --no-index -e .   (downloads nothing)
#   3. engine   the engine's export report (sdp_jupyter/_native_check.py)
#   4. doctor   python -m sdp_jupyter.doctor, if that module exists
#   5. tests    pytest --noconftest -q tests/torch/test_gpu.py   (tests/conftest.py imports Ray/sshd/moto helpers)
#   6. bench    python benchmarks/gpu.py --out $OUT/gpu_bench.json
#   7. manycore on a host with at least 8 cores (a GPU machine's CPUs are users' many-core hosts), CPU
#               tensors: benchmarks/allreduce.py at 2, 4 and 8 ranks, one node and one rank per node,
#               4 KiB and 64 MiB, fp32 and bf16, with the single-core memcpy as the ceiling; and
#               benchmarks/ddp.py (stock DDP on gloo and on smddp, our wrapper) at 2, 4 and 8 ranks
# The CPU half is the same with CUDA_VISIBLE_DEVICES= after step 1: the GPU tests skip and the benchmark
# says there is no CUDA. The whole run has GPU_CHECK_BUDGET seconds (default 480): each step gets what is
# left. It stops at the first failing step, exits with its status, and still prints what ran.
set -u -o pipefail

cd "$(dirname "$0")/.." || exit 2
MODE=auto
for arg in "$@"; do
    case "$arg" in
        --cpu) MODE=cpu ;;
        --gpu) MODE=gpu ;;
        -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $arg (use --cpu, --gpu or --help)" >&2; exit 2 ;;
    esac
done
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then PY=$VIRTUAL_ENV/bin/python
else PY=python3
fi
OUT=${OUT:-./gpu_results}
mkdir -p "$OUT" || exit 2
OUT=$(cd "$OUT" && pwd)
BUDGET=${GPU_CHECK_BUDGET:-480}
export PYTHONFAULTHANDLER=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
START=$(date +%s.%N)
STEPS=()
N=0

elapsed() { echo "$(date +%s.%N) $1" | awk '{printf "%.1f", $1 - $2}'; }

summary() {
    local rc=$?
    {
        echo
        echo "== gpu_check summary ($MODE half; $PY; results in $OUT) =="
        for s in "${STEPS[@]}"; do echo "  $s"; done
        echo "  total $(elapsed "$START") s of $BUDGET s; exit status $rc"
    } | tee "$OUT/summary.txt"
}
trap summary EXIT

# step NAME CMD...: run CMD within the time left, output to the terminal and $OUT/<n>-NAME.log
step() {
    local name=$1
    shift
    N=$((N + 1))
    local left log t0 rc cmd="$*"
    left=$(echo "$BUDGET $(elapsed "$START")" | awk '{printf "%d", $1 - $2}')
    log="$OUT/$N-$name.log"
    echo
    echo "== [$N] $name: ${cmd%%$'\n'*} (${left} s left) =="
    if [ "$left" -le 0 ]; then
        STEPS+=("$(printf '%-8s FAILED   out of time before it started' "$name")")
        exit 124
    fi
    t0=$(date +%s.%N)
    timeout -k 10 "$left" "$@" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ]; then
        STEPS+=("$(printf '%-8s ok       %6s s' "$name" "$(elapsed "$t0")")")
    else
        [ "$rc" -eq 124 ] && echo "gpu_check.sh: $name ran out of time (the run has $BUDGET s: GPU_CHECK_BUDGET)"
        STEPS+=("$(printf '%-8s FAILED   %6s s  exit %s, log %s' "$name" "$(elapsed "$t0")" "$rc" "$log")")
        exit "$rc"
    fi
}

skip() {
    N=$((N + 1))
    echo
    echo "== [$N] $1: skipped: $2 =="
    STEPS+=("$(printf '%-8s skipped  %s' "$1" "$2")")
}

step python "$PY" - "$MODE" "$OUT/mode" <<'EOF'
import importlib, os, sys

mode, mode_file = sys.argv[1], sys.argv[2]
print(f"python {sys.version.split()[0]} at {sys.executable}; checkout {os.getcwd()}")
need = {"torch": "torch", "numpy": "numpy", "psutil": "psutil", "pybind11": "pybind11 (builds the engine)",
        "pytest": "pytest (runs tests/torch/test_gpu.py)", "setuptools": "setuptools (builds the engine)"}
missing = []
for mod, what in need.items():
    try:
        m = importlib.import_module(mod)
        print(f"  {mod} {getattr(m, '__version__', '')}")
    except Exception as exc:  # noqa: BLE001 - a broken install counts as missing
        missing.append(f"{what}: {type(exc).__name__}: {exc}")
try:
    import pynvml  # nvidia-ml-py: the sampler's GPU source

    print("  nvidia-ml-py (pynvml) importable")
    nvml = True
except Exception as exc:  # noqa: BLE001
    print(f"  nvidia-ml-py (pynvml) not importable: {exc}")
    nvml = False
if missing:
    sys.exit("missing, install them into this Python (no network here: from a wheelhouse):\n  " + "\n  ".join(missing))
import torch

cuda = torch.cuda.is_available()
print(f"  torch.cuda.is_available() = {cuda}" + (f": {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if cuda else ""))
present = os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl")
if mode == "gpu" and not cuda:
    sys.exit("--gpu: torch sees no CUDA device" + (" although /dev/nvidia* exists (driver or CUDA build mismatch?)" if present else ""))
if mode == "auto" and not cuda and present:
    sys.exit("/dev/nvidia* exists but torch sees no CUDA device (driver, CUDA_VISIBLE_DEVICES or a CPU-only torch?): "
             "fix that, or run the CPU half on purpose with --cpu")
if mode != "cpu" and cuda and not nvml:
    sys.exit("nvidia-ml-py is missing: the sampler test needs NVML on a GPU machine")
with open(mode_file, "w") as f:  # the half that follows
    f.write("gpu" if cuda and mode != "cpu" else "cpu")
EOF
MODE=$(cat "$OUT/mode" 2>/dev/null || echo cpu)
rm -f "$OUT/mode"
if [ "$MODE" = cpu ]; then
    export CUDA_VISIBLE_DEVICES=""
    echo "CPU half: CUDA hidden (CUDA_VISIBLE_DEVICES=) for the steps that follow"
fi

step install "$PY" -m pip install --no-deps --no-build-isolation --no-index -e .
step engine "$PY" -c "from sdp_jupyter._native_check import engine_path, inspect
p = engine_path()
print(p)
print(inspect(p).summary())
import sdp_jupyter._engine  # and it loads
print('engine imports')"
if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('sdp_jupyter.doctor') is None)" 2>/dev/null; then
    step doctor "$PY" -m sdp_jupyter.doctor
else
    skip doctor "no sdp_jupyter.doctor module in this checkout"
fi
step tests "$PY" -m pytest --noconftest -q -rs -p no:cacheprovider tests/torch/test_gpu.py
left=$(echo "$BUDGET $(elapsed "$START")" | awk '{printf "%d", $1 - $2 - 5}')
step bench "$PY" benchmarks/gpu.py --out "$OUT/gpu_bench.json" --timeout "$((left > 10 ? left : 10))"
CORES=$(nproc 2>/dev/null || echo 1)
if [ "$CORES" -ge 8 ]; then
    # issue 29 item 4's figures: in one node at 8 ranks, 64 MiB fp32 against gloo and against memcpy;
    # one rank per node against gloo; stock DDP on smddp against gloo at 2-8 ranks (CUDA hidden: CPU tensors)
    step manycore env CUDA_VISIBLE_DEVICES= sh -c "\"$PY\" benchmarks/allreduce.py --ranks 2,4,8 \
        --sizes 4096,67108864 --dtypes float32,bfloat16 --budget 0.5 --out \"$OUT/manycore_allreduce.json\" \
        && for r in 2 4 8; do \"$PY\" benchmarks/ddp.py --models mlp25m --ranks \$r --steps 10 \
        --out \"$OUT/manycore_ddp_\$r.json\" || exit 1; done"
else
    skip manycore "$CORES cores: the many-core figures need a host with at least 8"
fi
