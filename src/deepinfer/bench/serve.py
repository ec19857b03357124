"""``deepinfer bench serve``: a load generator for any OpenAI-compatible server (ours,
``transformers serve``, llama.cpp's ``llama-server``, vLLM), printing what ``vllm bench serve``
prints: requests that succeeded and failed, duration, request and token throughput, and the
mean / median / p99 of time to first token (TTFT), time per output token after the first
(TPOT) and inter-token latency (ITL).

Requests stream (``stream=True`` with ``stream_options.include_usage``) so TTFT and ITL are
seen as the client sees them; generated tokens come from the final usage chunk (a server that
sends none is counted by content chunks). Load is a fixed concurrency or a Poisson arrival
rate (``--request-rate``, with ``--max-concurrency`` as a cap).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "What does CPU stand for?",
    "Why do leaves change color in autumn?",
    "List two benefits of exercise.",
    "Describe a cat in five words.",
    "How many days are in a leap year?",
    "Give me three tips for a job interview.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]
WORDS = "time person year way day thing man world life hand part child eye woman place work week case point".split()


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_requests(dataset: str, num: int, input_len: int, seed: int) -> list[dict]:
    """Request bodies (without model/max_tokens): ``random`` (``input_len`` random words as a
    completion prompt) or ``chat`` (chat questions, cycled)."""
    rng = random.Random(seed)
    if dataset == "random":
        return [{"prompt": " ".join(rng.choice(WORDS) for _ in range(input_len))} for _ in range(num)]
    if dataset == "chat":
        return [
            {"messages": [{"role": "user", "content": CHAT_PROMPTS[i % len(CHAT_PROMPTS)]}]}
            for i in range(num)
        ]
    raise ValueError(f"dataset must be 'random' or 'chat', got {dataset!r}")


async def _one(
    client, base_url: str, model: str, body: dict, max_tokens: int, api_key: str | None, ignore_eos: bool
) -> RequestResult:
    chat = "messages" in body
    url = f"{base_url}/v1/{'chat/completions' if chat else 'completions'}"
    payload = {
        **body,
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:  # vLLM's extra field (fixed output lengths); some servers refuse it
        payload["ignore_eos"] = True
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = start
    chunks = 0
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as r:
            if r.status_code != 200:
                result.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if event.get("usage"):
                    result.prompt_tokens = event["usage"].get("prompt_tokens", 0)
                    result.output_tokens = event["usage"].get("completion_tokens", 0)
                for choice in event.get("choices", []):
                    piece = choice.get("text") if not chat else (choice.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
    except Exception as exc:  # a refused connection, a dropped stream
        result.error = repr(exc)
        return result
    result.latency = time.perf_counter() - start
    result.output_tokens = result.output_tokens or chunks
    result.ok = chunks > 0
    return result


async def run(
    base_url: str,
    model: str,
    requests: list[dict],
    max_tokens: int,
    max_concurrency: int | None,
    request_rate: float,
    api_key: str | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
) -> tuple[list[RequestResult], float]:
    import httpx

    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency or len(requests))
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:

        async def limited(body: dict) -> RequestResult:
            async with limit:
                return await _one(client, base_url, model, body, max_tokens, api_key, ignore_eos)

        start = time.perf_counter()
        tasks = []
        for body in requests:
            tasks.append(asyncio.create_task(limited(body)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]
    return {"mean": statistics.fmean(values), "median": statistics.median(values), "p99": p99}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "successful_requests": len(ok),
        "failed_requests": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_generated_tokens": out_tokens,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "ttft_ms": {k: v * 1e3 for k, v in _stats([r.ttft for r in ok]).items()},
        "tpot_ms": {k: v * 1e3 for k, v in _stats(tpots).items()},
        "itl_ms": {k: v * 1e3 for k, v in _stats([x for r in ok for x in r.itl]).items()},
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def report(summary: dict) -> str:
    lines = ["============ Serving Benchmark Result ============"]
    for key in (
        "successful_requests",
        "failed_requests",
        "duration_s",
        "total_input_tokens",
        "total_generated_tokens",
        "request_throughput",
        "output_token_throughput",
        "total_token_throughput",
    ):
        value = summary[key]
        lines.append(f"{key:<32} {value:.2f}" if isinstance(value, float) else f"{key:<32} {value}")
    for metric in ("ttft_ms", "tpot_ms", "itl_ms"):
        for stat in ("mean", "median", "p99"):
            lines.append(f"{stat + ' ' + metric:<32} {summary[metric][stat]:.2f}")
    for err in summary["errors"]:
        lines.append(f"error: {err}")
    return "\n".join(lines)


def main(args) -> int:
    requests = make_requests(args.dataset, args.num_prompts, args.input_len, args.seed)
    results, duration = asyncio.run(
        run(
            args.base_url.rstrip("/"),
            args.model,
            requests,
            args.output_len,
            args.max_concurrency,
            args.request_rate,
            args.api_key,
            args.seed,
            args.ignore_eos,
        )
    )
    summary = summarize(results, duration)
    summary["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    print(report(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2, default=str)
    return 0 if summary["successful_requests"] else 1
