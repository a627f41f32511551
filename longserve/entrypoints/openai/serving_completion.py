"""POST /v1/completions: prompts (text or token ids, one or many) in, completions out, or SSE."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from longserve.engine.llm_engine import LLMEngine
from longserve.engine.output_processor import StreamOutput
from longserve.entrypoints.openai.protocol import CompletionRequest, OpenAIError, random_id
from longserve.entrypoints.openai.serving_engine import (Frames, SSEResponse, TokenNames, check_model,
                                                         json_response, make_requests, queue, read_all,
                                                         sampling_params, sse_frames, vllm_prompt_logprobs)


def normalize_prompts(prompt) -> list:
    """OpenAI's four prompt shapes -> a list of engine prompts (text or {"prompt_token_ids"})."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError("prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    return [{"prompt_token_ids": list(p)} for p in prompt]


class OpenAIServingCompletion:
    def __init__(self, core: LLMEngine, served_names: list[str]):
        self.core, self.served_names = core, served_names
        self.names = TokenNames(core.tokenizer)

    async def create_completion(self, req: CompletionRequest):
        check_model(req.model, self.served_names)
        scored = req.echo and req.logprobs is not None  # the prompt's tokens come with logprobs
        prompt_k = max(req.logprobs, req.prompt_logprobs or 0) if scored else req.prompt_logprobs
        if prompt_k is not None and req.n > 1:
            raise OpenAIError("prompt scoring (echo with logprobs, prompt_logprobs) needs n=1", param="n")
        params = await sampling_params(req, req.max_tokens, req.logprobs, self.core, prompt_k)
        requests, echoes = await asyncio.to_thread(self._requests, normalize_prompts(req.prompt),
                                                   params, req.echo, scored)
        shape = _Shape(self.names.namer(req.return_tokens_as_token_ids), req.return_token_ids,
                       prompt_k if req.prompt_logprobs is not None else None)
        streams = queue(self.core, requests)  # no await until read_streams, which aborts what is left
        request_id, model = random_id("cmpl"), self.served_names[0]
        if req.stream:
            frames = self._stream(request_id, model, streams, echoes, req, shape)
            return SSEResponse(frames, self.core, streams)
        outs = await read_all(self.core, streams)
        choices = [shape.choice(i, out, echoes[i // req.n], 0) for i, out in enumerate(outs)]
        return json_response(request_id, "text_completion", model, choices, outs)

    def _requests(self, prompts: list, params, echo: bool, scored: bool) -> tuple[list, list]:
        """(validated requests, per prompt: (the echoed text, the prompt ids whose logprobs lead
        the choice's)); on a thread, as a long prompt's (de)tokenization takes a while."""
        requests = make_requests(self.core, prompts, params, "prompt")
        return requests, [("" if not echo else r.prompt if r.prompt is not None else
                           self.core.decode(r.prompt_token_ids), r.prompt_token_ids if scored else None)
                          for r in requests]

    def _stream(self, request_id, model, streams, echoes, req: CompletionRequest, shape):
        offsets = [0] * (len(streams) * req.n)
        frames = Frames(request_id, "text_completion", model)

        def chunk(index, out, first):
            echo = echoes[index // req.n] if first else ("", None)
            if not (echo[0] or out.text or out.finished or out.logprobs or req.return_token_ids):
                return None
            offset, offsets[index] = offsets[index], offsets[index] + len(echo[0]) + len(out.text)
            return frames.chunk([shape.choice(index, out, echo, offset)])
        return sse_frames(self.core, streams, frames, req.include_usage, chunk)


@dataclass
class _Shape:
    """How one request's choices look: token names, ids or not, vLLM's prompt_logprobs (top-k)."""
    name: Callable[[int], str]
    with_ids: bool
    prompt_k: int | None  # None: not asked

    def choice(self, index: int, out: StreamOutput, echo: tuple, text_offset: int) -> dict:
        return dict(index=index, text=echo[0] + out.text, logprobs=self.logprobs(out, text_offset, echo[1]),
                    prompt_logprobs=vllm_prompt_logprobs(out, self.prompt_k, self.name),
                    finish_reason=out.finish_reason if out.finished else None,
                    stop_reason=out.stop_reason if out.finished else None,
                    token_ids=out.token_ids if self.with_ids else None)

    def logprobs(self, out: StreamOutput, offset: int, echo_ids) -> dict | None:
        """The tokens' logprobs; with echo the prompt's first (the first of all has none)."""
        if out.logprobs is None:
            return None
        ids, entries = out.token_ids, out.logprobs
        if echo_ids is not None and out.prompt_logprobs is not None:
            ids, entries = echo_ids + ids, out.prompt_logprobs + entries
        lp = dict(text_offset=[], token_logprobs=[], tokens=[], top_logprobs=[])
        for token, entry in zip(ids, entries):
            text = self.name(token)
            lp["tokens"].append(text)
            lp["token_logprobs"].append(None if entry is None else entry[token])
            lp["top_logprobs"].append(None if entry is None else {self.name(t): v for t, v in entry.items()})
            lp["text_offset"].append(offset)
            offset += len(text)
        return lp
