"""POST /v1/completions: prompts (text or token ids, one or many) in, completions out, or SSE."""
from __future__ import annotations

from contextlib import aclosing

from starlette.responses import StreamingResponse

from longserve.engine.llm_engine import LLMEngine
from longserve.engine.output_processor import StreamOutput
from longserve.entrypoints.openai.protocol import (CompletionChoice, CompletionLogprobs,
                                                   CompletionRequest, CompletionResponse,
                                                   OpenAIError, random_id)
from longserve.entrypoints.openai.serving_engine import (TokenNames, check_errors, check_model,
                                                         kv_transfer_params, read_all,
                                                         read_streams, sampling_params, sse,
                                                         sse_error, submit, usage)


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
        self.core = core
        self.served_names = served_names
        self.names = TokenNames(core.tokenizer)

    async def create_completion(self, req: CompletionRequest):
        check_model(req.model, self.served_names)
        if req.suffix:
            raise OpenAIError("suffix is not supported", param="suffix")
        if req.echo and req.logprobs is not None:
            raise OpenAIError("echo with logprobs needs the prompt's logprobs, which this server "
                              "does not return yet", param="echo")
        params = sampling_params(req, req.max_tokens, req.logprobs, self.core)
        submitted = submit(self.core, normalize_prompts(req.prompt), params, "prompt")
        echoes = [self._echo(r) if req.echo else "" for r, _ in submitted]
        name = self.names.namer(req.return_tokens_as_token_ids)
        streams = [s for _, s in submitted]
        request_id, model = random_id("cmpl"), self.served_names[0]
        if req.stream:
            body = self._stream(request_id, model, streams, echoes, req, name)
            return StreamingResponse(body, media_type="text/event-stream")
        outs = await read_all(self.core, streams)
        check_errors(outs)
        choices = [self._choice(i, out, echoes[i // req.n], 0, name, req.return_token_ids)
                   for i, out in enumerate(outs)]
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=usage(outs),
                                  kv_transfer_params=kv_transfer_params(outs))

    def _echo(self, request) -> str:
        return request.prompt if request.prompt is not None else \
            self.core.decode(request.prompt_token_ids)

    def _choice(self, index: int, out: StreamOutput, prefix: str, text_offset: int, name,
                with_ids: bool) -> CompletionChoice:
        return CompletionChoice(index=index, text=prefix + out.text,
                                logprobs=self._logprobs(out, text_offset, name),
                                finish_reason=out.finish_reason if out.finished else None,
                                stop_reason=out.stop_reason if out.finished else None,
                                token_ids=out.token_ids if with_ids else None)

    @staticmethod
    def _logprobs(out: StreamOutput, offset: int, name) -> CompletionLogprobs | None:
        if out.logprobs is None:
            return None
        lp = CompletionLogprobs()
        for token, entry in zip(out.token_ids, out.logprobs):
            text = name(token)
            lp.tokens.append(text)
            lp.token_logprobs.append(entry.get(token))
            lp.top_logprobs.append({name(t): v for t, v in entry.items()})
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    async def _stream(self, request_id, model, streams, echoes, req: CompletionRequest, name):
        outs: dict[int, StreamOutput] = {}
        offsets = [0] * (len(streams) * req.n)
        try:
            async with aclosing(read_streams(self.core, streams)) as deltas:
                async for index, out in deltas:
                    prefix = echoes[index // req.n] if index not in outs else ""
                    outs[index] = out if index not in outs else outs[index].merged(out)
                    check_errors([out])
                    if not (prefix or out.text or out.finished or out.logprobs or req.return_token_ids):
                        continue  # tokens whose text is held back (a character or a stop string unfinished)
                    choice = self._choice(index, out, prefix, offsets[index], name, req.return_token_ids)
                    offsets[index] += len(out.text)
                    yield sse(CompletionResponse(id=request_id, model=model, choices=[choice]))
            if req.include_usage:
                yield sse(CompletionResponse(id=request_id, model=model, choices=[],
                                             usage=usage(list(outs.values()))))
        except Exception as e:  # the engine failed mid-stream: tell the client, then end
            yield sse_error(e)
        yield "data: [DONE]\n\n"
