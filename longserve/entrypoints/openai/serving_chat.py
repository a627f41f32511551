"""POST /v1/chat/completions: messages rendered by the model's chat template, then one completion."""
from __future__ import annotations

import asyncio
import os

from longserve.engine.llm_engine import LLMEngine
from longserve.engine.output_processor import StreamOutput
from longserve.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIError, random_id
from longserve.entrypoints.openai.serving_engine import (Frames, SSEResponse, TokenNames, check_model,
                                                         json_response, make_requests, queue, read_all,
                                                         sampling_params, sse_frames, vllm_prompt_logprobs)


def message_dicts(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise OpenAIError(f"messages[{i}].content: only text parts are supported", param="messages")
            content = "".join(p.text or "" for p in content)
        out.append({"role": m.role, "content": content or "", **({"name": m.name} if m.name else {})})
    return out


class OpenAIServingChat:
    def __init__(self, core: LLMEngine, served_names: list[str], chat_template: str | None = None):
        self.core, self.served_names = core, served_names
        if chat_template and os.path.isfile(chat_template):  # --chat-template: a file or the text
            with open(chat_template) as f:
                chat_template = f.read()
        self.template = chat_template or None  # None: the tokenizer's
        self.names = TokenNames(core.tokenizer)

    def render(self, req: ChatCompletionRequest) -> dict:
        """The prompt as the engine takes it (token ids: the template already holds BOS)."""
        messages = message_dicts(req)
        try:
            return self.core.encode_chat(messages, self.template, req.add_generation_prompt)
        except Exception as e:  # no template, or the template refused the messages
            raise OpenAIError(f"chat template: {e}", param="messages") from None

    async def create_chat_completion(self, req: ChatCompletionRequest):
        check_model(req.model, self.served_names)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = await sampling_params(req, max_tokens, logprobs, self.core, req.prompt_logprobs)
        requests = await asyncio.to_thread(  # a long conversation's tokens: off the event loop
            lambda: make_requests(self.core, [self.render(req)], params, "messages"))
        [stream] = queue(self.core, requests)  # no await until read_streams, which aborts what is left
        request_id, model = random_id("chatcmpl"), self.served_names[0]
        name = self.names.namer(req.return_tokens_as_token_ids)
        if req.stream:
            return SSEResponse(self._stream(request_id, model, stream, req, name), self.core, [stream])
        outs = await read_all(self.core, [stream])
        choices = [dict(index=i, message=dict(role="assistant", content=out.text),
                        logprobs=self._logprobs(out, name), finish_reason=out.finish_reason,
                        stop_reason=out.stop_reason) for i, out in enumerate(outs)]
        return json_response(request_id, "chat.completion", model, choices, outs,
                             prompt_logprobs=vllm_prompt_logprobs(outs[0], req.prompt_logprobs, name))

    @staticmethod
    def _top(token: int, logprob: float, name) -> dict:
        text = name(token)
        return dict(token=text, logprob=logprob, bytes=list(text.encode()))

    def _logprobs(self, out: StreamOutput, name) -> dict | None:
        if out.logprobs is None:
            return None
        return dict(content=[dict(self._top(token, entry[token], name), top_logprobs=[
            self._top(t, v, name) for t, v in sorted(entry.items(), key=lambda kv: -kv[1])])
            for token, entry in zip(out.token_ids, out.logprobs)])

    def _stream(self, request_id, model, stream, req: ChatCompletionRequest, name):
        frames = Frames(request_id, "chat.completion.chunk", model)
        first = b"".join(frames.chunk([dict(index=i, delta=dict(role="assistant", content=""),
                                            logprobs=None, finish_reason=None)]) for i in range(stream.n))

        def chunk(i, out, _):
            if not (out.text or out.finished or out.logprobs or out.prompt_logprobs):
                return None
            prompt_lps = vllm_prompt_logprobs(out, req.prompt_logprobs, name)
            return frames.chunk([dict(index=i, delta=dict(content=out.text or None),
                                      logprobs=self._logprobs(out, name),
                                      finish_reason=out.finish_reason if out.finished else None)],
                                **({"prompt_logprobs": prompt_lps} if prompt_lps else {}))
        return sse_frames(self.core, [stream], frames, req.include_usage, chunk, first)
