"""The engine loop: validate and queue requests, schedule a step, run it, apply the results."""
from __future__ import annotations

import itertools
import time

from longserve.config import EngineConfig
from longserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from longserve.engine.dp_scheduler import check_dp_rank, make_scheduler
from longserve.engine.executor import Executor
from longserve.engine.request import CompletionOutput, Request, RequestOutput
from longserve.inputs import parse_prompt
from longserve.kv_transfer.base import build_scheduler_connector
from longserve.sampling_params import SamplingParams
from longserve.tokenizer import load_tokenizer, render_chat


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer_info = load_tokenizer(config.model)
        self.tokenizer = self.tokenizer_info.tokenizer
        self.kv_store = None
        if config.kv_transfer.kv_role is not None:  # before the workers: they connect to it
            from longserve.kv_transfer.p2p import host_store
            self.kv_store = host_store(config)
        self.executor = Executor(config)
        # with data parallelism: one KV cache manager per DP rank, a DPScheduler over them
        self.scheduler, self.kv_managers = make_scheduler(config, self.executor.num_blocks)
        self.kv = self.kv_managers[0]
        self.kv_connector = None
        if config.kv_transfer.kv_role is not None or config.kv_transfer.kv_offload_bytes:
            self.kv_connector = build_scheduler_connector(
                config, self.kv, self.executor.driver.runner.kv_bytes_per_block(), self.kv_store)
            self.scheduler.connector = self.kv_connector  # dp == 1: one Scheduler
        self._ids = itertools.count()
        self._in_flight = None  # asynchronous scheduling: (plan, PendingStep) of the last step

    # ---- requests ---------------------------------------------------------------------
    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model.path!r} has no tokenizer (tokenizer.json); "
                             "pass {'prompt_token_ids': [...]} instead of text")
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> dict:
        """A conversation -> {"prompt": rendered text, "prompt_token_ids": ...}; the template
        writes any BOS itself, so the tokenizer adds no special tokens."""
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model.path!r} has no tokenizer; chat needs one")
        text = render_chat(self.tokenizer_info, messages, add_generation_prompt, chat_template)
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def make_request(self, prompt, params: SamplingParams,
                     data_parallel_rank: int | None = None) -> Request:
        """Validate one prompt (see longserve/inputs.py) and its parameters into a request;
        data_parallel_rank pins it to one DP rank."""
        check_dp_rank(data_parallel_rank, self.config.parallel.data_parallel_size)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = params.canonical()  # plain and validated: it always pickles to the workers
        ids, text = parse_prompt(prompt, self.encode)
        self.check_prompt(ids)
        self.check_params(params, len(ids))
        req = Request(str(next(self._ids)), ids, params, eos_token_ids=self.config.model.eos_token_ids,
                      prompt=text, arrival=time.perf_counter(), data_parallel_rank=data_parallel_rank)
        kv_params = (params.extra_args or {}).get("kv_transfer_params")
        if kv_params is not None and not isinstance(kv_params, dict):
            raise ValueError(f"kv_transfer_params must be a dict, got {type(kv_params).__name__}")
        req.kv_transfer_params = dict(kv_params) if kv_params else None  # the engine marks it used
        if req.kv_transfer_params is not None:
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs cannot be combined with kv_transfer_params: the "
                                 "prompt's KV is loaded, not computed (ask the producer for them)")
            if not hasattr(self.kv_connector, "validate_params"):
                raise ValueError("kv_transfer_params need an instance started with a kv_role "
                                 "(kv_transfer_config={'kv_role': 'kv_consumer'})")
            self.kv_connector.validate_params(req)
        return req

    def check_prompt(self, ids: list[int]) -> None:
        max_len, vocab = self.config.scheduler.max_model_len, self.config.model.vocab_size
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= max_len:
            raise ValueError(f"the prompt has {len(ids)} tokens; max_model_len is {max_len}, which "
                             "leaves no room for output (raise max_model_len or shorten the prompt)")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Checks that need the model or the pool (the request must fit the pool alone)."""
        vocab = self.config.model.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > vocab:
                raise ValueError(f"{name} must be in [0, {vocab}] (the vocabulary), got {k}")
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        self.scheduler.check_fits(num_prompt_tokens, params.max_tokens)

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def has_kv_transfers(self) -> bool:
        """A producer's held blocks or a consumer's loads: keep calling step() until False."""
        return self.scheduler.has_kv_transfers()

    def stats(self) -> dict:
        s = dict(num_prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
                 num_cached_tokens_hit=self.kv.num_cached_tokens_hit,
                 num_free_blocks=self.kv.num_free_blocks, num_blocks=self.kv.num_blocks)
        for name in ("num_loaded_tokens", "num_saved_blocks"):
            if hasattr(self.kv_connector, name):
                s[f"kv_connector_{name}"] = getattr(self.kv_connector, name)
        return s

    # ---- the loop ---------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One scheduled step; returns the requests that finished in it. With asynchronous
        scheduling the step just planned is launched and the previous one's results are
        applied (so a request finishes one call later than it would synchronously)."""
        out = self.scheduler.schedule()
        transfers = self.scheduler.has_kv_transfers()
        idle = out.is_empty and not out.finished_req_ids and not transfers
        if self.config.scheduler.async_scheduling:
            return self._step_async(out, idle)
        if idle:
            return self.scheduler.update_from_output(out, {})  # any finished while planning
        if out.is_empty and transfers and out.kv_connector_metadata is None:
            time.sleep(0.002)  # only polling the connectors: do not spin (a step that starts
            # a load or announces a hold goes at once)
        return self._apply(out, self.executor.execute(out))

    def _step_async(self, out, idle: bool) -> list[Request]:
        """Launch step N+1, then wait for step N's sampled ids and apply them: the host plans
        and prepares N+1 while the device still runs N."""
        launched = None if idle else (out, self.executor.execute_async(out))
        previous, self._in_flight = self._in_flight, launched
        finished = [] if previous is None else self._apply(previous[0], previous[1].result())
        if launched is None:
            finished += self.scheduler.update_from_output(out, {})  # any finished while planning
        return finished

    def _apply(self, out, result) -> list[Request]:
        failed = []
        if result.kv_connector_output is not None:
            failed = self.scheduler.update_kv_transfers(result.kv_connector_output)
        now = time.perf_counter()
        for req_id in result.sampled:
            req = self.scheduler.requests.get(req_id)
            if req is not None and req.first_token_time is None:
                req.first_token_time = now
        finished = self.scheduler.update_from_output(out, result.sampled, result.logprobs,
                                                     result.prompt_logprobs)
        return failed + finished + self._apply_stop_strings(result.sampled, finished)

    def _apply_stop_strings(self, sampled: dict[str, int], finished: list[Request]) -> list[Request]:
        """Stop strings, checked on the new text only; one completed by the last allowed token
        still counts (its request just finished by length); none counts before min_tokens."""
        just_finished = {r.request_id: r for r in finished}
        stopped = []
        for req_id in sampled:
            req = self.scheduler.requests.get(req_id) or just_finished.get(req_id)
            params = None if req is None else req.sampling_params
            if params is None or not params.stop or req.finish_reason == "stop":
                continue
            if req.detokenizer is None:
                req.detokenizer = IncrementalDetokenizer(self.decode)
            new = req.detokenizer.update(req.output_token_ids)
            if not new or len(req.output_token_ids) < params.min_tokens:
                continue
            hit = find_stop(req.detokenizer.text, len(new), params.stop)
            if hit is None:
                continue
            at, stop = hit
            keep = at + len(stop) if params.include_stop_str_in_output else at
            req.output_text, req.stop_reason = req.detokenizer.text[:keep], stop
            if req_id in just_finished:
                req.finish_reason = "stop"  # was "length"
            else:
                self.scheduler.finish_request(req_id, "stop")
                stopped.append(req)
        return stopped

    def to_output(self, req: Request) -> RequestOutput:
        text = req.output_text if req.stop_reason in req.sampling_params.stop else \
            self.decode(req.output_token_ids)
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason,
                                      req.stop_reason, req.logprobs or None)],
            finished=req.is_finished,
            metrics={"time_to_first_token": ttft, "num_preemptions": req.num_preemptions},
            kv_transfer_params=req.kv_transfer_params if req.is_finished else None,
            error=req.error,
            prompt_logprobs=None if req.sampling_params.prompt_logprobs is None
            else [None] + list(req.prompt_logprobs))

    def shutdown(self) -> None:
        self.executor.shutdown()
        if self.kv_connector is not None and hasattr(self.kv_connector, "close"):
            self.kv_connector.close()
