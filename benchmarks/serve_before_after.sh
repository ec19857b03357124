#!/usr/bin/env bash
# `deepinfer bench serve` against the server of an older commit and of the working tree, in
# turn (old, new, old, new), each alone on the machine: did a server change cost throughput?
#
# Usage: bash benchmarks/serve_before_after.sh REV [ROUNDS]
# The older server runs from a worktree of REV (its src/ first on PYTHONPATH; the kernels and
# passes come from this install, as they do for both). Same model, flags and load for both:
# SmolLM2-135M, --max-num-seqs 64; per dataset (chat, random) 64 requests of at most 64
# tokens (EOS ignored) at concurrency 32, after one warm-up request.
set -euo pipefail
cd "$(dirname "$0")/.."
REV=${1:?usage: serve_before_after.sh REV [ROUNDS]}
ROUNDS=${2:-2}
OLD=$(mktemp -d)/old
git worktree add -q --detach "$OLD" "$REV"
trap 'git worktree remove --force "$OLD"' EXIT
PORT=8765
URL=http://127.0.0.1:$PORT

serve_and_load() {  # $1: label, $2: PYTHONPATH prefix ("" for the working tree)
    PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}" python3 -m deepinfer.cli serve smollm2-135m \
        --port $PORT --max-num-seqs 64 --log-level error &
    local pid=$!
    until curl -sf "$URL/health" >/dev/null; do sleep 0.5; done
    curl -sf "$URL/v1/completions" -H 'content-type: application/json' \
        -d '{"model": "smollm2-135m", "prompt": "warm up", "max_tokens": 8}' >/dev/null
    for dataset in chat random; do
        echo "== $1 $dataset"
        python3 -m deepinfer.cli bench serve --base-url "$URL" --model smollm2-135m --dataset "$dataset" \
            --num-prompts 64 --output-len 64 --max-concurrency 32 --ignore-eos
    done
    kill -TERM $pid
    wait $pid
}

for round in $(seq "$ROUNDS"); do
    echo "#### round $round"
    serve_and_load "before ($REV)" "$OLD/src"
    serve_and_load "after (working tree)" ""
done
