"""The engine loop: validate and queue requests, schedule a step, run it, apply the results."""
from __future__ import annotations

import itertools
import os
import time

from longserve.config import EngineConfig
from longserve.engine.dp_scheduler import check_dp_rank, make_scheduler
from longserve.engine.executor import Executor
from longserve.engine.request import CompletionOutput, Request, RequestOutput
from longserve.sampling_params import SamplingParams


def load_tokenizer(path: str):
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(file)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.tokenizer = load_tokenizer(config.model.path)
        self.executor = Executor(config)
        # with data parallelism: one KV cache manager per DP rank, a DPScheduler over them
        self.scheduler, self.kv_managers = make_scheduler(config, self.executor.num_blocks)
        self.kv = self.kv_managers[0]
        self._ids = itertools.count()

    # ---- requests ---------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.config.model.path!r} has no tokenizer.json; "
                             "pass {'prompt_token_ids': [...]} instead of text")
        return self.tokenizer.encode(prompt).ids

    def decode(self, token_ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def make_request(self, prompt, params: SamplingParams,
                     data_parallel_rank: int | None = None) -> Request:
        """Validate one prompt (a string or {"prompt_token_ids": [...]}) into a request;
        data_parallel_rank pins it to one DP rank."""
        check_dp_rank(data_parallel_rank, self.config.parallel.data_parallel_size)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        text = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, dict):
            ids = list(prompt.get("prompt_token_ids") or [])
            text = prompt.get("prompt")
        elif isinstance(prompt, str):
            ids = self.encode(prompt)
        else:
            raise TypeError(f"a prompt is a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")
        self.check_prompt(ids)
        return Request(str(next(self._ids)), ids, params, eos_token_ids=self.config.model.eos_token_ids,
                       prompt=text, arrival=time.perf_counter(), data_parallel_rank=data_parallel_rank)

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
        need = self.kv.blocks_needed(len(ids) + 1)
        if need > self.kv.num_blocks:
            raise ValueError(f"the prompt needs {need} KV blocks but the cache has only "
                             f"{self.kv.num_blocks}; give the KV cache more memory")

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_request(request_id, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the loop ---------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One scheduled step; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        if out.is_empty and not out.finished_req_ids:
            return []
        result = self.executor.execute(out)
        now = time.perf_counter()
        for req_id in result.sampled:
            req = self.scheduler.requests.get(req_id)
            if req is not None and req.first_token_time is None:
                req.first_token_time = now
        finished = self.scheduler.update_from_output(out, result.sampled, result.logprobs)
        return finished + self._apply_stop_strings(result.sampled)

    def _apply_stop_strings(self, sampled: dict[str, int]) -> list[Request]:
        finished = []
        for req_id in sampled:
            req = self.scheduler.requests.get(req_id)
            if req is None or not req.sampling_params.stop:
                continue
            text = self.decode(req.output_token_ids)
            for stop in req.sampling_params.stop:
                at = text.find(stop)
                if at >= 0:
                    keep = at + len(stop) if req.sampling_params.include_stop_str_in_output else at
                    req.output_text, req.stop_reason = text[:keep], stop
                    self.scheduler.finish_request(req_id, "stop")
                    finished.append(req)
                    break
        return finished

    def to_output(self, req: Request) -> RequestOutput:
        text = req.output_text if req.stop_reason in req.sampling_params.stop else \
            self.decode(req.output_token_ids)
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival
        return RequestOutput(
            request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
            outputs=[CompletionOutput(0, text, list(req.output_token_ids), req.finish_reason,
                                      req.stop_reason, req.logprobs or None)],
            finished=req.is_finished,
            metrics={"time_to_first_token": ttft, "num_preemptions": req.num_preemptions})

    def shutdown(self) -> None:
        self.executor.shutdown()
