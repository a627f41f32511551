"""The OpenAI-compatible server, driven by the official `openai` client over a loopback port."""
import asyncio
import json
import random
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from longserve import LLM, SamplingParams
from longserve.engine.llm_engine import LLMEngine
from longserve.engine.executor import free_port
from longserve.entrypoints.openai.api_server import build_app
from longserve.entrypoints.openai.serving_engine import SSEResponse

MODEL = "builtin:llama-tiny"
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ENGINE = dict(device="cpu", max_model_len=256, block_size=16, num_gpu_blocks=64)  # 1024 tokens: 64 streams preempt


class ServerThread:
    """uvicorn on a thread of the test process (so tests can look inside the engine core)."""

    def __init__(self, load_core, **app_kwargs):
        self.port = free_port()
        self.app = build_app(load_core, [MODEL], chat_template=TEMPLATE, **app_kwargs)
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def core(self) -> LLMEngine:
        return self.app.state.longserve.core

    def wait_healthy(self, timeout=60):
        deadline = time.monotonic() + timeout
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.05)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def server():
    llms = []
    srv = ServerThread(lambda: (llms.append(LLM(MODEL, **ENGINE)) or llms[0]).engine)
    srv.wait_healthy()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def ref():
    return LLM(MODEL, **ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def token_ids(logprobs_tokens):
    return [int(t.removeprefix("token_id:")) for t in logprobs_tokens]


def metrics(server) -> dict:
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted({"model_name": MODEL, **labels}.items()))), 0.0)


