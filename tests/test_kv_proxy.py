"""The disaggregation proxy against stand-in prefill / decode instances (httpx mock transport)."""
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from longserve.entrypoints.proxy import build_app

PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p0", "remote_request_id": "7"}


def upstreams(log):
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        log.append((request.url.host, request.url.path, body))
        if request.url.path == "/tokenize":  # a word a token; chat: a token a message
            if body.get("prompt") == "uncountable":
                return httpx.Response(400, json={"error": {"message": "no tokenizer"}})
            count = len(body["messages"]) if "messages" in body else len(body["prompt"].split())
            return httpx.Response(200, json={"count": count})
        if request.url.host == "prefill":
            if body.get("prompt") == "bad":
                return httpx.Response(400, json={"error": {"message": "max_tokens too big"}})
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        if body.get("stream"):
            chunks = [b'data: {"choices": [{"text": "he"}]}\n\n', b'data: {"choices": [{"text": "llo"}]}\n\n',
                      b"data: [DONE]\n\n"]
            async def body_stream():
                for c in chunks:
                    yield c
            return httpx.Response(200, content=body_stream(), headers={"content-type": "text/event-stream"})
        return httpx.Response(200, json={"choices": [{"text": "hello"}]})
    return httpx.MockTransport(handler)


@pytest.mark.parametrize("stream", [False, True])
def test_proxy_sends_prefill_then_decode_with_params(stream):
    log = []
    app = build_app("http://prefill:1", "http://decode:2", transport=upstreams(log))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 9, "stream": stream},
                        headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        if stream:
            assert r.text.count("data:") == 3 and r.text.endswith("data: [DONE]\n\n")
        else:
            assert r.json()["choices"][0]["text"] == "hello"
    (h1, p1, prefill), (h2, p2, decode) = log
    assert (h1, h2, p1, p2) == ("prefill", "decode", "/v1/completions", "/v1/completions")
    assert prefill["max_tokens"] == 1 and prefill["stream"] is False
    assert prefill["kv_transfer_params"] == {"do_remote_decode": True}
    assert decode["max_tokens"] == 9 and decode["stream"] is stream and decode["kv_transfer_params"] == PARAMS


@pytest.mark.parametrize("stream", [False, True])
def test_proxy_without_prefill_relays_each_request_as_is(stream):
    """No --prefill: a colocated instance behind the same hop (benchmarks)."""
    log, req = [], {"prompt": "hi", "max_tokens": 9, "stream": stream}
    with TestClient(build_app(None, "http://decode:2", transport=upstreams(log))) as client:
        r = client.post("/v1/completions", json=req)
        assert r.status_code == 200 and "llo" in r.text
    assert log == [("decode", "/v1/completions", req)]


@pytest.mark.parametrize("path, request_body, local", [
    ("/v1/completions", {"prompt": [1, 2, 3]}, True),  # counted here: no /tokenize
    ("/v1/completions", {"prompt": [1, 2, 3, 4, 5]}, False),
    ("/v1/completions", {"prompt": "one two three"}, True),
    ("/v1/completions", {"prompt": "one two three four five"}, False),
    ("/v1/completions", {"prompt": "uncountable"}, False),  # the prefill instance will answer it
    ("/v1/completions", {"prompt": ["several", "prompts"]}, False),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 2}, True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}] * 5}, False),
])
def test_proxy_leaves_short_prompts_to_the_decode_instance(path, request_body, local):
    """--local-prefill-tokens 4: a prompt of at most 4 tokens goes to the decode instance as is."""
    log, req = [], dict(request_body, max_tokens=9, model="m")
    app = build_app("http://prefill:1", "http://decode:2", transport=upstreams(log), local_prefill_tokens=4)
    with TestClient(app) as client:
        assert client.post(path, json=req).status_code == 200
    asked = [(h, p) for h, p, _ in log if p != "/tokenize"]
    if local:
        assert asked == [("decode", path)] and log[-1][2] == req
    else:
        assert asked == [("prefill", path), ("decode", path)]
        assert log[-1][2]["kv_transfer_params"] == PARAMS
    counted = [b for _, p, b in log if p == "/tokenize"]
    assert len(counted) == (0 if isinstance(req.get("prompt"), list) else 1)
    if counted:  # the prefill instance counts as the server will (its model, the chat template)
        assert log[0][0] == "prefill" and counted[0]["model"] == "m"


def test_proxy_passes_prefill_errors_through():
    log = []
    with TestClient(build_app("http://prefill:1", "http://decode:2", transport=upstreams(log))) as client:
        r = client.post("/v1/chat/completions", json={"prompt": "bad", "messages": []})
        assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]
    assert [h for h, _, _ in log] == ["prefill"]  # the decode instance never saw it


@pytest.mark.timeout(30)
def test_client_gone_during_prefill_gets_no_decode():
    """A client that disconnects while the prefill runs: the decode instance is never asked
    (the prefill instance's blocks go back at the end of their lease)."""
    import asyncio
    log = []
    app = build_app("http://prefill:1", "http://decode:2", transport=upstreams(log))
    body = json.dumps({"prompt": "hi", "max_tokens": 9, "stream": True}).encode()
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent = []

    async def receive():
        if messages:
            return messages.pop(0)
        return {"type": "http.disconnect"}  # the client has gone

    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "root_path": "", "headers": [(b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    asyncio.run(app(scope, receive, send))
    assert [h for h, _, _ in log] == ["prefill"]
    assert sent[0]["status"] == 499


def test_proxy_cli_refuses_bad_urls(capsys):
    from longserve.entrypoints.cli import main
    with pytest.raises(SystemExit):
        main(["proxy", "--prefill", "localhost:8001", "--decode", "http://x:1"])
    assert "--prefill must be an http(s) URL" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["proxy", "--decode", "http://x:1", "--local-prefill-tokens", "-1"])
    assert "--local-prefill-tokens must be >= 0" in capsys.readouterr().err
