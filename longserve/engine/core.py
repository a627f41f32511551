"""EngineCore: one DP rank's scheduler, KV cache manager and executor. `step()` plans, launches
and applies the previous step (docs/architecture.md, 'Asynchronous scheduling') and returns its
EngineCoreOutputs; requests arrive validated and tokenized, and text is the front end's."""
from __future__ import annotations

import time
from collections import deque

from longserve.config import EngineConfig
from longserve.engine.executor import Executor
from longserve.engine.kv_cache_manager import KVCacheManager
from longserve.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from longserve.engine.request import Request
from longserve.engine.scheduler import Scheduler
from longserve.engine.structured_output import StructuredOutputManager
from longserve.kv_transfer.base import build_scheduler_connector
from longserve.kv_transfer.p2p import host_store
from longserve.startup import Timeline
from longserve.step_plan import SchedulerOutput
from longserve.worker.launch import WorkerProcs


class EngineCore:
    def __init__(self, config: EngineConfig, engine_index: int = 0, dist_init: str | None = None,
                 timeline: Timeline | None = None, workers: WorkerProcs | None = None):
        t0 = time.perf_counter()
        self.config, self.engine_index = config, engine_index
        self.timeline = timeline or Timeline()
        # a producer's store, before the workers: they connect to it
        self.kv_store = host_store(config) if config.kv_transfer.kv_role is not None else None
        self.executor = Executor(config, dist_init, self.timeline, workers)
        self.kv = KVCacheManager(self.executor.num_blocks,
                                 config.cache.block_size * config.parallel.cp_world_size,
                                 config.cache.enable_prefix_caching)
        self.kv_connector = build_scheduler_connector(
            config, self.kv, self.executor.ready["kv_bytes_per_block"], self.kv_store)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.kv_connector)
        self.structured = StructuredOutputManager(config.model)
        self._in_flight = None  # asynchronous scheduling: (plan, PendingStep) of the last step
        self._mask = None  # the bitmask of a step with structured requests, being filled
        self._num_sent: dict[str, int] = {}  # output tokens already reported, per request
        # (tokens, seconds, seconds waited for the device) of decode-only steps (benchmarks)
        self.decode_steps: deque = deque(maxlen=100_000)
        self._waited = 0.0
        if config.device == "cuda" and self.kv_connector is None and not config.dp_lockstep:
            self._warm_up()
        self.timeline.mark("warm-up")
        self.load_s = time.perf_counter() - t0

    def _warm_up(self) -> None:
        """Run a light load's step shapes once (a lone prompt, one beside a decode, a prefix hit, the
        sampler's paths): Triton's per-specialization compiles (~0.5 s) then miss every TTFT."""
        from longserve.sampling_params import SamplingParams
        n = max(16, min(1024, self.config.scheduler.max_model_len // 2) // 16 * 16)
        params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                  SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=0, logprobs=1,
                                 max_tokens=3, ignore_eos=True)]
        # token counts that are and are not multiples of 16 (Triton specializes on both)
        rounds = [[[7] * n], [[8] * (n // 2 + 1), [7] * n + [9] * 3], [[9] * 16, [5] * 33]]
        for r, prompts in enumerate(rounds):
            for i, ids in enumerate(prompts):
                self.add_request(EngineCoreRequest(f"warm-up-{r}-{i}", ids, params[i]))
            for _ in range(2):  # their prefill, then a decode beside the next round's
                self.step()
        while self.has_work():
            self.step()
        self.kv.reset_prefix_cache()
        self.scheduler.num_prompt_tokens_computed = 0
        self.kv.num_cached_tokens_hit = self.kv.num_cached_tokens_queried = 0
        self.decode_steps.clear()

    def add_request(self, r: EngineCoreRequest) -> None:
        """One Request per choice: choice 0 computes the prompt, the others fork from it."""
        params = r.sampling_params
        reqs = [Request(cid, r.prompt_token_ids, params if params.n == 1 else params.choice(i),
                        r.eos_token_ids) for i, cid in enumerate(r.choice_ids)]
        req, req.children = reqs[0], reqs[1:]
        req.kv_transfer_params = dict(r.kv_transfer_params) if r.kv_transfer_params else None
        self._num_sent.update(dict.fromkeys(r.choice_ids, 0))
        if params.structured_outputs is not None:
            self.structured.add(req)  # joins the scheduler (choices too) once its grammar is compiled
        else:
            self.scheduler.add_request(req)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.structured.abort(request_id)
            self.scheduler.finish_request(request_id, "abort")
            self._num_sent.pop(request_id, None)

    def has_work(self) -> bool:
        """Requests to step, a step in flight, or KV transfers (held blocks go back only in a step)."""
        return (self.scheduler.has_unfinished() or self._in_flight is not None
                or self.scheduler.has_kv_transfers() or bool(self.structured.compiling))

    def step(self, lockstep: bool = False) -> EngineCoreOutputs:
        """One scheduled step; `lockstep`: expert DP ranks run a forward every step (a dummy if idle)."""
        t, self._waited = time.perf_counter(), 0.0
        failed = self._admit_compiled()
        out = self.scheduler.schedule()
        outputs = self._step(out, lockstep)
        if failed:
            outputs.add(self._outputs(SchedulerOutput(), failed))
        if out.decodes.req_ids and not out.requests:  # decode only: its period (benchmarks)
            self.decode_steps.append((out.num_tokens, time.perf_counter() - t, self._waited))
        return outputs

    def _admit_compiled(self) -> list[Request]:
        """Structured requests whose grammar is ready join the scheduler; those whose grammar
        failed to compile come back finished (waits a little when nothing else can run)."""
        idle = not self.scheduler.has_unfinished() and self._in_flight is None
        failed = []
        for req in self.structured.ready(block=idle):
            if req.grammar is None:
                failed += [req] + req.children
            else:
                self.scheduler.add_request(req)
        return failed

    def _launch(self, out):
        """Step `out` launched on every rank; its sampling waits for a bitmask where a sampling request
        has a grammar (the runner's rule, decided here before any of them can finish)."""
        reqs = self.scheduler.requests
        deferred = self.structured.in_use and any(
            getattr(reqs.get(r), "grammar", None) is not None for r in out.sampling_req_ids())
        pending = self.executor.execute_async(out)
        pending.deferred = deferred
        return pending

    def _start_mask(self, out, pending) -> None:
        """A structured step: while its forward runs, the matchers fill the bitmask on the mask thread."""
        if pending.deferred:
            self._mask = self.structured.start_bitmask(out, self.scheduler.requests)

    def _sample_masked(self, pending) -> None:
        """Its sampling, with the mask: launched after the next step was planned and before that step's
        forward (which reads these ids on the device)."""
        if self._mask is not None:
            mask, self._mask = self._mask.result(), None
            pending.sample(mask)

    def _step(self, out, lockstep: bool) -> EngineCoreOutputs:
        transfers = self.scheduler.has_kv_transfers()
        idle = out.is_empty and not out.finished_req_ids and not transfers and not lockstep
        if self.config.scheduler.async_scheduling:
            return self._step_async(out, idle)
        if idle:
            return self._outputs(out, self.scheduler.update_from_output(out, {}))
        if out.is_empty and transfers and out.kv_connector_metadata is None:
            # only polling connectors: wait for progress, no spin (a step starting a load goes now)
            self.executor.wait_for_kv_progress(0.002)
        pending = self._launch(out)
        self._start_mask(out, pending)
        self._sample_masked(pending)
        return self._apply(out, pending.result())

    def _step_async(self, out, idle: bool) -> EngineCoreOutputs:
        """Launch step N+1, then apply step N's sampled ids: the host plans N+1 while the device runs N."""
        if self._in_flight is not None:
            self._sample_masked(self._in_flight[1])
        launched = None if idle else (out, self._launch(out))
        previous, self._in_flight = self._in_flight, launched
        outputs = EngineCoreOutputs(self.engine_index) if previous is None else \
            self._apply(previous[0], self._result(previous[1]))
        if launched is not None:  # after step N is applied: its tokens advanced the matchers
            self._start_mask(*launched)
        else:  # any finished while planning
            outputs.add(self._outputs(out, self.scheduler.update_from_output(out, {})))
        return outputs

    def _result(self, pending):
        """Step N's sampled ids; the time this blocks is the device's (or a late worker's)
        share of the step: near zero when the host bounds the step."""
        t = time.perf_counter()
        result = pending.result()
        self._waited += time.perf_counter() - t
        return result

    def drain(self) -> EngineCoreOutputs:
        """Apply the step in flight, if any (an idle lockstep rank's last dummy step)."""
        if self._in_flight is not None:
            self._sample_masked(self._in_flight[1])
        previous, self._in_flight = self._in_flight, None
        return EngineCoreOutputs(self.engine_index) if previous is None else \
            self._apply(previous[0], previous[1].result())

    def _apply(self, out, result) -> EngineCoreOutputs:
        if result is None:  # a dummy step
            return self._outputs(out, self.scheduler.update_from_output(out, {}))
        kv_out = result.kv_connector_output
        failed = [] if kv_out is None else self.scheduler.update_kv_transfers(kv_out)
        finished = self.scheduler.update_from_output(out, result.sampled, result.logprobs,
                                                     result.prompt_logprobs)
        return self._outputs(out, failed + finished)

    def _outputs(self, out, finished: list[Request]) -> EngineCoreOutputs:
        """What each sampling request of the applied plan gained (a token at most: none if it was
        applied without results), then every finished request's end; plain tokens as columns."""
        msg = EngineCoreOutputs(self.engine_index)
        ids, tokens, outputs = msg.token_req_ids, msg.token_ids, msg.outputs
        requests, num_sent = self.scheduler.requests, self._num_sent
        ended = {r.request_id for r in finished}
        for req_id in out.sampling_req_ids():
            req, sent = requests.get(req_id), num_sent.get(req_id)
            if req is None or sent is None or req_id in ended:
                continue  # aborted meanwhile, or ending below
            new, params = req.output_token_ids, req.sampling_params
            if len(new) == sent + 1 and params.logprobs is None and (sent or params.prompt_logprobs is None):
                ids.append(req_id)
                tokens.append(new[sent])
                num_sent[req_id] = sent + 1
            elif len(new) > sent:
                outputs.append(self._output(req, sent, False))
        outputs += [self._output(r, num_sent[r.request_id], True)
                    for r in finished if r.request_id in num_sent]
        return msg

    def _output(self, req: Request, sent: int, finished: bool) -> EngineCoreOutput:
        params, new = req.sampling_params, req.output_token_ids[sent:]
        o = EngineCoreOutput(req.request_id, new)
        if params.logprobs is not None:
            o.new_logprobs = req.logprobs[sent:sent + len(new)]
        if params.prompt_logprobs is not None and sent == 0:
            o.prompt_logprobs = list(req.prompt_logprobs)
        if not finished:
            self._num_sent[req.request_id] = sent + len(new)
            return o
        del self._num_sent[req.request_id]
        o.finish_reason, o.stop_reason = req.finish_reason or "abort", req.stop_reason
        o.kv_transfer_params, o.error = req.kv_transfer_params, req.error
        o.num_preemptions = req.num_preemptions
        return o

    def failure_reason(self, e: BaseException) -> str:
        """Why the loop died: the executor's account (a dead or lagging rank) if it has one."""
        failure = self.executor.failure
        if failure and not str(e).startswith(failure):  # e.g. gloo's "connection reset"
            return failure
        return str(e) if failure else f"{type(e).__name__}: {e}"

    def dp_any_unfinished(self) -> bool:
        """Lockstep DP: whether any DP rank still has requests (an all-reduce over the DP ranks' cores)."""
        return self.executor.any_across_dp(self.scheduler.has_unfinished() or bool(self.structured.compiling))

    # what the front end asks
    def scheduler_stats(self) -> SchedulerStats:
        s, compiling = self.scheduler, len(self.structured.compiling)
        return SchedulerStats(len(s.running), len(s.waiting) + len(s.loading) + compiling,
                              self.kv.num_free_blocks, self.kv.num_blocks,
                              self.kv.num_cached_tokens_queried, self.kv.num_cached_tokens_hit)

    def info(self) -> dict:
        """What this core holds (the server's start-up banner, the door's pool check)."""
        return dict(engine_index=self.engine_index, num_gpu_blocks=self.kv.num_blocks,
                    tokens_per_block=self.kv.tokens_per_block, load_s=round(self.load_s, 2),
                    cudagraph_capture_s=self.executor.ready["cudagraph_capture_s"],
                    device_names=self.executor.ready["device_names"],
                    startup=dict(self.timeline.as_dict(), ranks=self.executor.ready["ranks"]))

    def stats(self) -> dict:
        """Counters of the KV cache and the connector (tests, benchmarks)."""
        s = dict(num_prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
                 num_cached_tokens_hit=self.kv.num_cached_tokens_hit,
                 num_free_blocks=self.kv.num_free_blocks, num_blocks=self.kv.num_blocks,
                 num_dbo_steps=None if self.executor.own else self.executor.driver.runner.num_dbo_steps)
        for name in ("num_loaded_tokens", "num_saved_blocks"):
            if hasattr(self.kv_connector, name):
                s[f"kv_connector_{name}"] = getattr(self.kv_connector, name)
        return s

    def decode_step_log(self, start: int = 0) -> list[tuple[int, float, float]]:
        """(tokens, seconds, seconds waited for the device) of decode-only steps from the `start`-th."""
        return list(self.decode_steps)[start:]

    def pool_state(self) -> dict:
        """Whether every KV block is back in the pool and no request is left (tests)."""
        return dict(num_free_blocks=self.kv.num_free_blocks, num_blocks=self.kv.num_blocks,
                    refs_zero=all(c == 0 for c in self.kv.ref_cnt),
                    unfinished=self.scheduler.has_unfinished())

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
        if self.kv_connector is not None and hasattr(self.kv_connector, "close"):
            self.kv_connector.close()
