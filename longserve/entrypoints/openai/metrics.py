"""GET /metrics under vLLM's metric names. `ServerMetrics`: requests and tokens, counted by the
front end (with several API servers, in PROMETHEUS_MULTIPROC_DIR: a scrape sums them all).
`EngineCollector`: the cores' load at scrape time (every API server hears every core: not summed)."""
from __future__ import annotations

import os
from typing import Callable

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector, CollectorRegistry

from longserve.engine.llm_engine import LLMEngine

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
                   0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


class ServerMetrics:
    """Hooks of the output processor (`OutputProcessor.metrics`)."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None):
        def counter(name: str, doc: str):
            return Counter(f"vllm:{name}", doc, ["model_name"], registry=registry).labels(model_name)

        def histogram(name: str, doc: str):
            return Histogram(f"vllm:{name}", doc, ["model_name"], registry=registry,
                             buckets=LATENCY_BUCKETS).labels(model_name)
        self.model_name = model_name
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens produced.")
        self.preemptions = counter("num_preemptions", "Preemptions (of finished requests).")
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=registry)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.")
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.")

    def first_token(self, num_prompt_tokens: int, ttft: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.ttft.observe(ttft)

    def tokens(self, n: int, gaps: list[float]) -> None:
        """n tokens came out in a core's step; `gaps`: the time since each one's previous token
        (a choice's first has none)."""
        self.generation_tokens.inc(n)
        for gap in gaps:
            self.itl.observe(gap)

    def finished(self, reason: str) -> None:  # per choice
        self.success.labels(self.model_name, reason).inc()

    def request_done(self, num_preemptions: int, e2e: float) -> None:
        self.preemptions.inc(num_preemptions)
        self.e2e.observe(e2e)


class EngineCollector(Collector):
    def __init__(self, get_core: Callable[[], LLMEngine | None], model_name: str):
        self.get_core, self.model_name = get_core, model_name

    def collect(self):
        engine = self.get_core()
        if engine is None:  # still loading
            return
        c = engine.coordinator  # the cores' last reports, over the live ones
        for kind, name, doc, value in (
                (GaugeMetricFamily, "num_requests_running", "Requests in model steps.", c.total("num_running")),
                (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to run.", c.num_waiting()),
                (GaugeMetricFamily, "kv_cache_usage_perc",
                 "KV-cache usage: 1 means 100 percent of the blocks are in use.", c.kv_usage()),
                (CounterMetricFamily, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                 c.total("prefix_queries")),
                (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                 c.total("prefix_hits"))):
            family = kind(f"vllm:{name}", doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


def make_registry(get_core: Callable[[], LLMEngine | None],
                  model_name: str) -> tuple[CollectorRegistry, ServerMetrics]:
    """The registry /metrics serves, and the metrics this process counts into."""
    registry = CollectorRegistry(auto_describe=False)
    several = "PROMETHEUS_MULTIPROC_DIR" in os.environ  # several API servers: sum their files
    if several:
        MultiProcessCollector(registry)
    registry.register(EngineCollector(get_core, model_name))
    return registry, ServerMetrics(model_name, None if several else registry)
