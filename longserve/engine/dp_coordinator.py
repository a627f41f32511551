"""Data parallelism in the front end: which engine core takes a request, and expert models' waves
(docs/architecture.md, 'Data parallelism, experts, ...': the balancing rule)."""
from __future__ import annotations

from longserve.engine.messages import SchedulerStats


class DPCoordinator:
    def __init__(self, num_cores: int, lockstep: bool, front_end: int = 0, num_front_ends: int = 1):
        self.stats = [SchedulerStats() for _ in range(num_cores)]
        self.num_sent = [0] * num_cores  # requests this front end sent each core, ever
        self.front_end = front_end  # which of the cores' per-front-end counts is ours
        self.num_front_ends = num_front_ends
        self.dead: set[int] = set()
        self.lockstep = lockstep
        self.wave, self.wave_running = 0, False

    @property
    def num_cores(self) -> int:
        return len(self.stats)

    def in_flight(self, core: int) -> int:
        """Requests sent to `core` that it had not taken at its last report."""
        taken = self.stats[core].num_added
        return self.num_sent[core] - (taken[self.front_end] if self.front_end < len(taken) else 0)

    def live(self) -> list[int]:
        return [i for i in range(self.num_cores) if i not in self.dead]

    def choose(self, pinned: int | None) -> int:
        if pinned is not None:
            return pinned
        live = self.live()
        load = {i: self.stats[i].num_waiting + self.stats[i].num_running
                + self.num_front_ends * self.in_flight(i) for i in live}
        return min(live, key=lambda i: (load[i], (i - self.front_end) % self.num_cores))

    def on_send(self, core: int) -> int | None:
        """A request goes to `core`: the wave to announce to every core, if they are idle."""
        self.num_sent[core] += 1
        if not self.lockstep or self.wave_running:
            return None
        self.wave_running = True
        return self.wave

    def on_stats(self, core: int, stats: SchedulerStats) -> None:
        self.stats[core] = stats

    def on_wave_started(self, wave: int) -> int | None:
        """A core began `wave` by itself: the wave to announce to the others, if news to us."""
        if wave < self.wave or (wave == self.wave and self.wave_running):
            return None
        self.wave, self.wave_running = wave, True
        return wave

    def on_wave_finished(self, wave: int) -> None:
        if wave >= self.wave:
            self.wave, self.wave_running = wave + 1, False

    # what /metrics and admission read, over every live core
    def total(self, name: str) -> int:
        return sum(getattr(self.stats[i], name) for i in self.live())

    def num_waiting(self) -> int:
        """Waiting in the live cores as last reported, plus this front end's requests not taken by then."""
        return self.total("num_waiting") + sum(self.in_flight(i) for i in self.live())

    def kv_usage(self) -> float:
        live = [self.stats[i] for i in self.live()] or self.stats
        return 1.0 - sum(s.num_free_blocks for s in live) / sum(s.num_blocks for s in live)
