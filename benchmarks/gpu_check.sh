#!/usr/bin/env bash
# The prepared check for the lent NVIDIA machine (one H100 or H200, no network, Python 3.12,
# torch + CUDA, transformers). The lease is 15 minutes with the machine's start-up in it, so
# the whole script is held to 8 minutes: every stage runs under its own time limit, and the
# limits plus their kill grace add up to at most 480 s (GPU_CHECK_PLAN=1 prints them). Stages
# run key figures first; the slow ones (Inductor's compiles, the transformers peer) come last,
# so a cut loses them and nothing before. A failing or timed-out stage is reported and the
# next one still runs. Exit status: the number of failed stages.
#
# Before the lease, here:   bash benchmarks/gpu_wheels.sh       (fills .whl/: transformers)
# On the device (run tool): carry [".whl"], command "bash benchmarks/gpu_check.sh"
# Dry run on a CPU:         GPU_CHECK_DRY_RUN=1 OUT=DIR bash benchmarks/gpu_check.sh
#
# Stages, in order (GPU_CHECK_STAGES picks some, e.g. "env install tests-inductor"):
#   env        versions of python, torch, CUDA, triton, transformers; nvidia-smi
#   install    carried wheels into a private site folder; deepinfer without build isolation,
#              index or deps (pyproject pins the torch CI tests; the device's torch is used as
#              it is, and this stage prints it), else a copy of the package on PYTHONPATH
#   decode     the key figures: benchmarks/gpu_decode.py, CUDA graphs over the eager step then
#              eager, at batch 1 then 64, on a SmolLM2-1.7B-shaped Llama then a 1.9B V4:
#              device and host time per step, % of the HBM bound
#   tests      the short CUDA checks: gpu_tests/ and tests/compile/test_capture_safety.py,
#              without the cases whose step Inductor compiles
#   peer       transformers' generate on the same checkpoints
#   inductor   the compiled modes: Inductor's step, then CUDA graphs over it
#   (tests-inductor, only when named: the gpu_tests cases over a compiled step; too slow
#    for the 8 minutes)
#
# Results: $OUT/results.md, a section per stage with one markdown row per measurement (per
# decode row, per test), each appended and flushed the moment it is measured, so a stage cut
# by its limit keeps what it measured; each section ends with the stage's verdict. The final
# summary prints the key figures first. Logs: $OUT/<stage>.log. Record the figures in
# benchmarks/RESULTS.md with the date and this command.
#
# For the script's own tests: GPU_CHECK_FAIL=<stage> makes that stage fail; GPU_CHECK_LIMITS
# ("decode=20 tests=5") overrides limits; GPU_DECODE_HANG_AFTER_ROWS=N makes gpu_decode.py
# stop responding after N rows, so its stage meets its limit.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export DRY=${GPU_CHECK_DRY_RUN:-0}
STAGES=${GPU_CHECK_STAGES:-env install decode tests peer inductor}
FAIL_STAGE=${GPU_CHECK_FAIL:-}
GRACE=5  # seconds between a stage's SIGINT (Python unwinds, pytest reports) and its SIGKILL
BUDGET=480
if [ "$DRY" = 1 ]; then
    # tiny models on the CPU; the compiled modes use torch.compile's "eager" backend (the
    # logic of the stage, not Inductor's minutes of compiling); the late stages on one model
    export DECODE_COMMON="--small --device cpu --batches 1 4 --steps 4" BACKEND=eager
    export LATE_MODELS="--models smollm2"
    # the capture rules' cases that build whole engines are left to CI's own run of tests/
    export DRY_SKIP=" and not capturable and not drafter_steps"
    LIMITS=(env=60 install=120 decode=180 tests=300 peer=180 inductor=240 tests-inductor=300)
else
    export DECODE_COMMON="--batches 1 64 --steps 16" BACKEND=inductor LATE_MODELS="" DRY_SKIP=""
    LIMITS=(env=20 install=45 decode=160 tests=100 peer=35 inductor=60 tests-inductor=240)
