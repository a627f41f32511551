"""GET /metrics: the engine core's counts in Prometheus format, under vLLM's metric names.

A collector reads the core at scrape time (no second bookkeeping): gauges from the
scheduler and the KV pool, counters and histograms from `EngineStats`."""
from __future__ import annotations

from typing import Callable

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.utils import floatToGoString

from longserve.engine.llm_engine import LLMEngine
from longserve.engine.stats import Histogram


class EngineCollector(Collector):
    def __init__(self, get_core: Callable[[], LLMEngine | None], model_name: str):
        self.get_core = get_core
        self.model_name = model_name

    def _family(self, kind, name: str, doc: str, value, **labels):
        family = kind(f"vllm:{name}", doc, labels=["model_name", *labels])
        family.add_metric([self.model_name, *labels.values()], value)
        return family

    def _histogram(self, name: str, doc: str, h: Histogram) -> HistogramMetricFamily:
        family = HistogramMetricFamily(f"vllm:{name}", doc, labels=["model_name"])
        buckets = [(floatToGoString(bound), count) for bound, count in h.cumulative()]
        family.add_metric([self.model_name], buckets, h.sum)
        return family

    def collect(self):
        core = self.get_core()
        if core is None:  # still loading
            return
        stats, (queried, hits) = core.stats, core.prefix_cache_tokens()
        yield self._family(GaugeMetricFamily, "num_requests_running", "Requests in model steps.",
                           core.num_running)
        yield self._family(GaugeMetricFamily, "num_requests_waiting", "Requests waiting to run.",
                           core.num_waiting)
        yield self._family(GaugeMetricFamily, "kv_cache_usage_perc",
                           "KV-cache usage: 1 means 100 percent of the blocks are in use.", core.kv_cache_usage())
        yield self._family(CounterMetricFamily, "prompt_tokens", "Prefill tokens processed.",
                           stats.prompt_tokens)
        yield self._family(CounterMetricFamily, "generation_tokens", "Generation tokens produced.",
                           stats.generation_tokens)
        yield self._family(CounterMetricFamily, "prefix_cache_queries",
                           "Prompt tokens looked up in the prefix cache.", queried)
        yield self._family(CounterMetricFamily, "prefix_cache_hits",
                           "Prompt tokens found in the prefix cache.", hits)
        yield self._family(CounterMetricFamily, "num_preemptions", "Preemptions (of finished requests).",
                           stats.num_preemptions)
        success = CounterMetricFamily("vllm:request_success", "Finished requests by finish reason.",
                                      labels=["model_name", "finished_reason"])
        for reason, n in sorted(stats.finished.items()):
            success.add_metric([self.model_name, reason], n)
        yield success
        yield self._histogram("time_to_first_token_seconds", "Time to first token.",
                              stats.time_to_first_token)
        yield self._histogram("inter_token_latency_seconds", "Time between output tokens.",
                              stats.inter_token_latency)
        yield self._histogram("e2e_request_latency_seconds", "Arrival to finish.",
                              stats.e2e_request_latency)


def make_registry(get_core: Callable[[], LLMEngine | None], model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(get_core, model_name))
    return registry
