"""The OpenAI-compatible HTTP server: FastAPI routes over the engine, served by uvicorn.

The engine loads on a thread after the port is open, then one streamed completion and one
streamed chat warm the path every request takes (tokenizer, chat template, detokenizer, SSE);
until then (and after a fatal engine error) /health and /v1/* answer 503. Shutdown (Ctrl-C,
SIGTERM): uvicorn stops accepting and lets in-flight requests drain for --shutdown-timeout
seconds, then the core aborts what is left and stops the workers. With several API servers
(entrypoints/openai/api_servers.py) this is one of them; `siblings` says whether the others
are up."""
from __future__ import annotations

import asyncio
import logging
import secrets
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Callable

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException

import longserve
from longserve.engine.llm_engine import LLMEngine
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
    registry: object = field(default=None)
    metrics: object = None  # ServerMetrics, counted from the first request after the warm-up
    log_requests: bool = False
    siblings: object = None  # with several API servers the others (api_servers.Siblings)
    tasks: list = field(default_factory=list)


def error_response(e: OpenAIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.code == "overloaded" else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def build_app(load_core: Callable[[], LLMEngine], served_names: list[str], api_key: str | None = None,
              chat_template: str | None = None, on_load_error: Callable[[], None] | None = None,
              log_requests: bool = False, siblings=None) -> FastAPI:
    """`load_core` builds the engine core (on a thread, after the server starts listening)."""
    state = ServerState(served_names, api_key, chat_template, log_requests=log_requests,
                        siblings=siblings)
    state.registry, state.metrics = make_registry(lambda: state.core, served_names[0])

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(_load(state, load_core, on_load_error))
        yield
        await asyncio.shield(loading)  # a thread cannot be cancelled: let it finish, then stop it
        for task in state.tasks:
            task.cancel()
        if state.core is not None:
            await asyncio.to_thread(state.core.shutdown)

    app = FastAPI(title="LongServe", lifespan=lifespan)
    app.state.longserve = state
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


async def _load(state: ServerState, load_core, on_load_error) -> None:
    try:
        core = await asyncio.to_thread(load_core)
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
    template compiles at its first use) is done before /health says 200."""
    messages = [ChatMessage(role="user", content="Hello")]
    for create in (lambda: state.completion.create_completion(
                       CompletionRequest(prompt="Hello", max_tokens=2, stream=True)),
                   lambda: state.chat.create_chat_completion(
                       ChatCompletionRequest(messages=messages, max_tokens=2, stream=True))):
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


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def openai_error(_, e: OpenAIError):
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {"loc": (), "msg": "invalid request"}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        return error_response(OpenAIError(f"{param or 'request'}: {err.get('msg')}", param=param))

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        return error_response(OpenAIError(str(e.detail), e.status_code,
                                          "not_found_error" if e.status_code == 404 else "invalid_request_error"))


def _add_routes(app: FastAPI, state: ServerState) -> None:
    async def ready() -> LLMEngine:
        """The engine can serve: loaded, and some engine core alive (with DP, the others go on
        serving when one died)."""
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
    async def completions(body: CompletionRequest):
        return await state.completion.create_completion(body)

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(body: ChatCompletionRequest):
        return await state.chat.create_chat_completion(body)

    @app.get("/version")
    async def version():
        return {"version": longserve.__version__}

    @app.post("/tokenize", dependencies=v1)
    async def tokenize(body: TokenizeRequest):
        return state.tokenization.tokenize(body)

    @app.post("/detokenize", dependencies=v1)
    async def detokenize(body: DetokenizeRequest):
        return state.tokenization.detokenize(body)


def run_server(load_core: Callable[[], LLMEngine], served_names: list[str], host: str = "127.0.0.1",
               port: int = 8000, api_key: str | None = None, chat_template: str | None = None,
               shutdown_timeout: float = 10.0, log_level: str = "info", log_requests: bool = False,
               sock=None, siblings=None) -> int:
    """Serve until Ctrl-C / SIGTERM (on `sock` if given: a socket bound to the port);
    returns the exit status (1 if the engine failed to start)."""
    import uvicorn

    def stop():
        server.should_exit = True

    app = build_app(load_core, served_names, api_key, chat_template, on_load_error=stop,
                    log_requests=log_requests, siblings=siblings)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                           timeout_graceful_shutdown=shutdown_timeout))
    server.run(sockets=None if sock is None else [sock])
    return 1 if app.state.longserve.load_error else 0
