#!/usr/bin/env bash
# One prepared check for an NVIDIA machine (budget: under 8 minutes on one H200).
#   bash benchmarks/gpu_check.sh
# 1. installs the project (keeping the machine's CUDA build of torch),
# 2. runs the CUDA tests (gpu_tests/: graphs + compile == eager, Triton kernels on CUDA,
#    speculative decoding with every drafter),
# 3. prints bs=1/8/64 decode step times for eager, compiled and CUDA-graph modes on a
#    ~1.9B-parameter V4-shaped model, with the HBM-bandwidth bound and transformers.
# Record what it prints in benchmarks/RESULTS.md with the date and this command.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
python3 -m pip install -q --no-deps -e . 2>&1 | tail -1
python3 -m pip install -q safetensors "transformers>=5.24" gguf tqdm pytest 2>&1 | tail -1
python3 -c "import triton" 2>/dev/null || python3 -m pip install -q triton 2>&1 | tail -1
timeout 240 python3 -m pytest -q -x gpu_tests
timeout 240 python3 benchmarks/gpu_decode.py --batches 1 8 64 --steps 32
