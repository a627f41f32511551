"""What completions and chat share: sampling params from a request, handing prompts to the
engine core, reading their streams (aborting what a gone client leaves), responses and SSE
frames as plain dicts encoded by msgspec (a chunk's constant head is encoded once per stream)."""
from __future__ import annotations

import asyncio
import logging
import re
import time
from contextlib import aclosing
from functools import lru_cache

import msgspec
from starlette.responses import Response, StreamingResponse

from longserve.engine.llm_engine import LLMEngine
from longserve.engine.messages import EngineCoreRequest
from longserve.engine.output_processor import EngineDeadError, EngineOverloadedError, StreamOutput
from longserve.entrypoints.openai.protocol import OpenAIError, SamplingFields
from longserve.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("longserve.server")
_warned: set[str] = set()  # unknown fields already logged (once per name)


def _param_of(message: str) -> str | None:
    m = re.match(r"(\w+) (must|\[)", message)
    return m.group(1) if m else None


def check_model(requested: str | None, served: list[str]) -> None:
    if requested is not None and requested not in served:
        raise OpenAIError(f"the model {requested!r} does not exist; this server serves {served[0]!r}",
                          404, param="model", code="model_not_found")


def check_fields(req: SamplingFields) -> None:
    """A 400 for a field this server cannot honour; one log line for each unknown field name."""
    refused, unknown = req.unsupported()
    if refused in ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"):
        raise OpenAIError(f"{refused}: no tool parser is configured for this model's chat format, so "
                          "tool calls cannot be returned (tool_choice 'none' is accepted)", param=refused)
    if refused:
        raise OpenAIError(f"{refused} is not supported by this server (value "
                          f"{req.model_extra[refused]!r})", param=refused)
    new = sorted(set(unknown) - _warned)
    if new:
        _warned.update(new)
        logger.warning("The following fields were present in the request but ignored: %s", set(new))


async def sampling_params(req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                          core: LLMEngine, prompt_logprobs: int | None = None) -> SamplingParams:
    if req.best_of not in (None, 1):
        raise OpenAIError(f"best_of must be 1 (best_of > 1 is not supported; n gives several "
                          f"choices), got {req.best_of}", param="best_of")
    check_fields(req)
    if max_tokens == 0 and prompt_logprobs is None:
        raise OpenAIError("max_tokens must be >= 1 unless the prompt is scored (echo with logprobs, "
                          "or prompt_logprobs)", param="max_tokens")
    so, field = structured_outputs(req)
    try:
        params = SamplingParams(
            n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0, seed=req.seed,
            max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop,
            stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=req.logit_bias,
            include_stop_str_in_output=req.include_stop_str_in_output,
            extra_args={"kv_transfer_params": req.kv_transfer_params} if req.kv_transfer_params else None)
    except (ValueError, TypeError) as e:
        raise OpenAIError(str(e), param=_param_of(str(e))) from None
    try:  # the door compiles it too (cached, on a thread: off the event loop), so a schema
        # that xgrammar cannot compile is a 400 here
        params.structured_outputs = so and StructuredOutputsParams(**so)
        if so:
            await asyncio.to_thread(core.check_structured_outputs, params.structured_outputs)
    except (ValueError, TypeError) as e:
        raise OpenAIError(f"{field}: {e}", param=field) from None
    return params


def structured_outputs(req: SamplingFields) -> tuple[dict | None, str | None]:
    """The request's grammar as StructuredOutputsParams fields, and the field that asked."""
    rf, asked = req.response_format, {}
    if rf is not None and rf.type == "json_object":
        asked["response_format"] = {"json_object": True}
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise OpenAIError("response_format: json_schema.schema is required for type json_schema",
                              param="response_format")
        if rf.json_schema.strict is False:  # a schema that is only a hint: not offered
            raise OpenAIError("response_format: json_schema.strict=false is not supported (the "
                              "schema is always enforced); leave strict out or set it true",
                              param="response_format")
        asked["response_format"] = {"json": rf.json_schema.schema_}
    if req.structured_outputs is not None:
        asked["structured_outputs"] = req.structured_outputs
    for kind in ("json", "regex", "choice", "grammar"):
        if getattr(req, f"guided_{kind}") is not None:
            asked[f"guided_{kind}"] = {kind: getattr(req, f"guided_{kind}")}
    if len(asked) > 1:
        raise OpenAIError(f"give one of {', '.join(asked)}, not several", param=list(asked)[1])
    return next(iter(asked.values()), None), next(iter(asked), None)


