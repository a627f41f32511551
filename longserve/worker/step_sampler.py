"""A step's sampling for the model runner (StepSampler: the first PCP rank's TP group samples; ids
reach the host a step later) and what a step returns (ModelRunnerOutput)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longserve.kv_transfer.utils import KVConnectorOutput
from longserve.step_plan import ScheduledRequest, SchedulerOutput
from longserve.worker.sampler import Sampler, apply_token_bitmask, prompt_logprobs


class SampledTokens:
    """A step's sampled ids on their way to the host: a non-blocking copy into pinned memory,
    queued behind the step's kernels; tolist() waits for that copy alone."""

    def __init__(self, tokens: torch.Tensor):
        self.event = None
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, dict[int, float]]
    kv_connector_output: KVConnectorOutput | None = None
    prompt_logprobs: dict[str, list[tuple[int, dict[int, float]]]] = field(default_factory=dict)
    pending: tuple[list[str], SampledTokens] | None = None  # (request ids, ids on their way)
    deferred: tuple | None = None  # (sampling requests, logits): waits for a grammar bitmask

    def resolve(self) -> ModelRunnerOutput:
        """Wait for the sampled ids and fill `sampled`."""
        if self.pending is not None:
            req_ids, tokens = self.pending
            self.sampled, self.pending = dict(zip(req_ids, tokens.tolist())), None
        return self


class StepSampler:
    def __init__(self, model, ps, requests: dict, config, device: torch.device):
        self.model, self.ps, self.device = model, ps, device
        self.requests = requests  # the runner's RunnerRequest of each request id
        self.sampler = Sampler(config.seed, device)
        self.async_scheduling = config.scheduler.async_scheduling
        # asynchronous scheduling: the last step's sampled ids on the device, the row of each
        # request in them and the rows' request ids (ModelRunner.fill_placeholders reads them)
        self.last_sampled: tuple[torch.Tensor, dict[str, int], list[str]] | None = None
        self.batch: tuple | None = None  # batch_params' rows; None when the requests change
        # prompt logprobs take logits of this many rows at a time: [rows, vocab] stays ~64 MB
        self.prompt_logprob_rows_per_slice = max(1, (1 << 24) // config.model.vocab_size)

    def sample(self, out: SchedulerOutput, hidden, inp) -> ModelRunnerOutput | None:
        """Sample on the first rank of the model group (the first PCP rank's first TP rank); ids stay
        pending until resolve(), a structured step's logits wait in `output.deferred`."""
        sampling = (out.sampling_req_ids(),
                    out.decodes.seed_offsets + [r.seed_offset for r in out.requests if r.sample])
        output, logits = None, None
        _, _, _, structured, _, greedy = self.batch_params(sampling[0])
        if self.ps.pcp.rank_in_group == 0:  # the first PCP rank's TP group takes the logits
            prompt_lps = {}
            if inp.prompt_logprob_rows is not None:  # every TP rank joins the logits gathers
                prompt_lps = self.prompt_logprobs(out.requests, hidden, inp.prompt_logprob_rows)
            rows = hidden[inp.logits_indices]  # plain greedy rows: their argmax ids instead
            logits = self.model.lm_head.greedy(rows) if greedy else self.model.compute_logits(rows)
            if self.ps.tp.is_first_rank:
                output = ModelRunnerOutput({}, {}, prompt_logprobs=prompt_lps)
        if logits is not None and structured:
            output.deferred = (sampling, logits)
        else:
            self._finish(output, sampling, logits)
        return output

    def sample_deferred(self, output: ModelRunnerOutput, bitmask: tuple) -> None:
        """bitmask: (int32 [R, ceil(V / 32)] on the host, the R sampling rows it masks)."""
        (sampling, logits), output.deferred = output.deferred, None
        apply_token_bitmask(logits, *bitmask)
        self._finish(output, sampling, logits)

    def batch_params(self, ids: list[str]) -> tuple:
        """(params, logit biases, row of each id, any structured, any logprobs, plain greedy: argmax and
        nothing else) of the sampling rows, kept while the rows stay the same (a run of decodes)."""
        if self.batch is None or self.batch[0] != ids:
            params = [self.requests[i].sampling_params for i in ids]
            biases = [self.requests[i].logit_bias for i in ids]
            structured = any(p.structured_outputs for p in params)
            logprobs = any(p.logprobs is not None for p in params)
            greedy = (not structured and not logprobs and all(b is None for b in biases)
                      and all(p.greedy for p in params))
            self.batch = (ids, params, biases, {rid: i for i, rid in enumerate(ids)},
                          structured, logprobs, greedy)
        return self.batch[1:]

    def _finish(self, output, sampling, logits) -> None:
        """logits: the rows' logits on the first TP rank (plain greedy rows: their argmax ids, on
        every TP rank of the first PCP rank)."""
        ids, seed_offsets = sampling
        tokens = None
        params, biases, row_of, _, any_logprobs, greedy = self.batch_params(ids)
        if logits is not None:
            tokens = logits if greedy else self.sampler(logits, params, seed_offsets, biases)
        if output is not None and tokens is not None:
            output.pending = (ids, SampledTokens(tokens))
            if any_logprobs:  # these need the ids now
                lps = self.sampler.logprobs(logits, params, list(output.resolve().sampled.values()))
                output.logprobs = {i: lp for i, lp in zip(ids, lps) if lp is not None}
        if self.async_scheduling:
            everywhere = greedy and self.ps.pcp.world_size == 1  # the model group is the TP group
            if ids and self.ps.model.world_size > 1 and not everywhere:  # every rank embeds them
                if tokens is None:
                    tokens = torch.empty(len(ids), dtype=torch.int64, device=self.device)
                self.ps.model.broadcast(tokens)
            self.last_sampled = (tokens, row_of, ids) if ids else None

    def prompt_logprobs(self, reqs: list[ScheduledRequest], hidden,
                        rows) -> dict[str, list[dict[int, float]]]:
        """Score the step's prompt rows a slice at a time (logits [slice, vocab], not [T, vocab])."""
        asking = [r for r in reqs if r.prompt_logprob_targets]
        targets = [t for r in asking for t in r.prompt_logprob_targets]
        ks = [self.requests[r.req_id].sampling_params.prompt_logprobs
              for r in asking for _ in r.prompt_logprob_targets]
        rows = torch.from_numpy(rows).to(hidden.device)
        entries, step = [], self.prompt_logprob_rows_per_slice
        for a in range(0, len(targets), step):
            logits = self.model.compute_logits(hidden[rows[a:a + step]])
            if logits is not None:
                entries += prompt_logprobs(logits, targets[a:a + step], ks[a:a + step])
        if not entries:  # not the first TP rank
            return {}
        out, at = {}, 0
        for r in asking:
            n = len(r.prompt_logprob_targets)
            out[r.req_id], at = entries[at:at + n], at + n
        return out
