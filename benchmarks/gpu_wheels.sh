#!/usr/bin/env bash
# Fills .whl/ (ignored by git) with the Python packages the device machine lacks, for
# benchmarks/gpu_check.sh: the device has no network, Python 3.12 and transformers 5.17, and
# the parity peer needs transformers >= 5.24 (its other needs are already there). Run here,
# before the lease; then `run` with carry [".whl"].
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.whl/ >>.git/info/exclude; }
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "transformers==5.24.0"
ls -la .whl