def make_requests(core: LLMEngine, prompts: list, params: SamplingParams, param: str) -> list:
    """Validate every prompt before any is queued."""
    requests: list[EngineCoreRequest] = []
    for prompt in prompts:
        try:
            requests.append(core.make_request(prompt, params))
        except (ValueError, TypeError) as e:
            raise OpenAIError(str(e), param=_param_of(str(e)) or param) from None
    max_len = core.config.scheduler.max_model_len
    for req in requests:
        if params.max_tokens is not None and req.num_prompt_tokens + params.max_tokens > max_len:
            raise OpenAIError(f"this model's maximum context length is {max_len} tokens; the request "
                              f"asks for {req.num_prompt_tokens + params.max_tokens} ({req.num_prompt_tokens}"
                              f" in the prompt, {params.max_tokens} to generate): lower max_tokens",
                              param="max_tokens")
    return requests


def queue(core: LLMEngine, requests: list[EngineCoreRequest]) -> list:
    """Queue validated requests (make_requests, on a thread: a long prompt's tokens never hold up
    the event loop, so other requests' bytes and /health); their streams."""
    loop, streams = asyncio.get_running_loop(), []
    try:
        for req in requests:
            streams.append(core.add_request(req, loop))
    except (EngineDeadError, EngineOverloadedError) as e:
        for s in streams:
            core.abort(s.request_id)
        raise unavailable(e) from None
    return streams


def unavailable(e: Exception) -> OpenAIError:
    overloaded = isinstance(e, EngineOverloadedError)
    return OpenAIError(str(e), status=503, type="server_overloaded" if overloaded else "server_error",
                       code="overloaded" if overloaded else "engine_dead")


async def read_streams(core: LLMEngine, streams: list):
    """Batches of (choice index, delta) from all streams, each what was ready at once (prompt i's
    choice j is i * n + j, as OpenAI numbers them); on exit aborts every unfinished request."""
    source = _one(streams[0]) if len(streams) == 1 else _interleaved(streams)
    try:
        async with aclosing(source) as batches:
            async for batch in batches:
                yield [(i * streams[i].n + out.index, out) for i, out in batch]
    except EngineDeadError as e:
        raise unavailable(e) from None
    finally:
        for s in streams:
            core.abort(s.request_id)


async def _one(stream):
    async for outs in stream.batches():
        yield [(0, out) for out in outs]


async def _interleaved(streams: list):
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index, stream):
        try:
            async for outs in stream.batches():
                queue.put_nowait((index, outs))
            queue.put_nowait((index, None))  # every choice of it finished
        except Exception as e:
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:  # until each stream finished (or one failed)
            batch = []
            for index, item in [await queue.get()] + [queue.get_nowait() for _ in range(queue.qsize())]:
                if isinstance(item, Exception):
                    raise item
                left -= item is None
                batch += [(index, out) for out in item or ()]
            if batch:
                yield batch
    finally:
        for task in tasks:
            task.cancel()


def check_errors(outs: list[StreamOutput]) -> None:
    """A request that failed alone (e.g. its KV could not be loaded) answers 500."""
    for out in outs:
        if out.error:
            raise OpenAIError(out.error, 500, "server_error", code="request_failed")


async def read_all(core: LLMEngine, streams: list) -> list[StreamOutput]:
    """The whole output of each choice of each stream, in order; raises check_errors' 500."""
    outs: list[StreamOutput | None] = [None] * sum(s.n for s in streams)
    async with aclosing(read_streams(core, streams)) as batches:
        async for batch in batches:
            for index, out in batch:
                outs[index] = out if outs[index] is None else outs[index].merged(out)
    check_errors(outs)
    return outs


