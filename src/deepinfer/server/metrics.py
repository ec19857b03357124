"""Prometheus metrics (``deepinfer:`` prefix, vLLM's names where vLLM has one), in a registry
of the app's own so two servers in one process (tests) do not collide."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from deepinfer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self._prompt_total = 0  # for the hit rate (prompt tokens, and those served from cache)
        self._cached_total = 0
        labels = ["model_name"]
        self.model_name = model_name
        self.running = Gauge(
            "deepinfer:num_requests_running", "Requests in the running batch", labels, registry=self.registry
        )
        self.waiting = Gauge(
            "deepinfer:num_requests_waiting", "Requests waiting to run", labels, registry=self.registry
        )
        self.kv_usage = Gauge(
            "deepinfer:kv_cache_usage_perc",
            "Share of KV cache blocks in use (0-1)",
            labels,
            registry=self.registry,
        )
        self.prefix_hit = Gauge(
            "deepinfer:prefix_cache_hit_rate",
            "Prompt tokens served from the prefix cache, share of all",
            labels,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "deepinfer:time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "deepinfer:time_per_output_token_seconds",
            "Mean time per output token after the first",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "deepinfer:e2e_request_latency_seconds",
            "Arrival to finish",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.generation_tokens = Counter(
            "deepinfer:generation_tokens", "Generated tokens", labels, registry=self.registry
        )
        self.prompt_tokens = Counter(
            "deepinfer:prompt_tokens", "Prompt tokens", labels, registry=self.registry
        )
        self.cached_tokens = Counter(
            "deepinfer:prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache",
            labels,
            registry=self.registry,
        )
        self.finished = Counter(
            "deepinfer:request_success",
            "Finished requests by reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.spec_drafted = Counter(
            "deepinfer:spec_decode_num_draft_tokens", "Drafted tokens", labels, registry=self.registry
        )
        self.spec_accepted = Counter(
            "deepinfer:spec_decode_num_accepted_tokens",
            "Accepted draft tokens",
            labels,
            registry=self.registry,
        )

    def observe_finished(self, out: RequestOutput) -> None:
        """Per-request figures, called once per finished request."""
        name = self.model_name
        self._prompt_total += len(out.prompt_token_ids)
        self._cached_total += out.num_cached_tokens
        self.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
        self.cached_tokens.labels(name).inc(out.num_cached_tokens)
        for c in out.outputs:
            self.finished.labels(name, c.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        self.generation_tokens.labels(name).inc(m.num_generated_tokens)
        self.spec_drafted.labels(name).inc(m.num_draft_tokens)
        self.spec_accepted.labels(name).inc(m.num_accepted_tokens)
        if m.ttft is not None:
            self.ttft.labels(name).observe(m.ttft)
        if m.tpot is not None:
            self.tpot.labels(name).observe(m.tpot)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)

    def refresh(self, running: int, waiting: int, kv_usage: float) -> None:
        name = self.model_name
        self.running.labels(name).set(running)
        self.waiting.labels(name).set(waiting)
        self.kv_usage.labels(name).set(kv_usage)
        rate = self._cached_total / self._prompt_total if self._prompt_total else 0.0
        self.prefix_hit.labels(name).set(rate)
