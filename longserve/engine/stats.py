"""What the engine core counts about the requests it served (exported by the server as metrics).

Plain numbers updated by the core's thread and read by whoever reports them; the names
follow vLLM's Prometheus metrics (the HTTP layer adds the `vllm:` prefix).
"""
from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
                   0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)


@dataclass
class Histogram:
    buckets: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; last is +Inf
    sum: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper bound, observations <= it)], ending with (inf, count)."""
        out, total = [], 0
        for bound, c in zip((*self.buckets, float("inf")), self.counts):
            total += c
            out.append((bound, total))
        return out


@dataclass
class EngineStats:
    prompt_tokens: int = 0  # prompts whose first output token came out
    generation_tokens: int = 0
    finished: Counter = field(default_factory=Counter)  # finish reason -> requests
    num_preemptions: int = 0  # of finished requests
    time_to_first_token: Histogram = field(default_factory=Histogram)
    inter_token_latency: Histogram = field(default_factory=Histogram)
    e2e_request_latency: Histogram = field(default_factory=Histogram)
