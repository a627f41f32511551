"""LONGSERVE_TRACE=DIR:FIRST:COUNT: every rank runs the torch profiler over its steps FIRST to
FIRST + COUNT - 1 (from 0, warm-up included) into DIR/rank<R>.json (benchmarks/trace_gaps.py reads
one; trace_skew.py the ranks' waits in collectives, which one trace cannot tell from transfer)."""
from __future__ import annotations

import os

import torch

TRACE = "LONGSERVE_TRACE"


class StepTrace:
    def __init__(self, rank: int, device: torch.device, spec: str | None = None):
        spec = spec if spec is not None else os.environ.get(TRACE, "")
        self.rank, self.device, self.step, self.prof = rank, device, 0, None
        self.dir, first, count = spec.rsplit(":", 2) if spec else ("", "0", "0")
        self.first, self.end = int(first), int(first) + int(count)

    def before_step(self) -> None:
        if self.dir and self.step == self.first:
            from torch.profiler import ProfilerActivity, profile
            cuda = [ProfilerActivity.CUDA] if self.device.type == "cuda" else []
            self.prof = profile(activities=[ProfilerActivity.CPU, *cuda])
            self.prof.start()

    def after_step(self) -> None:
        self.step += 1
        if self.prof is not None and self.step == self.end:
            if self.device.type == "cuda":  # the step's kernels are still queued (async scheduling)
                torch.cuda.synchronize(self.device)
            self.prof.stop()
            os.makedirs(self.dir, exist_ok=True)
            self.prof.export_chrome_trace(os.path.join(self.dir, f"rank{self.rank}.json"))
            self.prof = None