def assert_idle(server, timeout=10.0):
    """Nothing running or waiting and no KV block held (checked through /metrics and inside)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        idle = [metric(m, f"vllm:{n}") for n in ("num_requests_running", "num_requests_waiting",
                                                 "kv_cache_usage_perc")] == [0, 0, 0]
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle, m
    kv = server.core.core.kv
    assert kv.num_free_blocks == kv.num_blocks and not any(kv.ref_cnt)


@pytest.mark.timeout(120)
def test_completion_stream_equals_nonstream_equals_generate(server, client, ref):
    prompt = "Once upon a time"
    kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=0,
              extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True))
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    want = ref.generate([prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0]
    assert token_ids(full.choices[0].logprobs.tokens) == want.outputs[0].token_ids
    assert full.choices[0].text == want.outputs[0].text
    assert full.choices[0].finish_reason == "length"
    streamed = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in streamed) == full.choices[0].text
    assert sum((token_ids(c.choices[0].logprobs.tokens) for c in streamed), []) == want.outputs[0].token_ids
    assert streamed[-1].choices[0].finish_reason == "length"
    n_prompt = len(want.prompt_token_ids)
    assert full.usage.prompt_tokens == n_prompt and full.usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == n_prompt and chunks[-1].usage.completion_tokens == 24
    assert_idle(server)


@pytest.mark.timeout(120)
def test_token_id_prompts_and_batches(server, client, ref):
    prompts = [[1, 40, 41, 42], [1, 7, 8, 9, 10, 11]]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0,
                                    extra_body=dict(ignore_eos=True, return_token_ids=True))
    want = ref.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.text for c in choices] == [w.outputs[0].text for w in want]
    assert [c.token_ids for c in choices] == [w.outputs[0].token_ids for w in want]
    texts = ["", ""]
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0,
                                           stream=True, extra_body=dict(ignore_eos=True)):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [w.outputs[0].text for w in want]
    assert out.usage.prompt_tokens == 10 and out.usage.completion_tokens == 12
    echo = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0, echo=True)
    assert echo.choices[0].text.startswith("Hello there")


@pytest.mark.timeout(120)
def test_chat_stream_equals_nonstream_equals_generate(server, client, ref):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]
    kw = dict(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0, logprobs=True,
              top_logprobs=2, extra_body=dict(ignore_eos=True, return_tokens_as_token_ids=True))
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    ids = ref.engine.encode_chat(messages, TEMPLATE)["prompt_token_ids"]
    want = ref.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    got = full.choices[0]
    assert token_ids(t.token for t in got.logprobs.content) == want.token_ids
    assert got.message.content == want.text and got.message.role == "assistant"
    assert all(len(t.top_logprobs) >= 2 for t in got.logprobs.content)
    streamed = [c for c in chunks if c.choices]
    assert streamed[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == want.text
    assert streamed[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == len(ids) and chunks[-1].usage.completion_tokens == 16


@pytest.mark.timeout(120)
def test_stop_string_stream_and_not(server, client):
    kw = dict(model=MODEL, prompt="Context parallelism", max_tokens=20, temperature=0,
              extra_body=dict(ignore_eos=True))
    free = client.completions.create(**kw).choices[0].text
    stop = next(free[i:i + 2] for i in range(4, len(free) - 2) if "\ufffd" not in free[i:i + 2])
    cut = free[:free.index(stop)]
    full = client.completions.create(**kw, stop=[stop])
    assert full.choices[0].text == cut and full.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kw, stop=[stop], stream=True))
    assert streamed == cut
    assert_idle(server)


@pytest.mark.timeout(120)
def test_logprobs(server, client):
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=5, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 3 <= len(top) <= 4
        assert value == pytest.approx(max(top.values()))  # greedy takes the most likely token


@pytest.mark.timeout(180)
def test_64_concurrent_streams_finish_and_the_pool_is_whole(server):
    rng = random.Random(0)
    jobs = [(rng.randint(1, 60), rng.randint(1, 32)) for _ in range(64)]

    async def one(aclient, n_prompt, n_out):
        prompt = [rng.randint(3, 500) for _ in range(n_prompt)]
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=n_out, stream=True,
                                                  temperature=0.8, seed=n_prompt,
                                                  stream_options={"include_usage": True},
                                                  extra_body=dict(ignore_eos=True))
        chunks = [c async for c in stream]
        return chunks[-2].choices[0].finish_reason, chunks[-1].usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*[one(aclient, p, o) for p, o in jobs])

    before = metric(metrics(server), "vllm:num_preemptions_total")
    results = asyncio.run(main())
    assert results == [("length", o) for _, o in jobs]
    assert_idle(server)
    assert metric(metrics(server), "vllm:num_preemptions_total") > before  # the pool ran short


@pytest.mark.timeout(120)
def test_client_disconnects_mid_stream_free_their_blocks(server):
    before = metric(metrics(server), "vllm:request_success_total", finished_reason="abort")
    body = dict(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=200, stream=True, ignore_eos=True,
                return_token_ids=True)  # a chunk every step, even while text is held back
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for _ in range(4):
            with http.stream("POST", "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
                assert server.core.core.kv.num_free_blocks < server.core.core.kv.num_blocks
            # leaving the block closes the connection mid-stream
    assert_idle(server)
    assert metric(metrics(server), "vllm:request_success_total", finished_reason="abort") == before + 4


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", dict(prompt="hi", best_of=2), "best_of"),
    ("/v1/completions", dict(prompt="hi", n=0), "n"),
    ("/v1/completions", dict(prompt="hi", temperature=-1), "temperature"),
    ("/v1/completions", dict(prompt="hi", top_p=0), "top_p"),
    ("/v1/completions", dict(prompt="hi", max_tokens=0), "max_tokens"),
    ("/v1/completions", dict(prompt="hi", logprobs=21), "logprobs"),
    ("/v1/completions", dict(prompt=[5] * 300), "prompt"),  # longer than max_model_len
    ("/v1/completions", dict(prompt=[5] * 200, max_tokens=100), "max_tokens"),
    ("/v1/completions", dict(prompt=[5, 99999]), "prompt"),  # outside the vocabulary
    ("/v1/completions", dict(prompt=[]), "prompt"),
    ("/v1/completions", dict(), "prompt"),
    ("/v1/completions", dict(prompt="hi", presence_penalty=1.0), "presence_penalty"),
    ("/v1/chat/completions", dict(messages=[]), "messages"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], top_logprobs=2), "top_logprobs"),
])
def test_bad_request_gets_400_naming_the_field_and_the_next_succeeds(server, path, body, param):
    resp = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body})
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json=dict(model=MODEL, prompt="hi", max_tokens=2))
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.timeout(60)
def test_errors_name_the_field_or_the_position_in_words(server, client):
    def error(status, path="/v1/completions", headers={"content-type": "application/json"}, **kw):
        resp = httpx.post(f"{server.url}{path}", headers=headers, **kw)
        assert resp.status_code == status, resp.text
        return resp.json()["error"]
    err = error(400, content=b'{"model": "x",\n "prompt": nope}')
    assert err["message"] == "invalid JSON at line 2 column 12: Expecting value" and err["param"] is None
    err = error(415, content=b'{"prompt": "hi"}', headers={"content-type": "text/plain"})
    assert "application/json" in err["message"] and "text/plain" in err["message"]
    err = error(404, json=dict(model="gpt-4", prompt="hi"))
    assert err["code"] == "model_not_found" and err["param"] == "model" and "gpt-4" in err["message"]
    err = error(400, "/v1/chat/completions", json=dict(messages=[{"role": "user", "content": "a"},
                                                                 {"role": "wizard", "content": "b"}]))
    assert err["param"] == "messages[1].role" and "'assistant'" in err["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="best_of must be 1"):
        client.completions.create(model=MODEL, prompt="hi", best_of=3)
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.timeout(60)
def test_api_key_and_overload(server):
    state = server.app.state.longserve
    state.api_key = "secret"
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{server.url}/v1", api_key="secret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(f"{server.url}/health").status_code == 200  # health needs no key
    finally:
        state.api_key = None
    server.core.max_waiting = 0
    try:
        resp = httpx.post(f"{server.url}/v1/completions", json=dict(model=MODEL, prompt="hi"))
        assert resp.status_code == 503 and resp.headers["retry-after"] and resp.json()["error"]["code"] == "overloaded"
    finally:
        server.core.max_waiting = None


@pytest.mark.timeout(120)
def test_metrics_counters_match_what_was_sent(server, client):
    before = metrics(server)
    jobs = [([1, 2, 3], 4), ([1] * 10, 7), ([9, 8, 7, 6, 5], 1)]
    for prompt, n in jobs:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, extra_body=dict(ignore_eos=True))
    after = metrics(server)
    delta = lambda name, **lb: metric(after, name, **lb) - metric(before, name, **lb)  # noqa: E731
    assert delta("vllm:prompt_tokens_total") == 18
    assert delta("vllm:generation_tokens_total") == 12
    assert delta("vllm:request_success_total", finished_reason="length") == 3
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 12 - 3
    assert delta("vllm:prefix_cache_queries_total") == 18
    assert metric(after, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == \
        metric(after, "vllm:time_to_first_token_seconds_count")


@pytest.mark.timeout(120)
def test_503_while_loading_and_after_a_fatal_engine_error():
    release, llms = threading.Event(), []

    def load():
        release.wait(30)
        llms.append(LLM(MODEL, **ENGINE))
        return llms[0].engine

    srv = ServerThread(load)
    try:
        assert httpx.get(f"{srv.url}/health").status_code == 503
        resp = httpx.post(f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt="hi"))
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "loading"
        release.set()
        srv.wait_healthy()
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=30)
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].text is not None

        executor = srv.core.core.executor
        real_execute = executor.execute_async

        def execute(plan):  # a few good steps, then the engine breaks
            if len(execute.calls) >= 3:
                raise RuntimeError("boom")
            execute.calls.append(plan)
            return real_execute(plan)
        execute.calls = []
        executor.execute_async = execute
        with pytest.raises(openai.APIError, match="boom"):
            list(client.completions.create(model=MODEL, prompt="hi", max_tokens=50, stream=True))
        assert httpx.get(f"{srv.url}/health").status_code == 503
        resp = httpx.post(f"{srv.url}/v1/completions", json=dict(model=MODEL, prompt="hi"))
        assert resp.status_code == 503 and "boom" in resp.json()["error"]["message"]
    finally:
        release.set()
        srv.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path, body, aborted", [
    ("/v1/completions", dict(prompt="Once upon a time"), 1),
    ("/v1/completions", dict(prompt=["Hello", "Bye"], n=2), 4),  # every choice of every prompt
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}]), 1),
])
def test_a_dropped_non_streamed_request_is_aborted_within_a_second(server, path, body, aborted):
    before = metric(metrics(server), "vllm:request_success_total", finished_reason="abort")
    executor = server.core.core.executor
    execute = executor.execute_async
    executor.execute_async = lambda plan: time.sleep(0.02) or execute(plan)  # 200 tokens: 4 s

    async def drop() -> float:
        async with httpx.AsyncClient(base_url=server.url) as http:
            sent = asyncio.create_task(http.post(path, json=dict(model=MODEL, max_tokens=200,
                                                                 ignore_eos=True, **body)))
            while metric(metrics(server), "vllm:num_requests_running") == 0:
                await asyncio.sleep(0.02)
            sent.cancel()  # the client gives up: its connection closes
            return time.monotonic()
    try:
        dropped = asyncio.run(drop())
        assert_idle(server, timeout=1.0)  # running 0, KV usage 0 in /metrics; every block free
        assert time.monotonic() - dropped < 1.5
    finally:
        executor.execute_async = execute
    assert metric(metrics(server), "vllm:request_success_total", finished_reason="abort") == before + aborted


@pytest.mark.timeout(60)
def test_streams_whose_client_left_before_the_first_byte_leave_nothing_running(server):
    executor = server.core.core.executor
    execute = executor.execute_async
    executor.execute_async = lambda plan: time.sleep(0.02) or execute(plan)  # 200 tokens: 4 s
    try:
        for path, body in [("/v1/completions", dict(prompt="Hi", n=2)),
                           ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}]))]:
            data = json.dumps(dict(model=MODEL, max_tokens=200, ignore_eos=True, stream=True, **body))
            for _ in range(3):  # sent, then the connection closes at once
                with socket.create_connection(("127.0.0.1", server.port)) as sock:
                    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 f"Content-Length: {len(data)}\r\n\r\n{data}".encode())
        assert_idle(server, timeout=1.0)
    finally:
        executor.execute_async = execute


def test_an_sse_response_aborts_its_requests_also_when_it_never_started():
    aborted = []

    async def frames():
        yield b"data: never sent\n\n"

    async def gone():  # the client left before the first byte
        return {"type": "http.disconnect"}

    async def send(message):
        pass
    response = SSEResponse(frames(), SimpleNamespace(abort=aborted.append),
                           [SimpleNamespace(request_id="a"), SimpleNamespace(request_id="b")])
    asyncio.run(response({"type": "http"}, gone, send))
    assert aborted == ["a", "b"]


def health_latencies_while(server, send) -> tuple[list[float], object]:
    """/health's latencies (s) while `send()` runs on a thread; and what it returned."""
    out, latencies = [], []
    sender = threading.Thread(target=lambda: out.append(send()))
    sender.start()
    while sender.is_alive():
        t0 = time.perf_counter()
        assert httpx.get(f"{server.url}/health").status_code == 200
        latencies.append(time.perf_counter() - t0)
    sender.join()
    return latencies, out[0]


@pytest.mark.timeout(60)
def test_a_10mb_body_gets_413_before_it_is_read_and_health_answers_meanwhile(server):
    body = b'{"model": "%s", "prompt": "%s"}' % (MODEL.encode(), b"a" * (10 << 20))

    def chunks():  # no Content-Length: the bytes read are counted
        for i in range(0, len(body), 1 << 20):
            yield body[i:i + (1 << 20)]
    for content in (body, chunks()):
        latencies, resp = health_latencies_while(server, lambda: httpx.post(
            f"{server.url}/v1/completions", content=content, timeout=30,
            headers={"content-type": "application/json"}))
        assert resp.status_code == 413 and "--max-request-body-mb (8 MB)" in resp.json()["error"]["message"]
        assert max(latencies, default=0) < 1.0  # ~ms on an idle machine (the target: 100 ms)
    assert_idle(server)


@pytest.mark.timeout(60)
def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    prompt = "hello world " * 150_000  # 1.8 MB, ~1 s of tokenizing: then refused (too long)
    latencies, resp = health_latencies_while(server, lambda: httpx.post(
        f"{server.url}/v1/completions", json=dict(model=MODEL, prompt=prompt), timeout=60))
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert len(latencies) > 3 and max(latencies) < 1.0
