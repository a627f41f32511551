"""Data parallelism in the front end: which engine core takes a request, and the waves.

Each core reports its load with every step (`SchedulerStats`); a new request goes to the
live core with the lowest `4 x waiting + running` (vLLM's rule; requests sent since that
core's last report count as waiting), unless it pins a rank. Dense models' cores step on
their own. Expert models' cores step in lockstep waves (engine/core_proc.py): when a request
goes out while the cores are idle, every core is told to start the wave; a core that started
a wave by itself (its view was newer than ours) says so and the others are told the same."""
from __future__ import annotations

from longserve.engine.messages import SchedulerStats


class DPCoordinator:
    def __init__(self, num_cores: int, lockstep: bool):
        self.stats = [SchedulerStats() for _ in range(num_cores)]
        self.sent = [0] * num_cores  # requests sent since the core's last report
        self.dead: set[int] = set()
        self.lockstep = lockstep
        self.wave, self.wave_running = 0, False

    @property
    def num_cores(self) -> int:
        return len(self.stats)

    def choose(self, pinned: int | None) -> int:
        if pinned is not None:
            return pinned
        load = [4 * (s.num_waiting + n) + s.num_running for s, n in zip(self.stats, self.sent)]
        live = [i for i in range(self.num_cores) if i not in self.dead]
        return min(live, key=lambda i: (load[i], self.stats[i].kv_usage, i))

    def on_send(self, core: int) -> int | None:
        """A request goes to `core`: the wave to announce to every core, if they are idle."""
        self.sent[core] += 1
        if not self.lockstep or self.wave_running:
            return None
        self.wave_running = True
        return self.wave

    def on_stats(self, core: int, stats: SchedulerStats) -> None:
        self.stats[core], self.sent[core] = stats, 0

    def on_wave_started(self, wave: int) -> int | None:
        """A core began `wave` by itself: the wave to announce to the others, if news to us."""
        if wave < self.wave or (wave == self.wave and self.wave_running):
            return None
        self.wave, self.wave_running = wave, True
        return wave

    def on_wave_finished(self, wave: int) -> None:
        if wave >= self.wave:
            self.wave, self.wave_running = wave + 1, False

    # ---- what /metrics and admission read, over every live core -------------------------
    def total(self, name: str) -> int:
        return sum(getattr(s, name) for i, s in enumerate(self.stats) if i not in self.dead)

    def kv_usage(self) -> float:
        live = [s for i, s in enumerate(self.stats) if i not in self.dead] or self.stats
        return 1.0 - sum(s.num_free_blocks for s in live) / sum(s.num_blocks for s in live)
