"""The OpenAI-compatible HTTP server: FastAPI routes over the engine, served by uvicorn; /health
and /v1/* answer 503 until the engine (loaded on a thread once the port is open) has warmed up.
Drain, aborts and several API servers: docs/architecture.md, 'Engine cores and the front end'."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from dataclasses import dataclass, field
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

import torch

import longserve
from longserve.engine.core_client import InprocClient
from longserve.engine.llm_engine import LLMEngine
from longserve.engine.output_processor import EngineDeadError
from longserve.stalls import freeze_after_warm_up, watch_loop_lag
from longserve.entrypoints.openai.metrics import make_registry
from longserve.entrypoints.openai.protocol import (ChatCompletionRequest, ChatMessage,
                                                   CompletionRequest, DetokenizeRequest, ModelCard,
                                                   ModelList, OpenAIError, TokenizeRequest)
from longserve.entrypoints.openai.serving_chat import OpenAIServingChat
from longserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from longserve.entrypoints.openai.serving_tokenization import OpenAIServingTokenization

logger = logging.getLogger("longserve.server")


@dataclass
class ServerState:
    served_names: list[str]
    api_key: str | None = None
    chat_template: str | None = None
    core: LLMEngine | None = None
    load_error: str | None = None
    completion: OpenAIServingCompletion | None = None
    chat: OpenAIServingChat | None = None
    tokenization: OpenAIServingTokenization | None = None
    registry: object = None
    metrics: object = None  # ServerMetrics, counted from the first request after the warm-up
    log_requests: bool = False
    siblings: object = None  # with several API servers the others (api_servers.Siblings)
    tasks: list = field(default_factory=list)


def error_response(e: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.code == "overloaded" else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def build_app(load_core: Callable[[], LLMEngine], served_names: list[str], api_key: str | None = None,
              chat_template: str | None = None, on_load_error: Callable[[], None] | None = None,
              log_requests: bool = False, siblings=None, max_request_body_mb: float = 8.0) -> FastAPI:
    """`load_core` builds the engine core (on a thread, after the server starts listening)."""
    state = ServerState(served_names, api_key, chat_template, log_requests=log_requests, siblings=siblings)
    state.registry, state.metrics = make_registry(lambda: state.core, served_names[0])

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(_load(state, load_core, on_load_error))
        yield
        await asyncio.shield(loading)  # a thread cannot be cancelled: let it finish, then stop it
        for task in state.tasks:
            task.cancel()
        if state.core is not None:
            await asyncio.to_thread(state.core.shutdown)

    app = FastAPI(title="LongServe", lifespan=lifespan)
    app.add_middleware(body_limit, max_bytes=int(max_request_body_mb * 2**20))
    app.state.longserve = state
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


async def _load(state: ServerState, load_core, on_load_error) -> None:
    try:
        core = await asyncio.to_thread(load_core)
        if not isinstance(core.client, InprocClient):  # the cores compute in processes of their own
            torch.set_num_threads(1)
        state.completion = OpenAIServingCompletion(core, state.served_names)
        state.chat = OpenAIServingChat(core, state.served_names, state.chat_template)
        state.tokenization = OpenAIServingTokenization(state.chat, state.served_names)
        await _warm_up(state)
        core.log_requests, core.output.metrics = state.log_requests, state.metrics
        freeze_after_warm_up()
        state.tasks.append(asyncio.create_task(watch_loop_lag()))
        state.core = core
        if state.siblings is not None:
            state.siblings.mark_ready()
        for line in banner(core.info()):
            logger.info(line)
        logger.info("the engine is ready: serving %s", state.served_names[0])
    except Exception as e:
        logger.exception("the engine failed to start")
        state.load_error = f"the engine failed to start: {type(e).__name__}: {e}"
        if on_load_error is not None:
            on_load_error()


async def _warm_up(state: ServerState) -> None:
    """Two tokens streamed through completions and chat: what a first request touches (a chat
    template compiles at its first use) is done before /health says 200. A KV producer keeps
    no blocks of them under a lease."""
    messages, kv = [ChatMessage(role="user", content="Hello")], {"do_remote_decode": False}
    for create in (lambda: state.completion.create_completion(CompletionRequest(
                       prompt="Hello", max_tokens=2, stream=True, kv_transfer_params=kv)),
                   lambda: state.chat.create_chat_completion(ChatCompletionRequest(
                       messages=messages, max_tokens=2, stream=True, kv_transfer_params=kv))):
        try:
            async for _ in (await create()).body_iterator:
                pass
        except Exception as e:  # e.g. a model without a tokenizer or a chat template
            logger.info("warm-up: %s", e)


def banner(info: dict) -> list[str]:
    """What the server holds, in the start-up log (KV and concurrency per engine core)."""
    tokens, max_len = info["num_gpu_blocks"] * info["tokens_per_block"], info["max_model_len"]
    names = info["device_names"]
    devices = ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))
    graphs = info["cudagraph_capture_s"]
    return [f"model: {info['model']} ({info['dtype']}, on {info['device']})",
            f"layout: tp={info['tensor_parallel_size']} pcp={info['prefill_context_parallel_size']} "
            f"dcp={info['decode_context_parallel_size']} dp={info['data_parallel_size']} on {devices}",
            f"KV cache: {info['num_gpu_blocks']} blocks of {info['tokens_per_block']} tokens = "
            f"{tokens} tokens per engine core",
            f"Maximum concurrency for {max_len} tokens per request: {tokens / max_len:.2f}x",
            f"engine core started in {info['load_s']:.2f} s; CUDA graph capture: "
            + ("none" if graphs is None else f"{graphs:.2f} s"), f"engine {info['startup']}"]


def body_limit(app, max_bytes: int):
    """ASGI middleware: a 413 for a request body over max_bytes before it is read whole: by its
    Content-Length before any byte, else (chunked) once the bytes read pass the limit."""
    message = f"the request body is larger than --max-request-body-mb ({max_bytes / 2**20:g} MB)"

    async def limited(scope, receive, send):
        seen = 0

        async def counted():
            nonlocal seen
            event = await receive()
            seen += len(event.get("body", b""))
            if seen > max_bytes:
                raise HTTPException(413, message)  # answered by http_error below
            return event
        length = dict(scope.get("headers", ())).get(b"content-length", b"")
        if length.isdigit() and int(length) > max_bytes:
            return await error_response(OpenAIError(message, 413))(scope, receive, send)
        await app(scope, counted, send)
    return limited


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"type": "", "loc": (), "msg": "invalid request"}
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if not (kind == "application/json" or kind.endswith("+json")):  # FastAPI read no JSON
            return error_response(OpenAIError(f"the body must be JSON with Content-Type: application/json "
                                              f"(got {kind or 'no Content-Type'})", 415))
        if err["type"] == "json_invalid":  # loc: ("body", position)
            text, at = e.body, err["loc"][-1]
            line, column = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
            return error_response(OpenAIError(f"invalid JSON at line {line} column {column}: "
                                              f"{err['ctx']['error']}"))
        param = field_path(err["loc"])
        return error_response(OpenAIError(f"{param or 'request'}: {err['msg']}", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return error_response(OpenAIError(str(e.detail), e.status_code,
                                          "not_found_error" if e.status_code == 404 else "invalid_request_error"))


def field_path(loc: tuple) -> str | None:
    """A pydantic error's location in words: ("body", "messages", 0, "role") -> messages[0].role."""
    path = ""
    for x in loc[1:] if loc[:1] == ("body",) else loc:
        path += f"[{x}]" if isinstance(x, int) else f".{x}" if path else x
    return path or None


