"""The step plan: what the scheduler decides for one step and every worker receives, as plain,
picklable data; it lives below the engine and the workers so that no worker imports the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from longserve.sampling_params import SamplingParams

# a plan's token not read back yet (asynchronous scheduling), filled in on the device (model_runner)
PLACEHOLDER = -1


@dataclass
class ScheduledRequest:
    """One request's share of a step, as every worker receives it."""
    req_id: str
    token_ids: list[int]  # tokens at positions num_computed_tokens ... (PLACEHOLDER: see above)
    num_computed_tokens: int
    block_ids: list[int]  # the request's whole block list when `new`, else blocks added since
    new: bool  # the workers have no state for it yet (first step, or resumed after preemption)
    sample: bool  # the chunk reaches the end of the known tokens: sample the next one
    sampling_params: SamplingParams | None = None  # with `new` only
    seed_offset: int = 0  # tokens sampled so far (keeps seeded sampling reproducible on resume)
    resumed_from_preemption: bool = False  # `new` again after a preemption
    # Prompt logprobs wanted from this chunk: chunk row `prompt_logprob_row + i` scores prompt
    # token `prompt_logprob_targets[i]` (the token that follows it). None: none wanted.
    prompt_logprob_targets: list[int] | None = None
    prompt_logprob_row: int = 0


@dataclass
class DecodeRows:
    """The step's plain decodes as columns: requests the workers already know, one token each,
    sampled, no prompt logprobs (a steady decode step is only these). Row i decodes the token
    at position num_computed[i]; its new blocks are in new_blocks[i] (absent: none)."""
    req_ids: list[str] = field(default_factory=list)
    num_computed: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # PLACEHOLDER while on the device
    seed_offsets: list[int] = field(default_factory=list)  # tokens sampled before this one
    new_blocks: dict[int, list[int]] = field(default_factory=dict)


@dataclass
class SchedulerOutput:
    # the step's requests in order: the plain decodes (as columns), then the others (decodes
    # the workers do not know yet or that score prompt tokens, then prefill chunks)
    requests: list[ScheduledRequest] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # workers drop their state
    new_block_ids: list[int] = field(default_factory=list)  # to be zeroed before use
    # the KV connector's plan (loads, saves, holds); its filled_block_ids are not in new_block_ids
    kv_connector_metadata: object | None = None
    decodes: DecodeRows = field(default_factory=DecodeRows)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes.req_ids) + sum(len(r.token_ids) for r in self.requests)

    def sampling_req_ids(self) -> list[str]:
        """The requests that sample, in the order of the step's sampled ids."""
        return self.decodes.req_ids + [r.req_id for r in self.requests if r.sample]

    def all_requests(self) -> list[ScheduledRequest]:
        """Every request as a ScheduledRequest, decode rows too (for KV connectors and tests)."""
        d = self.decodes
        return [ScheduledRequest(rid, [t], c, d.new_blocks.get(i, []), False, True, seed_offset=o)
                for i, (rid, c, t, o) in enumerate(zip(d.req_ids, d.num_computed, d.token_ids,
                                                       d.seed_offsets))] + self.requests

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.decodes.req_ids