def usage(outs: list[StreamOutput]) -> dict:
    """A prompt's tokens count once (with its choice 0), every choice's output tokens."""
    prompt = sum(o.num_prompt_tokens for o in outs if o.index == 0)
    completion = sum(o.num_output_tokens for o in outs)
    return dict(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def vllm_prompt_logprobs(out: StreamOutput, k: int | None, name) -> list | None:
    """The engine's prompt logprobs ([None, {target: lp, top-k...}, ...]) in vLLM's shape:
    {token id: {logprob, rank, decoded_token}}. The target is each entry's first key, its rank
    the engine's (also outside the top k); the top k rank by their order."""
    if k is None or out.prompt_logprobs is None:
        return None

    def shaped(entry: dict, target_rank: int) -> dict:
        rank = {t: i + 1 for i, t in enumerate(sorted(entry, key=entry.get, reverse=True))}
        rank[next(iter(entry))] = target_rank
        return {t: dict(logprob=lp, rank=rank[t], decoded_token=name(t)) for t, lp in entry.items()}
    return [None if e is None else shaped(e, r) for e, r in zip(out.prompt_logprobs, out.prompt_ranks)]


encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"


def response_body(request_id: str, kind: str, model: str, choices: list, **fields) -> dict:
    return dict(id=request_id, object=kind, created=int(time.time()), model=model, choices=choices, **fields)


def json_response(request_id: str, kind: str, model: str, choices: list, outs: list[StreamOutput],
                  **fields) -> Response:
    """A whole (not streamed) response: its usage, `fields`, a producer's kv_transfer_params."""
    kv_params = next((o.kv_transfer_params for o in outs if o.kv_transfer_params), None)
    body = response_body(request_id, kind, model, choices, usage=usage(outs), **fields,
                         kv_transfer_params=kv_params)
    return Response(encode(body), media_type="application/json")


class SSEResponse(StreamingResponse):
    """SSE frames whose requests are aborted however the response ends, also when the client
    went away before its first byte (the frames' generator never started)."""

    def __init__(self, frames, core: LLMEngine, streams: list):
        super().__init__(frames, media_type="text/event-stream")
        self.core, self.streams = core, streams

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            for s in self.streams:
                self.core.abort(s.request_id)


class Frames:
    """A stream's SSE frames: the constant head encoded once, then each chunk's choices, fields."""

    def __init__(self, request_id: str, kind: str, model: str):
        self.head = b"data: " + encode(response_body(request_id, kind, model, []))[:-len(b'"choices":[]}')]

    def chunk(self, choices: list, **fields) -> bytes:
        return self.head + encode(dict(choices=choices, **fields))[1:] + b"\n\n"


async def sse_frames(core: LLMEngine, streams: list, frames: Frames, include_usage: bool, chunk,
                     first: bytes = b""):
    """A stream's SSE body: `first`, then one write for each batch of what came together
    (chunk(index, out, first_of_its_choice) -> a frame, or None: nothing to send yet), the
    usage if asked and [DONE]; an engine failure mid-stream ends it with an error event."""
    finals: dict[int, StreamOutput] = {}
    try:
        if first:
            yield first
        async with aclosing(read_streams(core, streams)) as batches:
            async for batch in batches:
                chunks = []
                for i, out in batch:
                    new = i not in finals
                    finals[i] = out if new else finals[i].merged(out)
                    check_errors([out])
                    chunks.append(chunk(i, out, new))
                if any(chunks):  # else tokens whose text is held back (a character or a stop string)
                    yield b"".join(c for c in chunks if c)
        if include_usage:
            yield frames.chunk([], usage=usage(list(finals.values())))
    except Exception as e:
        err = e if isinstance(e, OpenAIError) else OpenAIError(str(e), 500, "server_error")
        yield b"data: " + encode(err.body()) + b"\n\n"
    yield DONE


class TokenNames:
    """Token id -> its text, as logprobs show it (special tokens by name)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.name = lru_cache(maxsize=65536)(self._name)

    def namer(self, as_ids: bool):
        return (lambda t: f"token_id:{t}") if as_ids else self.name

    def _name(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
