"""`LLM`: the offline API, in vLLM's shape."""
from __future__ import annotations

import contextlib
import queue
import time

from tqdm import tqdm

from longserve.engine.llm_engine import LLMEngine
from longserve.engine.request import RequestOutput
from longserve.engine_args import EngineArgs
from longserve.inputs import is_token_list
from longserve.models.builtin import DEFAULT_MODEL
from longserve.sampling_params import SamplingParams


class LLM:
    """`LLM(model=...).generate(prompts, SamplingParams(...))`; keywords: EngineArgs' fields."""

    def __init__(self, model: str = DEFAULT_MODEL, **kwargs):
        started_at = time.time()  # the start-up timeline's front end includes the config
        self.config = EngineArgs(model=model, **kwargs).create_engine_config()
        self.engine = LLMEngine(self.config, started_at=started_at)

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, data_parallel_rank: int | None = None) -> list[RequestOutput]:
        """data_parallel_rank: run every prompt on that DP rank (default: balanced)."""
        if isinstance(prompts, (str, dict)) or is_token_list(prompts):
            prompts = [prompts]  # one prompt
        prompts = list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        requests = [self.engine.make_request(p, sp, data_parallel_rank) for p, sp in zip(prompts, params)]
        done: queue.SimpleQueue = queue.SimpleQueue()
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(requests), desc="generate", disable=not use_tqdm or len(requests) < 2)
        try:
            for req in requests:  # all validated before any is queued
                self.engine.add_request(req, sink=done)
            while len(outputs) < len(requests):
                try:
                    out = done.get(timeout=0.1)  # a bounded wait: Ctrl-C gets through at once
                except queue.Empty:
                    continue
                if isinstance(out, BaseException):  # its engine core died
                    raise out
                outputs[out.request_id] = out
                bar.update(1)
        except BaseException:
            for req in requests:  # leave nothing behind for the next call
                self.engine.abort(req.request_id)
            raise
        finally:
            bar.close()
        return [outputs[r.request_id] for r in requests]  # n choices each: .outputs[i]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's chat: one conversation (a list of {"role": ..., "content": ...}) or a list of
        conversations, each rendered with the model's chat template and generated from."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts "
                             "(one conversation) or of such lists")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [self.engine.encode_chat(c, chat_template, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.shutdown()
