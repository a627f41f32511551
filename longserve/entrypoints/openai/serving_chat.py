"""POST /v1/chat/completions: messages rendered by the model's chat template, then one completion."""
from __future__ import annotations

import os
from contextlib import aclosing

from starlette.responses import StreamingResponse

from longserve.engine.llm_engine import LLMEngine
from longserve.engine.output_processor import StreamOutput
from longserve.entrypoints.openai.protocol import (ChatChoice, ChatCompletionChunk,
                                                   ChatCompletionRequest, ChatCompletionResponse,
                                                   ChatLogprobs, ChatLogprobToken, ChatMessageOut,
                                                   ChatStreamChoice, DeltaMessage, OpenAIError,
                                                   TopLogprob, random_id)
from longserve.entrypoints.openai.serving_engine import (TokenNames, check_errors, check_model,
                                                         kv_transfer_params, read_all,
                                                         read_streams, sampling_params, sse,
                                                         sse_error, submit, usage, vllm_prompt_logprobs)


def message_dicts(req: ChatCompletionRequest) -> list[dict]:
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            if any(p.type != "text" for p in content):
                raise OpenAIError(f"messages[{i}].content: only text parts are supported",
                                  param="messages")
            content = "".join(p.text or "" for p in content)
        out.append({"role": m.role, "content": content or "", **({"name": m.name} if m.name else {})})
    return out


class OpenAIServingChat:
    def __init__(self, core: LLMEngine, served_names: list[str], chat_template: str | None = None):
        self.core = core
        self.served_names = served_names
        if chat_template and os.path.isfile(chat_template):  # --chat-template: a file or the text
            with open(chat_template) as f:
                chat_template = f.read()
        self.template = chat_template or None  # None: the tokenizer's
        self.names = TokenNames(core.tokenizer)

    def render(self, req: ChatCompletionRequest) -> dict:
        """The prompt as the engine takes it (token ids: the template already holds BOS)."""
        try:
            return self.core.encode_chat(message_dicts(req), self.template, req.add_generation_prompt)
        except OpenAIError:
            raise
        except Exception as e:  # no template, or the template refused the messages
            raise OpenAIError(f"chat template: {e}", param="messages") from None

    async def create_chat_completion(self, req: ChatCompletionRequest):
        check_model(req.model, self.served_names)
        if req.top_logprobs is not None and not req.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        params = sampling_params(req, max_tokens, logprobs, self.core, req.prompt_logprobs)
        [(_, stream)] = submit(self.core, [self.render(req)], params, "messages")
        request_id, model = random_id("chatcmpl"), self.served_names[0]
        name = self.names.namer(req.return_tokens_as_token_ids)
        if req.stream:
            return StreamingResponse(self._stream(request_id, model, stream, req, name),
                                     media_type="text/event-stream")
        outs = await read_all(self.core, [stream])
        check_errors(outs)
        choices = [ChatChoice(index=i, message=ChatMessageOut(content=out.text),
                              logprobs=self._logprobs(out, name), finish_reason=out.finish_reason,
                              stop_reason=out.stop_reason) for i, out in enumerate(outs)]
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage(outs),
                                      prompt_logprobs=vllm_prompt_logprobs(outs[0], req.prompt_logprobs, name),
                                      kv_transfer_params=kv_transfer_params(outs))

    @staticmethod
    def _top(token: int, logprob: float, name) -> TopLogprob:
        text = name(token)
        return TopLogprob(token=text, logprob=logprob, bytes=list(text.encode()))

    def _logprobs(self, out: StreamOutput, name) -> ChatLogprobs | None:
        if out.logprobs is None:
            return None
        content = []
        for token, entry in zip(out.token_ids, out.logprobs):
            top = sorted(entry.items(), key=lambda kv: -kv[1])
            sampled = self._top(token, entry[token], name)
            content.append(ChatLogprobToken(**sampled.model_dump(),
                                            top_logprobs=[self._top(t, v, name) for t, v in top]))
        return ChatLogprobs(content=content)

    async def _stream(self, request_id, model, stream, req: ChatCompletionRequest, name):
        chunk = lambda choice, **kw: sse(ChatCompletionChunk(  # noqa: E731
            id=request_id, model=model, choices=[choice] if choice else [], **kw))
        finals: dict[int, StreamOutput] = {}
        try:
            for i in range(stream.n):
                yield chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            async with aclosing(read_streams(self.core, [stream])) as deltas:
                async for i, out in deltas:
                    finals[i] = out if i not in finals else finals[i].merged(out)
                    check_errors([out])
                    if out.text or out.finished or out.logprobs or out.prompt_logprobs:
                        yield chunk(ChatStreamChoice(
                            index=i, delta=DeltaMessage(content=out.text or None),
                            logprobs=self._logprobs(out, name),
                            finish_reason=out.finish_reason if out.finished else None),
                            prompt_logprobs=vllm_prompt_logprobs(out, req.prompt_logprobs, name))
            if req.include_usage:
                yield chunk(None, usage=usage(list(finals.values())))
        except Exception as e:  # the engine failed mid-stream: tell the client, then end
            yield sse_error(e)
        yield "data: [DONE]\n\n"
