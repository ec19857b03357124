#!/usr/bin/env bash
# The prepared check for the lent NVIDIA machine (one H200, no network, Python 3.12, torch
# 2.11 + CUDA, transformers 5.17). Whole run under 7 minutes, so one rerun fits a 15-minute
# lease. Each stage runs under its own time limit and logs to $OUT/<stage>.log; a failing or
# timed-out stage is reported and the next one still runs. Exit status: failed stages.
#
# Before the lease, here:   bash benchmarks/gpu_wheels.sh       (fills .whl/: transformers 5.24)
# On the device (run tool): carry [".whl"], command "bash benchmarks/gpu_check.sh"
# Dry run on a CPU:         GPU_CHECK_DRY_RUN=1 OUT=DIR bash benchmarks/gpu_check.sh
#
# Stages, in order (GPU_CHECK_STAGES picks some):
#   env      versions of python, torch, CUDA, triton, transformers; nvidia-smi
#   install  carried wheels into /tmp/site; deepinfer without build isolation, index or deps
#            (pyproject pins torch>=2.13, the version CI tests; the device's torch is used as
#            it is, and this stage prints it), else a copy of the package on PYTHONPATH
#   decode   benchmarks/gpu_decode.py: bs 1 and 64 decode, eager / compiled / graphs, the HBM
#            bound, transformers on the same weights
#   tests    gpu_tests/ (CUDA paths) and tests/compile/test_capture_safety.py (capture rules), -v -rA
# Record the figures in benchmarks/RESULTS.md with the date and this command.
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
DRY=${GPU_CHECK_DRY_RUN:-0}
STAGES=${GPU_CHECK_STAGES:-env install decode tests}
FAIL_STAGE=${GPU_CHECK_FAIL:-}  # the script's own test: this stage is made to fail
if [ "$DRY" = 1 ]; then
    DECODE_ARGS=(--small --device cpu --batches 1 4 --steps 4 --modes ${GPU_CHECK_MODES:-eager compiled})
    LIMITS=(env=60 install=120 decode=420 tests=300)
else
    DECODE_ARGS=(--batches 1 64 --steps 16 --modes ${GPU_CHECK_MODES:-eager compiled graphs})
    LIMITS=(env=20 install=60 decode=200 tests=140)
fi
limit_of() { for kv in "${LIMITS[@]}"; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
FAILED=0

stage_env() {
    python3 - <<'PY'
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
for name in ("triton", "transformers", "safetensors", "numpy", "pytest", "pytest_timeout", "hypothesis"):
    try:
        print(name, importlib.import_module(name).__version__)
    except Exception as e:  # absent packages are reported, not fatal
        print(name, "missing:", type(e).__name__)
PY
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    return 0
}

stage_install() {
    if compgen -G ".whl/*.whl" >/dev/null; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl || return 1
        echo "carried wheels installed into /tmp/site: $(ls .whl)"
    else
        echo "no carried wheels (.whl/): the machine's packages are used as they are"
    fi
    if [ "$DRY" = 1 ]; then
        echo "dry run: deepinfer is already installed here; not reinstalled"
    elif ! python3 -m pip install -q --no-build-isolation --no-index --no-deps -e . ; then
        echo "pip could not install deepinfer; falling back to a copy on PYTHONPATH"
        rm -rf /tmp/deepinfer-src && mkdir -p /tmp/deepinfer-src
        cp -r src/deepinfer /tmp/deepinfer-src/deepinfer
        cp -r compile_passes /tmp/deepinfer-src/deepinfer/compile_passes
        cp -r kernels /tmp/deepinfer-src/deepinfer/kernels
        echo /tmp/deepinfer-src >/tmp/deepinfer-path
    fi
    python3 -c "import deepinfer, torch, transformers; print('deepinfer from', deepinfer.__file__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
}

stage_decode() {
    python3 benchmarks/gpu_decode.py "${DECODE_ARGS[@]}"
}

stage_tests() {
    local extra=()
    python3 -c "import pytest_timeout" 2>/dev/null && extra=(--timeout=120)
    python3 -m pytest -v -rA -p no:cacheprovider "${extra[@]}" gpu_tests tests/compile/test_capture_safety.py
}

for stage in $STAGES; do
    limit=$(limit_of "$stage")
    log="$OUT/$stage.log"
    echo "== $stage (limit ${limit}s, log $log)"
    start=$(date +%s)
    if [ "$stage" = "$FAIL_STAGE" ]; then
        echo "made to fail (GPU_CHECK_FAIL=$stage)" >"$log"
        rc=1
    elif [ "$stage" = install ]; then
        # runs in this shell so PYTHONPATH reaches the later stages; pip has its own timeouts
        stage_install >"$log" 2>&1
        rc=$?
    else
        export -f "stage_$stage"
        export DRY DECODE_ARGS_STR="${DECODE_ARGS[*]}"
        timeout -s INT -k 15 "$limit" bash -c "DECODE_ARGS=(\$DECODE_ARGS_STR); stage_$stage" >"$log" 2>&1
        rc=$?
    fi
    if [ "$stage" = install ]; then
        [ -d /tmp/site ] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
        [ -f /tmp/deepinfer-path ] && export PYTHONPATH="$(cat /tmp/deepinfer-path):$PYTHONPATH"
    fi
    took=$(($(date +%s) - start))
    case $rc in
        0) verdict=ok ;;
        124 | 130 | 137) verdict="TIMED OUT after ${limit}s" ;;
        *) verdict="FAILED (rc $rc)" ;;
    esac
    [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
    echo "$stage: $verdict in ${took}s" | tee -a "$SUMMARY"
    tail -n 25 "$log" | sed 's/^/    /'
done
echo "== summary ($OUT)"
cat "$SUMMARY"
exit "$FAILED"
