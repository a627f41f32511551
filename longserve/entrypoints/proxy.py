"""`longserve proxy`: a prefill / decode pair behind one OpenAI endpoint: one token on --prefill, then
--decode with the kv_transfer_params that came back (docs/architecture.md, 'Layers')."""
from __future__ import annotations

import argparse

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def build_app(prefill_url: str | None, decode_url: str, transport: httpx.AsyncBaseTransport | None = None,
              timeout_s: float = 600.0, local_prefill_tokens: int = 0) -> FastAPI:
    app = FastAPI(title="longserve proxy")
    client = httpx.AsyncClient(transport=transport, timeout=timeout_s)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def forward(request: Request):
        body, path = await request.json(), request.scope["route"].path  # the route that matched
        headers = {k: v for k, v in request.headers.items() if k.lower() == "authorization"}
        decode = body
        local = prefill_url is None or (local_prefill_tokens > 0 and await is_short(
            client, prefill_url, body, path, headers, local_prefill_tokens))
        if not local:  # prefilled there, decoded here
            prefill = dict(body, stream=False, max_tokens=1, max_completion_tokens=1,
                           kv_transfer_params={"do_remote_decode": True})
            prefill.pop("stream_options", None)
            r = await client.post(prefill_url.rstrip("/") + path, json=prefill, headers=headers)
            if r.status_code != 200:
                return Response(r.content, r.status_code, media_type="application/json")
            if await request.is_disconnected():  # nobody to answer: the producer's lease frees its blocks
                return Response(status_code=499)
            decode = dict(body, kv_transfer_params=r.json().get("kv_transfer_params"))
        url = decode_url.rstrip("/") + path
        if not body.get("stream"):
            r = await client.post(url, json=decode, headers=headers)
            return Response(r.content, r.status_code, media_type="application/json")
        upstream = await client.send(client.build_request("POST", url, json=decode, headers=headers),
                                     stream=True)
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            return Response(content, upstream.status_code, media_type="application/json")

        async def relay():
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:  # also when the client went away: the decode instance sees it and aborts
                await upstream.aclose()
        return StreamingResponse(relay(), media_type="text/event-stream")

    @app.get("/health")
    async def health():
        for url in filter(None, (prefill_url, decode_url)):
            try:
                r = await client.get(url.rstrip("/") + "/health")
                if r.status_code != 200:
                    return JSONResponse({"unhealthy": url}, 503)
            except httpx.HTTPError:
                return JSONResponse({"unreachable": url}, 503)
        return {"status": "ok"}

    app.router.on_shutdown.append(client.aclose)
    return app


async def is_short(client: httpx.AsyncClient, prefill_url: str, body: dict, path: str, headers: dict,
                   limit: int) -> bool:
    """Whether the request's one prompt has at most `limit` tokens (several prompts, or a prompt the
    prefill instance cannot count, go the disaggregated way, where any error is answered)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return len(prompt) <= limit
    if path.endswith("/chat/completions"):
        query = {"messages": body.get("messages"),
                 "add_generation_prompt": body.get("add_generation_prompt", True)}
    elif isinstance(prompt, str):
        query = {"prompt": prompt}
    else:
        return False
    r = await client.post(prefill_url.rstrip("/") + "/tokenize", json=dict(query, model=body.get("model")),
                          headers=headers)
    return r.status_code == 200 and r.json().get("count", limit + 1) <= limit


def add_proxy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prefill", help="URL of the kv_producer instance (none: each request goes to "
                   "--decode as is, e.g. a colocated instance behind the same hop in a benchmark)")
    p.add_argument("--decode", required=True, help="URL of the kv_consumer instance")
    p.add_argument("--local-prefill-tokens", type=int, default=0, metavar="N",
                   help="a prompt of at most N tokens prefills on the decode instance, no transfer "
                   "(0: every prompt on the prefill instance)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)


def cmd_proxy(args) -> None:
    import uvicorn
    for name in ("prefill", "decode"):
        if getattr(args, name) is not None and not getattr(args, name).startswith(("http://", "https://")):
            raise ValueError(f"--{name} must be an http(s) URL, got {getattr(args, name)!r}")
    if args.local_prefill_tokens < 0:
        raise ValueError(f"--local-prefill-tokens must be >= 0, got {args.local_prefill_tokens}")
    app = build_app(args.prefill, args.decode, local_prefill_tokens=args.local_prefill_tokens)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
