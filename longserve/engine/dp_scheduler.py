"""Data parallelism in the engine: one Scheduler and one KV cache manager per DP rank.

Each DP rank is a model replica with its own KV cache (its own TP x PCP ranks below it),
so each gets its own scheduler. New requests go to the rank with the lowest
`4 x waiting + running` (vLLM's balancing rule), unless the request pins a rank. A step
is the list of every rank's plan (`DPStepPlan`); the results come back keyed by request.
`DPScheduler` offers the `Scheduler` interface the engine uses, so the engine loop is
the same for one rank and for many.
"""
from __future__ import annotations

from collections import ChainMap

from longserve.config import SchedulerConfig
from longserve.engine.kv_cache_manager import KVCacheManager
from longserve.engine.request import Request
from longserve.engine.scheduler import Scheduler
from longserve.step_plan import DPStepPlan


class DPScheduler:
    def __init__(self, config: SchedulerConfig, kv_managers: list[KVCacheManager], lockstep: bool):
        self.schedulers = [Scheduler(config, kv) for kv in kv_managers]
        self.kv_managers = kv_managers
        self.lockstep = lockstep
        self.requests = ChainMap(*(s.requests for s in self.schedulers))  # a live view
        self._rank_of: dict[str, int] = {}

    @property
    def dp_size(self) -> int:
        return len(self.schedulers)

    def choose_rank(self, request: Request) -> int:
        pinned = request.data_parallel_rank
        if pinned is not None:
            return pinned
        load = [4 * len(s.waiting) + len(s.running) for s in self.schedulers]
        return load.index(min(load))

    def add_request(self, request: Request) -> None:
        rank = self.choose_rank(request)
        self._rank_of[request.request_id] = rank
        self.schedulers[rank].add_request(request)

    def has_unfinished(self) -> bool:
        return any(s.has_unfinished() for s in self.schedulers)

    def has_kv_transfers(self) -> bool:
        return False  # KV transfer and offload run with one DP rank (config check)

    @property
    def num_prompt_tokens_computed(self) -> int:
        return sum(s.num_prompt_tokens_computed for s in self.schedulers)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        self.schedulers[0].check_fits(num_prompt_tokens, max_tokens)  # every rank's pool is alike

    def schedule(self) -> DPStepPlan:
        return DPStepPlan([s.schedule() for s in self.schedulers], self.lockstep)

    def update_from_output(self, out: DPStepPlan, sampled: dict[str, int],
                           logprobs: dict[str, dict[int, float]] | None = None,
                           prompt_logprobs: dict[str, list[dict[int, float]]] | None = None,
                           ) -> list[Request]:
        finished = []
        for s, plan in zip(self.schedulers, out.plans):
            finished += s.update_from_output(plan, sampled, logprobs, prompt_logprobs)
        for req in finished:
            self._rank_of.pop(req.request_id, None)
        return finished

    def finish_request(self, req_id: str, reason: str | None = "abort") -> None:
        rank = self._rank_of.pop(req_id, None)
        if rank is not None:
            self.schedulers[rank].finish_request(req_id, reason)


def make_scheduler(config, num_blocks: int) -> tuple[Scheduler | DPScheduler, list[KVCacheManager]]:
    """The engine's scheduler and every DP rank's KV cache manager (the same block count on
    every rank: the workers agreed on the minimum)."""
    tokens_per_block = config.cache.block_size * config.parallel.cp_world_size
    dp = config.parallel.data_parallel_size
    kvs = [KVCacheManager(num_blocks, tokens_per_block, config.cache.enable_prefix_caching)
           for _ in range(dp)]
    if dp == 1:
        return Scheduler(config.scheduler, kvs[0]), kvs
    return DPScheduler(config.scheduler, kvs, lockstep=config.model.is_moe), kvs


def check_dp_rank(rank, dp_size: int) -> None:
    if rank is not None and (not isinstance(rank, int) or not 0 <= rank < dp_size):
        raise ValueError(f"data_parallel_rank must be an integer in [0, {dp_size}), got {rank!r}")
