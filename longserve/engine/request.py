"""Request state as the scheduler sees it, and what `LLM.generate` returns."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from longserve.sampling_params import SamplingParams
from longserve.step_plan import PLACEHOLDER


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # (the token's rank, {token: logprob, top-k...}) for prompt positions 1, 2, ... so far
    prompt_logprobs: list[tuple[int, dict[int, float]]] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0  # leading blocks already registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # of the full blocks (prefix caching)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    kv_transfer_params: dict | None = None  # in: from the client (a consumer loads); out: a producer's
    num_external_tokens: int = 0  # tokens an asynchronous load brings
    error: str | None = None
    # asynchronous scheduling: sampled tokens not read back yet (PLACEHOLDER), steps not applied
    num_output_placeholders: int = 0
    num_steps_in_flight: int = 0
    # choices 1..n-1 of an n > 1 request: parked until its prompt is planned (Scheduler._fork)
    children: list[Request] = field(default_factory=list)
    grammar: object | None = None  # structured outputs: its GrammarState (structured_output.py)
    # tokens that may stop it, and its output length at the latest (Scheduler.add_request; 0:
    # not set, or no output: every token takes the full stop check)
    stop_token_set: frozenset = frozenset()
    stop_length: int = 0

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """(prompt + output tokens)[start:end] without building the whole list (a decode needs one)."""
        n_prompt = len(self.prompt_token_ids)
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def scheduled_token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) for the plan: PLACEHOLDER where the token is still on the device."""
        k = max(start, min(end, self.num_tokens))  # the known ones end here
        return self.token_ids_slice(start, k) + [PLACEHOLDER] * (end - k)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and some are still missing (they need the prompt's hidden
        states, so such a request recomputes its prompt instead of reading the prefix cache)."""
        return (self.sampling_params.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    kv_transfer_params: dict | None = None  # what a producer returns for the consumer
    error: str | None = None
    # one entry per prompt token, the first None (as vLLM); None when not asked
    prompt_logprobs: list[dict[int, float] | None] | None = None
