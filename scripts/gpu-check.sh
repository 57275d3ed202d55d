#!/usr/bin/env bash
# make gpu-check [STEP=all|tests|recipe|moe|long|bench|fill] [REPORT=gpu-report.md]: the CUDA checks, on a
# machine with an NVIDIA GPU and its own torch (nothing is installed into it).  Ray comes
# from .whl/ (make gpu-wheels, on a CPU machine) when the machine has none.  Each STEP fits
# one 10-minute command; STEP=all runs them in turn.  Every step appends to REPORT.
# BENCH_ARGS adds options to bench steps (e.g. "--dispatch-microbatches= --steps 4", split on spaces); FILL_PAIRS sizes bench fill.
set -uo pipefail
cd "$(dirname "$0")/.."
STEP=${STEP:-all}
REPORT=${REPORT:-gpu-report.md}
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

if ! $PYTHON - <<'PY'
import sys
try:
    import torch
except ImportError:
    sys.exit("gpu-check: no torch for this python; run it where torch with CUDA is installed")
if not torch.cuda.is_available():
    sys.exit(f"gpu-check: no CUDA device here (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
             "run make gpu-check on a machine with an NVIDIA GPU")
PY
then
    exit 2
fi

if ! $PYTHON -c "import ray" 2>/dev/null; then
    if [ ! -f .whl/ray-trimmed.tar.xz ]; then
        echo "gpu-check: no Ray here and no .whl/ray-trimmed.tar.xz; run make gpu-wheels on a CPU machine and carry .whl" >&2
        exit 2
    fi
    SITE=${SITE:-/tmp/mpmd-site}
    mkdir -p "$SITE"
    tar -C "$SITE" -xJf .whl/ray-trimmed.tar.xz
    $PYTHON -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if [ ! -f "$REPORT" ]; then
    {
        echo "# mpmd GPU check"
        echo
        echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo "- device: $(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -1)"
        $PYTHON -c "import sys, torch, ray; print(f'- python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), ray {ray.__version__}, GPUs {torch.cuda.device_count()}')"
        echo "- commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    } > "$REPORT"
fi

# Actors sharing the GPU run their kernels concurrently under CUDA MPS (one context for all of
# them), time-sliced without it.  Start it when it is there and say which way this report ran.
. scripts/mps.sh
start_mps
echo "gpu-check: CUDA MPS $MPS"
echo "- CUDA MPS ($STEP): $MPS" >> "$REPORT"

# Each section stops at LIMIT_S (default 570 s), inside one 10-minute command, so the report
# says where it stopped (exit status 124) rather than losing the command's tail.
LIMIT_S=${LIMIT_S:-570}
section() {  # section TITLE NOTE COMMAND...: run, append its output to the report, keep its status
    local title=$1 note=$2; shift 2
    echo "== $title: $*"
    { echo; echo "## $title"; echo; [ -n "$note" ] && echo "$note" && echo; echo '```'; } >> "$REPORT"
    timeout "$LIMIT_S" "$@" 2>&1 | tee -a "$REPORT"
    local rc=${PIPESTATUS[0]}
    { echo '```'; echo "exit status: $rc$([ "$rc" = 124 ] && echo " (stopped at LIMIT_S=$LIMIT_S s)")"; } >> "$REPORT"
    return "$rc"
}

# The bench puts p actors on the one GPU (num_gpus=1/p, gloo through pinned host memory) and
# compares them with the single process on the same GPU.  torch.distributed.pipelining cannot
# run several ranks on one GPU either (NCCL refuses two ranks on one device; gloo has no CUDA
# send/recv: Note [torch on one GPU] in benchmarks/bench.py), so its rows are left out (--no-torch).
BENCH_NOTE="p actors sharing the one GPU against the single process on the same GPU. torch.distributed.pipelining is not compared: it cannot run several ranks on one GPU either (NCCL refuses two ranks on one device, gloo has no CUDA send/recv)."

status=0
# Two test steps, each well inside one 10-minute command: on CPU stand-ins (device="cpu" copies,
# 2 loaded cores) tests/gpu/test_cuda.py took 466 s without its three CUDA-only tests and
# test_cuda_recipe.py 276 s; together they would not leave a margin.  The bench's CPU run
# (--device cpu --no-torch --rounds 1) took 247 s and bench fill's (--pairs 20) 117 s there.
case "$STEP" in all|tests) section "gpu tests" "" $PYTHON -m pytest -q -m gpu tests/gpu/test_cuda.py -p no:cacheprovider -rs --durations=10 || status=1 ;; esac
case "$STEP" in all|recipe) section "gpu tests: the recipe" "" $PYTHON -m pytest -q -m gpu tests/gpu/test_cuda_recipe.py -p no:cacheprovider -rs --durations=10 || status=1 ;; esac
case "$STEP" in all|moe) section "gpu tests: experts" "" $PYTHON -m pytest -q -m gpu tests/gpu/test_moe_cuda.py -p no:cacheprovider -rs --durations=10 || status=1 ;; esac
case "$STEP" in all|long) section "gpu tests: context parallelism and the overlap" "" $PYTHON -m pytest -q -m gpu tests/gpu/test_long_cuda.py -p no:cacheprovider -rs --durations=10 || status=1 ;; esac
case "$STEP" in all|bench) section "bench on CUDA" "$BENCH_NOTE" $PYTHON -m mpmd bench steps --device cuda --no-torch --rounds 1 ${BENCH_ARGS:-} || status=1 ;; esac
case "$STEP" in all|fill) section "bench fill on CUDA" "" $PYTHON -m mpmd bench fill --device cuda --pairs ${FILL_PAIRS:-20} || status=1 ;; esac
case "$STEP" in all|tests|recipe|moe|long|bench|fill) ;; *) echo "gpu-check: unknown STEP=$STEP (all, tests, recipe, moe, long, bench, fill)" >&2; exit 2 ;; esac
echo "gpu-check: report in $REPORT (status $status)"
exit $status