def _add_routes(app: FastAPI, state: ServerState) -> None:
    async def ready() -> LLMEngine:
        """The engine can serve: loaded, and some engine core alive (with DP, others serve on)."""
        if state.core is None:
            raise OpenAIError(state.load_error or "the model is still loading; try again shortly",
                              503, "server_error", code="loading")
        if state.core.error is not None:
            raise OpenAIError(state.core.error, 503, "server_error", code="engine_dead")
        return state.core

    async def authorized(request: Request) -> None:
        if state.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {state.api_key}".encode()):
            raise OpenAIError("invalid API key (send Authorization: Bearer <key>)", 401,
                              "authentication_error", code="invalid_api_key")

    v1 = [Depends(authorized), Depends(ready)]

    @app.get("/health")
    async def health():
        """200 only when every engine core (and every other API server) is up."""
        core = await ready()
        trouble = (None if core.healthy else "; ".join(core.client.dead.values())
                   or "the engine is shutting down") or (state.siblings and state.siblings.trouble())
        if trouble:
            raise OpenAIError(trouble, 503, "server_error", code="engine_dead")
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=v1)
    async def models():
        max_len = state.core.config.scheduler.max_model_len
        return ModelList(data=[ModelCard(id=name, max_model_len=max_len) for name in state.served_names])

    @app.post("/v1/completions", dependencies=v1)
    async def completions(body: CompletionRequest, request: Request):
        return await unless_disconnected(request, state.completion.create_completion(body))

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await unless_disconnected(request, state.chat.create_chat_completion(body))

    @app.get("/version")
    async def version():
        return {"version": longserve.__version__}

    @app.post("/tokenize", dependencies=v1)
    async def tokenize(body: TokenizeRequest):
        return await asyncio.to_thread(state.tokenization.tokenize, body)  # off the event loop

    @app.post("/detokenize", dependencies=v1)
    async def detokenize(body: DetokenizeRequest):
        return await asyncio.to_thread(state.tokenization.detokenize, body)


