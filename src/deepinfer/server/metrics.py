"""Prometheus metrics (``deepinfer:`` prefix, vLLM's names where vLLM has one, labelled with the
served model's name), in a registry of the app's own so two servers in one process (tests) do
not collide. A server with ``--enable-lora`` also reports its adapters: how many are loaded,
how many the running requests use, and vLLM's ``lora_requests_info`` (the running and waiting
requests' adapters as labels, the time of the scrape as its value)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.core import Metric as Metric_
from prometheus_client.registry import Collector

from deepinfer.outputs import Metric, RequestOutput

if TYPE_CHECKING:
    from deepinfer.server.engine_client import LoraLoad


class _CacheCollector(Collector):
    """Reports the engine's cache metrics (counters and gauges the engine keeps itself) as
    they were at the last scrape, labelled with the model's name."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.metrics: list[Metric] = []

    def collect(self) -> Iterator[Metric_]:
        families: dict[str, Metric_] = {}
        for m in self.metrics:
            labels = {"model_name": self.model_name, **m.labels}
            family = families.get(m.name)
            if family is None:
                kind = CounterMetricFamily if m.kind == "counter" else GaugeMetricFamily
                family = families[m.name] = kind(m.name, m.doc, labels=list(labels))
            family.add_metric(list(labels.values()), m.value)
        yield from families.values()


_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    def __init__(self, model_name: str, lora: bool = False) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self._prompt_total = 0  # for the hit rate (prompt tokens, and those served from cache)
        self._cached_total = 0

        def metric(kind: type, name: str, doc: str, **kwargs: Any) -> Any:
            """The model's series of a new ``deepinfer:name`` metric."""
            return kind(f"deepinfer:{name}", doc, ["model_name"], registry=self.registry, **kwargs).labels(
                model_name
            )

        latency = {"buckets": _LATENCY_BUCKETS}
        self.running = metric(Gauge, "num_requests_running", "Requests in the running batch")
        self.waiting = metric(Gauge, "num_requests_waiting", "Requests waiting to run")
        self.kv_usage = metric(Gauge, "kv_cache_usage_perc", "Share of KV cache blocks in use (0-1)")
        self.prefix_hit = metric(
            Gauge, "prefix_cache_hit_rate", "Prompt tokens served from the prefix cache, share of all"
        )
        self.moe_lb = metric(
            Gauge, "moe_lb", "Expert-parallel balance: slowest rank's routed tokens / the mean (1: even)"
        )
        self.ttft = metric(Histogram, "time_to_first_token_seconds", "Time to first token", **latency)
        self.tpot = metric(
            Histogram,
            "time_per_output_token_seconds",
            "Mean time per output token after the first",
            **latency,
        )
        self.e2e = metric(Histogram, "e2e_request_latency_seconds", "Arrival to finish", **latency)
        self.generation_tokens = metric(Counter, "generation_tokens", "Generated tokens")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens")
        self.cached_tokens = metric(
            Counter, "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"
        )
        self.spec_drafted = metric(Counter, "spec_decode_num_draft_tokens", "Drafted tokens")
        self.spec_accepted = metric(Counter, "spec_decode_num_accepted_tokens", "Accepted draft tokens")
        finished = Counter(
            "deepinfer:request_success",
            "Finished requests by reason",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.finished = lambda reason: finished.labels(model_name, reason)
        if lora:
            self._add_lora_metrics(metric)
        self._own = {"deepinfer:kv_cache_usage_perc"}  # set by ``refresh``
        self._cache = _CacheCollector(model_name)
        self.registry.register(self._cache)

    def _add_lora_metrics(self, metric: Any) -> None:
        """The adapter gauges, only on a server that serves adapters (as vLLM does)."""
        self.lora_loaded = metric(Gauge, "lora_adapters_loaded", "LoRA adapters loaded")
        self.lora_running = metric(
            Gauge, "lora_adapters_running", "Distinct LoRA adapters the running requests use"
        )
        self.lora_info = Gauge(
            "deepinfer:lora_requests_info",
            "The running and waiting requests' LoRA adapters (comma-separated); value: scrape time",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=self.registry,
        )

    def observe_finished(self, out: RequestOutput) -> None:
        """Per-request figures, called once per finished request."""
        self._prompt_total += len(out.prompt_token_ids)
        self._cached_total += out.num_cached_tokens
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.cached_tokens.inc(out.num_cached_tokens)
        for c in out.outputs:
            self.finished(c.finish_reason or "unknown").inc()
        m = out.metrics
        if m is None:
            return
        self.generation_tokens.inc(m.num_generated_tokens)
        self.spec_drafted.inc(m.num_draft_tokens)
        self.spec_accepted.inc(m.num_accepted_tokens)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)

    def refresh(self, running: int, waiting: int, kv_usage: float, moe_lb: float = 1.0) -> None:
        self.moe_lb.set(moe_lb)
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.prefix_hit.set(self._cached_total / self._prompt_total if self._prompt_total else 0.0)

    def refresh_cache(self, metrics: list[Metric]) -> None:
        """The engine's cache series (``LLM.get_metrics()``) as of this scrape."""
        self._cache.metrics = [m for m in metrics if m.name not in self._own]

    def refresh_lora(self, load: LoraLoad) -> None:
        """The adapter gauges; the info series is replaced, so it always shows the last scrape."""
        self.lora_loaded.set(load.loaded)
        self.lora_running.set(len(load.running))
        self.lora_info.clear()
        self.lora_info.labels(
            self.model_name, str(load.max_loras), ",".join(load.running), ",".join(load.waiting)
        ).set(time.time())
