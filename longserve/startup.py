"""The start-up timeline: per process, `mark(name)` ends the phase begun at the previous mark (so
phases add up to the process's time); workers' timelines go through the rendezvous store, the
core's `info()` carries them, and the front end prints one line (`describe`)."""
from __future__ import annotations

import os
import time


class Timeline:
    def __init__(self, start: float | None = None):
        self.start = time.time() if start is None else start  # wall clock: across processes
        self.last = self.start
        self.phases: list[tuple[str, float]] = []  # (name, seconds), in order

    def mark(self, name: str) -> None:
        now = time.time()
        self.phases.append((name, now - self.last))
        self.last = now

    def as_dict(self) -> dict:
        return dict(start=self.start, phases=[[n, round(s, 3)] for n, s in self.phases])


def critical_path(t0: float, core: dict, ready: float) -> list[tuple[str, float]]:
    """The front end's start (t0) to ready: its own part, the core's phases, the handshake."""
    core_end = core["start"] + sum(s for _, s in core["phases"])
    return ([("front end", core["start"] - t0)] + [tuple(p) for p in core["phases"]]
            + [("handshake", ready - core_end)])


def describe(path: list[tuple[str, float]], ranks: dict) -> str:
    """'started in 7.9 s: front end 0.31, ...; rank 1: ...' (ranks: the other ranks' phases)."""
    def fmt(phases):
        return ", ".join(f"{n} {s:.2f}" for n, s in phases)
    text = f"started in {sum(s for _, s in path):.2f} s: {fmt(path)}"
    return text + "".join(f"; rank {r}: {fmt(p)}" for r, p in sorted(ranks.items()))


def cache_dir() -> str:
    return os.environ.get("LONGSERVE_CACHE", os.path.expanduser("~/.cache/longserve"))


def use_kernel_cache() -> None:
    """Triton's compiled kernels under LONGSERVE_CACHE (one folder per Triton and torch version), unless
    the user chose TRITON_CACHE_DIR; set before Triton is imported, inherited by child processes."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        versions = f"triton-{version('triton')}-torch-{version('torch')}"
    except PackageNotFoundError:
        return  # no Triton: no kernels to cache
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(cache_dir(), "kernels", versions))
