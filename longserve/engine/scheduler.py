"""Continuous batching with chunked prefill and preemption by recompute (the last admitted first);
a request that needs prompt logprobs recomputes its prompt. Liveness, placeholders and forks:
docs/architecture.md, 'Bad input and liveness', 'Asynchronous scheduling', 'Several choices'."""
from __future__ import annotations

from collections import deque

from longserve.config import SchedulerConfig
from longserve.engine.kv_cache_manager import KVCacheManager
from longserve.engine.request import Request, RequestStatus
from longserve.step_plan import PLACEHOLDER, DecodeRows, ScheduledRequest, SchedulerOutput


def check_request_fits(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int,
                       num_blocks: int, tokens_per_block: int) -> None:
    """The door rule: refuse a request that could not run even alone in the pool at its longest."""
    longest = min(num_prompt_tokens + (max_model_len if max_tokens is None else max_tokens), max_model_len)
    need = -(-(longest - 1) // tokens_per_block)  # the last sampled token is never cached
    if need > num_blocks:
        raise ValueError(
            f"the request needs {need} KV blocks ({num_prompt_tokens} prompt tokens + up to "
            f"{longest - num_prompt_tokens} output tokens), the cache has {num_blocks}; "
            "lower max_tokens, shorten the prompt or give the KV cache more memory")


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager, connector=None):
        self.config = config
        self.kv = kv_manager
        self.connector = connector  # scheduler side of a KV connector (kv_transfer/base.py)
        self.loading: dict[str, Request] = {}  # waiting for their KV from outside
        self.held: dict[str, Request] = {}  # finished; a transfer may still read their blocks
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._num_blocks_sent: dict[str, int] = {}  # blocks the workers already know of
        self._finished_ids: list[str] = []
        self._finished_in_schedule: list[Request] = []  # outgrew the pool (check_fits); unforked choices

    def check_fits(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        check_request_fits(num_prompt_tokens, max_tokens, self.config.max_model_len,
                           self.kv.num_blocks, self.kv.tokens_per_block)

    def add_request(self, request: Request) -> None:
        for req in [request] + request.children:  # children: parked, found by id, in no queue
            self.requests[req.request_id] = req
            p = req.sampling_params  # what _take_token checks before a full stop check
            req.stop_token_set = frozenset(p.stop_token_ids or ()).union(
                () if p.ignore_eos else req.eos_token_ids)
            req.stop_length = min(self.config.max_model_len - len(req.prompt_token_ids),
                                  p.max_tokens if p.max_tokens is not None else 1 << 62)
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def has_kv_transfers(self) -> bool:
        """Blocks held for a transfer or loads in flight: the workers must keep stepping."""
        return bool(self.loading or self.held or (self.connector and self.connector.has_pending()))

    def schedule(self) -> SchedulerOutput:
        plan: list[tuple[Request, int]] = []
        budget = self._schedule_running(plan, self.config.max_num_batched_tokens)
        self._schedule_waiting(plan, budget)
        out = SchedulerOutput(finished_req_ids=self._finished_ids,
                              new_block_ids=self.kv.drain_newly_allocated())
        self._finished_ids = []
        out.decodes, rest = self._advance_decodes(plan)
        decodes, chunks = [], []  # decodes first, then chunks (each in plan order)
        for req, n in rest:
            (decodes if n == 1 and req.num_computed_tokens > 0 else chunks).append((req, n))
        out.requests = [self._describe_and_advance(req, n) for req, n in decodes + chunks]
        if self.connector is not None:
            out.kv_connector_metadata = meta = self.connector.build_connector_meta(out)
            if meta is not None and meta.filled_block_ids:  # the connector initialises these itself
                filled = set(meta.filled_block_ids)
                out.new_block_ids = [b for b in out.new_block_ids if b not in filled]
        return out

    def _fork(self, parent: Request) -> None:
        """The parent's prompt is planned to its end: its other choices join the running list, sharing
        its full prompt blocks; each recomputes the last block in its own (architecture: 'Several choices')."""
        shared = parent.block_ids[:(parent.num_prompt_tokens - 1) // self.kv.tokens_per_block]
        for child in [c for c in parent.children if not c.is_finished]:  # (aborted while parked)
            child.block_ids = self.kv.share(shared)
            child.num_computed_tokens = len(shared) * self.kv.tokens_per_block
            child.status = RequestStatus.RUNNING
            self.running.append(child)
        parent.children = []

    def _end_children(self, parent: Request) -> None:
        """A parent that ends before its prompt is done takes its unforked choices with it."""
        for child in [c for c in parent.children if not c.is_finished]:
            child.error = parent.error
            self.finish_request(child.request_id, parent.finish_reason)
            self._finished_in_schedule.append(child)
        parent.children = []

    def _chunk_size(self, req: Request, budget: int) -> int:
        placeholders, num_output = req.num_output_placeholders, len(req.output_token_ids)
        total = len(req.prompt_token_ids) + num_output + placeholders
        if placeholders:  # its in-flight tokens may reach a limit: wait for them
            max_tokens = req.sampling_params.max_tokens
            if ((max_tokens is not None and num_output + placeholders >= max_tokens)
                    or total >= self.config.max_model_len):
                return 0
        remaining = total - req.num_computed_tokens
        if remaining > budget and not self.config.enable_chunked_prefill:
            return 0
        cap = self.config.long_prefill_token_threshold if self.config.enable_chunked_prefill else 0
        return min(remaining, budget, cap or budget)

    def _schedule_running(self, plan: list, budget: int) -> int:
        i, running = 0, self.running
        while i < len(running) and budget > 0:
            req = running[i]
            n = self._chunk_size(req, budget)
            if n == 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, n):
                victim = self.running[-1]
                if victim is req and i == 0:  # alone, and the whole pool cannot hold it
                    self._finish_outgrown(req)
                    break
                self._preempt(victim)
                if victim is req:
                    break
            else:
                plan.append((req, n))
                budget -= n
                i += 1
        return budget

    def _preempt(self, req: Request) -> None:
        # The victim is the last running request: never one already planned this step.
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        if self._num_blocks_sent.pop(req.request_id, None) is not None:
            self._finished_ids.append(req.request_id)  # the workers drop its state
        self.waiting.appendleft(req)

    def _schedule_waiting(self, plan: list, budget: int) -> None:
        # running requests plus the choices they will fork, counted once (not per arrival)
        num_seqs = len(self.running) + sum(len(r.children) for r in self.running)
        while self.waiting and budget > 0:
            req = self.waiting[0]
            if (num_seqs + 1 + len(req.children) > self.config.max_num_seqs
                    or req.num_steps_in_flight):  # (preempted, a step in flight: wait for its result)
                break
            computed_blocks, num_computed, external, load_async = [], 0, 0, False
            if not req.needs_prompt_logprobs:  # those recompute: every prompt row is scored
                computed_blocks, num_computed = self.kv.get_computed_blocks(req)
                external, load_async = (0, False) if self.connector is None else \
                    self.connector.get_num_new_matched_tokens(req, num_computed)
            # an asynchronous load: blocks now, tokens when the workers say the load is done
            req.num_computed_tokens = num_computed + (0 if load_async else external)
            n = external if load_async else self._chunk_size(req, budget)
            if n == 0 or not self.kv.allocate_slots(req, n, computed_blocks):
                req.num_computed_tokens = 0
                if n and not self.running and not load_async:
                    self._finish_outgrown(req)  # the whole pool is free and still too small
                    continue
                break
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, req.block_ids, external)
            self.kv.num_cached_tokens_hit += num_computed
            self.waiting.popleft()
            if load_async:
                req.status, req.num_external_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, external
                self.loading[req.request_id] = req
                continue
            self.kv.num_cached_tokens_queried += req.num_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_seqs += 1 + len(req.children)
            plan.append((req, n))
            budget -= n

    def _finish_outgrown(self, req: Request) -> None:
        req.finish_reason = "length"
        self.finish_request(req.request_id)
        self._finished_in_schedule.append(req)

    def _advance_decodes(self, plan: list[tuple[Request, int]]) -> tuple[DecodeRows, list]:
        """The plan's plain decodes (known to the workers, one sampled output token each) as
        columns, advanced, and the rest of the plan; each number read once (the usual step)."""
        rows, rest, sent = DecodeRows(), [], self._num_blocks_sent
        ids, computed, tokens, offsets = rows.req_ids, rows.num_computed, rows.token_ids, rows.seed_offsets
        for req, n in plan:
            rid, start, num_prompt = req.request_id, req.num_computed_tokens, len(req.prompt_token_ids)
            num_known = num_prompt + len(req.output_token_ids)
            have = sent.get(rid)
            if (n != 1 or have is None or start < num_prompt
                    or start + 1 != num_known + req.num_output_placeholders):
                rest.append((req, n))
                continue
            blocks = req.block_ids
            if have != len(blocks):
                rows.new_blocks[len(ids)] = blocks[have:]
                sent[rid] = len(blocks)
            ids.append(rid)
            computed.append(start)
            tokens.append(req.output_token_ids[start - num_prompt] if start < num_known else PLACEHOLDER)
            offsets.append(start + 1 - num_prompt)
            req.num_computed_tokens = start + 1
            req.num_steps_in_flight += 1
            req.num_output_placeholders += 1
        return rows, rest

    def _describe_and_advance(self, req: Request, n: int) -> ScheduledRequest:
        """The request's share of the plan; then its chunk counts as computed (a sampling
        chunk leaves a placeholder). Runs for every planned request: each number read once."""
        start, total = req.num_computed_tokens, req.num_tokens + req.num_output_placeholders
        end = start + n
        sent = self._num_blocks_sent.get(req.request_id)
        self._num_blocks_sent[req.request_id] = len(req.block_ids)
        targets, row = self._prompt_logprob_targets(req, start, n)
        num_prompt = len(req.prompt_token_ids)
        sr = ScheduledRequest(
            req.request_id, req.scheduled_token_ids(start, end), start,
            list(req.block_ids if sent is None else req.block_ids[sent:]),
            new=sent is None, sample=end == total,
            sampling_params=req.sampling_params if sent is None else None,
            seed_offset=total - num_prompt,
            resumed_from_preemption=sent is None and req.num_preemptions > 0,
            prompt_logprob_targets=targets, prompt_logprob_row=row)
        if start < num_prompt:
            self.num_prompt_tokens_computed += min(num_prompt - start, n)
        req.num_computed_tokens = end
        req.num_steps_in_flight += 1
        if end == total:
            req.num_output_placeholders += 1
        if req.children and end >= num_prompt:
            self._fork(req)
        return sr

    @staticmethod
    def _prompt_logprob_targets(req: Request, start: int, n: int) -> tuple[list[int] | None, int]:
        """Prompt tokens this chunk [start, start + n) scores and the chunk row scoring the first:
        position t's logprob comes from row t - 1; positions 1 .. collected are already done."""
        if not req.needs_prompt_logprobs:
            return None, 0
        first = max(start + 1, len(req.prompt_logprobs) + 1)
        last = min(start + n, req.num_prompt_tokens - 1)
        if first > last:
            return None, 0
        return req.prompt_token_ids[first:last + 1], first - 1 - start

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           logprobs: dict[str, dict[int, float]] | None = None,
                           prompt_logprobs: dict[str, list[dict[int, float]]] | None = None,
                           ) -> list[Request]:
        """Apply a step's results; returns the finished requests. A request preempted while the step ran
        still gets its token (it is recomputed with it)."""
        finished, self._finished_in_schedule = self._finished_in_schedule, []
        for rid in out.decodes.req_ids:  # (each sampled one token)
            req = self.requests.get(rid)
            if req is not None:  # (else finished or aborted meanwhile)
                req.num_steps_in_flight -= 1
                self._take_token(req, sampled.get(rid), logprobs, finished)
        for sr in out.requests:
            req = self.requests.get(sr.req_id)
            if req is None:
                continue  # finished or aborted meanwhile
            req.num_steps_in_flight -= 1
            if prompt_logprobs and sr.req_id in prompt_logprobs:
                self._add_prompt_logprobs(req, sr, prompt_logprobs[sr.req_id])
            if sr.sample:
                self._take_token(req, sampled.get(sr.req_id), logprobs, finished)
            elif req.status == RequestStatus.RUNNING:
                self.kv.cache_full_blocks(req)
        for req in finished:
            if not req.is_finished:
                self.finish_request(req.request_id, req.finish_reason)
        return finished

    def _take_token(self, req: Request, token: int | None, logprobs, finished: list) -> None:
        """A sampling chunk's result: its token (None: the plan was applied without results)
        replaces the placeholder; full blocks enter the prefix cache; a stop ends it (the full
        check only where a stop is possible: most decodes take none)."""
        req.num_output_placeholders -= 1
        out_ids = req.output_token_ids
        if token is not None and req.sampling_params.max_tokens != 0:
            out_ids.append(token)
            if logprobs and req.request_id in logprobs:
                req.logprobs.append(logprobs[req.request_id])
        if (req.status is RequestStatus.RUNNING
                and req.num_computed_tokens >= (req.num_cached_blocks + 1) * self.kv.tokens_per_block):
            self.kv.cache_full_blocks(req)  # (a block filled since the last call)
        if token is not None and (token in req.stop_token_set or len(out_ids) >= req.stop_length
                                  or req.grammar is not None) and self._check_stop(req):
            finished.append(req)

    @staticmethod
    def _add_prompt_logprobs(req: Request, sr: ScheduledRequest, entries: list) -> None:
        """Entries for prompt positions first, first + 1, ...; keep only the ones not collected
        (a request recomputed after preemption may have been planned before they arrived)."""
        first = sr.num_computed_tokens + sr.prompt_logprob_row + 1
        have = len(req.prompt_logprobs)
        if first <= have + 1:
            req.prompt_logprobs.extend(entries[have + 1 - first:])

    def _check_stop(self, req: Request) -> bool:
        params = req.sampling_params
        if params.max_tokens == 0:  # scored only: it ends after its prefill, without a token
            req.finish_reason = "length"
            return True
        token = req.output_token_ids[-1]
        n_out = len(req.output_token_ids)
        if (g := req.grammar) is not None:  # the mask thread accepts the token before the next mask
            g.pending.append(token)
            if g.rejected is not None:  # the previous token (the mask should have forbidden it)
                req.finish_reason, req.error = "error", f"the grammar rejected token {g.rejected}"
                return True
            if token in g.stop_ids:  # the mask allows a stop token only where the grammar ends
                req.finish_reason, req.stop_reason = "stop", None
                return True
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                req.finish_reason, req.stop_reason = "stop", None
                return True
            if token in params.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", token
                return True
        if ((params.max_tokens is not None and n_out >= params.max_tokens)
                or len(req.prompt_token_ids) + n_out >= self.config.max_model_len):
            req.finish_reason = "length"
            return True
        return False

    def finish_request(self, req_id: str, reason: str | None = "abort") -> None:
        """Finish (or abort) a request wherever it is and return its blocks to the pool (or
        keep them for a transfer that may read them: the connector's `request_finished`)."""
        req = self.requests.pop(req_id, None)
        if req is None:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = req.finish_reason or reason
        self._end_children(req)
        if self._num_blocks_sent.pop(req_id, None) is not None:
            self._finished_ids.append(req_id)
        if req_id in self.loading:
            return  # a load is writing its blocks: they are freed when it reports done
        if self.connector is not None:
            delay, req.kv_transfer_params = self.connector.request_finished(req, req.block_ids)
            if delay:
                self.held[req_id] = req
                return
        self.kv.free(req)

    def update_kv_transfers(self, kv_out) -> list[Request]:
        """Apply the workers' united connector report; returns requests that failed for good."""
        for req_id in kv_out.finished_sending:
            req = self.held.pop(req_id, None)
            if req is not None:
                self.kv.free(req)
        failed = []
        for req_id in kv_out.finished_recving:
            req = self.loading.pop(req_id, None)
            if req is None:
                continue
            if req.status == RequestStatus.FINISHED:  # aborted while loading
                self.kv.free(req)
            elif kv_out.invalid_block_ids.intersection(req.block_ids):
                failed += self._load_failed(req)
            else:  # the loaded tokens are computed; the rest is computed as usual
                req.num_computed_tokens += req.num_external_tokens
                req.status = RequestStatus.RUNNING
                self.running.append(req)
        if self.connector is not None:
            self.connector.update_connector_output(kv_out)
        return failed

    def _load_failed(self, req: Request) -> list[Request]:
        """Never decode from partly received KV: recompute the prompt, or fail the request."""
        self.kv.free(req)
        req.num_computed_tokens = 0
        if getattr(self.connector, "failure_policy", "recompute") == "fail":
            req.status = RequestStatus.FINISHED
            req.finish_reason, req.error = "error", f"loading the KV of request {req.request_id} failed"
            self.requests.pop(req.request_id, None)
            self._end_children(req)
            return [req]
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        return []