fi
# shellcheck disable=SC2206  # "stage=seconds" words
LIMITS+=(${GPU_CHECK_LIMITS:-})
limit_of() {  # the last entry for the stage wins (the test overrides come last)
    local found=""
    for kv in "${LIMITS[@]}"; do [ "${kv%%=*}" = "$1" ] && found=${kv#*=}; done
    echo "$found"
}

if [ "${GPU_CHECK_PLAN:-0}" = 1 ]; then  # print the stages and their limits, run nothing
    total=0
    for stage in $STAGES; do
        limit=$(limit_of "$stage")
        echo "$stage $limit"
        total=$((total + limit + GRACE))
    done
    echo "total $total (limits + ${GRACE}s kill grace each; budget $BUDGET)"
    exit 0
fi

STATE=$(mktemp -d)  # carried wheels' site folder, the package copy, the random checkpoints
trap 'rm -rf "$STATE"' EXIT
export STATE RESULTS="$OUT/results.md" GPU_CHECK_CKPT=${GPU_CHECK_CKPT:-$STATE/checkpoints}
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
echo "# GPU check ($(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git'))" >"$RESULTS"
FAILED=0
START=$(date +%s)

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
    if [ "$DRY" = 1 ]; then
        echo "dry run: no carried wheels installed; deepinfer is already installed here"
    else
        if compgen -G ".whl/*.whl" >/dev/null; then
            python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target "$STATE/site" .whl/*.whl || return 1
            echo "carried wheels installed into $STATE/site: $(ls .whl)"
        else
            echo "no carried wheels (.whl/): the machine's packages are used as they are"
        fi
        if ! python3 -m pip install -q --no-build-isolation --no-index --no-deps -e .; then
            echo "pip could not install deepinfer; falling back to a copy on PYTHONPATH"
            mkdir -p "$STATE/src"
            cp -r src/deepinfer "$STATE/src/deepinfer"
            cp -r compile_passes "$STATE/src/deepinfer/compile_passes"
            cp -r kernels "$STATE/src/deepinfer/kernels"
        fi
    fi
    # the later stages' PYTHONPATH (this stage runs in a child shell)
    local path=""
    [ -d "$STATE/site" ] && path="$STATE/site"
    [ -d "$STATE/src" ] && path="$STATE/src${path:+:$path}"
    echo "$path" >"$STATE/pythonpath"
    PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import deepinfer, torch, transformers; print('deepinfer from', deepinfer.__file__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
}

decode_py() {
    # shellcheck disable=SC2086  # DECODE_COMMON is a list of words
    python3 benchmarks/gpu_decode.py $DECODE_COMMON --results "$RESULTS" --checkpoints "$GPU_CHECK_CKPT" "$@"
}

stage_decode() { decode_py --modes graphs-eager eager; }

# shellcheck disable=SC2086  # LATE_MODELS is a list of words
stage_peer() { decode_py --modes transformers $LATE_MODELS; }

# shellcheck disable=SC2086
stage_inductor() { decode_py --modes compiled graphs --compile-backend "$BACKEND" $LATE_MODELS; }

run_pytest() {
    local extra=()
    python3 -c "import pytest_timeout" 2>/dev/null && extra=(--timeout=60)
    GPU_CHECK_RESULTS="$RESULTS" PYTHONPATH="gpu_tests${PYTHONPATH:+:$PYTHONPATH}" python3 -m pytest -v -rA \
        -p no:cacheprovider -p result_rows "${extra[@]}" gpu_tests tests/compile/test_capture_safety.py "$@"
}

stage_tests() { run_pytest -k "not compiled-step$DRY_SKIP"; }

stage_tests_inductor() { run_pytest -k "compiled-step"; }

export -f stage_env stage_install decode_py stage_decode stage_peer stage_inductor run_pytest \
    stage_tests stage_tests_inductor

for stage in $STAGES; do
    fn="stage_${stage//-/_}"
    limit=$(limit_of "$stage")
    if [ -z "$limit" ] || ! declare -F "$fn" >/dev/null; then
        echo "$stage: unknown stage" | tee -a "$SUMMARY"
        FAILED=$((FAILED + 1))
        continue
    fi
    log="$OUT/$stage.log"
    echo "== $stage (limit ${limit}s, log $log)"
    printf '\n## %s (limit %ss)\n\n' "$stage" "$limit" >>"$RESULTS"
    start=$(date +%s)
    if [ "$stage" = "$FAIL_STAGE" ]; then
        echo "made to fail (GPU_CHECK_FAIL=$stage)" >"$log"
        rc=1
    else
        timeout -s INT -k "$GRACE" "$limit" bash -c "$fn" >"$log" 2>&1
        rc=$?
    fi
    if [ "$stage" = install ] && [ -s "$STATE/pythonpath" ]; then
        export PYTHONPATH="$(cat "$STATE/pythonpath")${PYTHONPATH:+:$PYTHONPATH}"
    fi
    took=$(($(date +%s) - start))
    case $rc in
        0) verdict=ok ;;
        124 | 137) verdict="TIMED OUT after ${limit}s" ;;
        *) verdict="FAILED (rc $rc)" ;;
    esac
    [ "$rc" = 0 ] || FAILED=$((FAILED + 1))
    case $stage in  # stages without rows keep their short log in the results
        env | install) sed 's/^/    /' "$log" >>"$RESULTS" ;;
    esac
    printf '\n%s: %s in %ss\n' "$stage" "$verdict" "$took" | tee -a "$RESULTS"
    echo "$stage: $verdict in ${took}s" >>"$SUMMARY"
    tail -n 15 "$log" | sed 's/^/    /'
done
echo "== key figures (decode rows of $RESULTS)"
awk '/^## /{on = ($2 == "decode"); next} on && /^\| /' "$RESULTS"
echo "== stages ($OUT, $(($(date +%s) - START))s in all)"
cat "$SUMMARY"
exit "$FAILED"