async def unless_disconnected(request: Request, work):
    """A route's work, cancelled when the client goes away first: a non-streamed request is then
    aborted (serving_engine.read_streams), its KV blocks freed at once."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        task.cancel()  # a no-op once it is done
    with contextlib.suppress(asyncio.CancelledError):
        return await task
    return Response(status_code=499)  # nobody reads it


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":  # the body is read already
        pass


def run_server(load_core: Callable[[], LLMEngine], served_names: list[str], host: str = "127.0.0.1",
               port: int = 8000, shutdown_timeout: float = 10.0, log_level: str = "info", sock=None,
               **app_kw) -> int:
    """Serve until Ctrl-C / SIGTERM (on `sock` if given: a socket bound to the port);
    returns the exit status (1 if the engine failed to start). app_kw: build_app's."""
    import uvicorn

    def stop():
        server.should_exit = True

    app = build_app(load_core, served_names, on_load_error=stop, **app_kw)
    # uvicorn's own deadline is a backstop: at the drain's end the requests left get an error
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=shutdown_timeout + 5))
    drain = server.shutdown

    async def shutdown(sockets=None):  # Ctrl-C / SIGTERM: uvicorn drains the requests in flight
        asyncio.get_running_loop().call_later(max(shutdown_timeout - 1, 0), abort_in_flight,
                                              app.state.longserve)
        await drain(sockets)
    server.shutdown = shutdown
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn raises again the Ctrl-C it handled
        server.run(sockets=None if sock is None else [sock])
    return 1 if app.state.longserve.load_error else 0


def abort_in_flight(state: ServerState) -> None:
    """The end of the drain (a second before --shutdown-timeout, which leaves the engine time to
    stop): what still runs ends with an error (an SSE error event, a 503)."""
    if state.core is not None and state.core.output.num_unfinished:
        logger.warning("shutting down: %d requests still in flight were aborted",
                       state.core.output.num_unfinished)
        state.core.output.fail(EngineDeadError("the server is shutting down"))
