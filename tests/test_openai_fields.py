"""The server's fields: echo with logprobs, max_tokens 0, prompt_logprobs, refused and unknown
fields, logit_bias, /tokenize, /detokenize, /version, the start-up banner, request logging."""
import logging
import uuid

import httpx
import openai
import pytest

import longserve
from longserve import LLM, SamplingParams
from longserve.entrypoints.openai.api_server import banner
from test_openai_server import ENGINE, MODEL, TEMPLATE, ServerThread, assert_idle

PROMPT = [5, 17, 42, 99, 7, 250, 3, 64]


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def log():
    handler, server_log = Records(), logging.getLogger("longserve")
    server_log.addHandler(handler)
    level, server_log.level = server_log.level, logging.INFO
    yield handler
    server_log.removeHandler(handler)
    server_log.setLevel(level)


@pytest.fixture(scope="module")
def server(log):
    llms = []
    srv = ServerThread(lambda: (llms.append(LLM(MODEL, **ENGINE)) or llms[0]).engine)
    srv.wait_healthy()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ref():
    """Offline: the prompt's logprobs (top 2) and 3 greedy tokens with theirs."""
    llm = LLM(MODEL, **ENGINE)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                                prompt_logprobs=2))[0]
    llm.engine.shutdown()
    return out


def post(server, path, **body):
    return httpx.post(f"{server.url}{path}", json={"model": MODEL, **body}, timeout=60)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True])
def test_echo_logprobs_lead_with_the_prompt_as_offline(server, client, ref, stream):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                     temperature=0, stream=stream)
    chunks = list(resp) if stream else [resp]
    lp = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    tokens = [t for x in lp for t in x.tokens]
    token_lps = [v for x in lp for v in x.token_logprobs]
    tops = [t for x in lp for t in x.top_logprobs]
    names = server.core.tokenizer.decode
    ids = PROMPT + ref.outputs[0].token_ids
    assert tokens == [names([t], skip_special_tokens=False) for t in ids]
    assert token_lps[0] is None and tops[0] is None
    expected = [e[t] for e, t in zip(ref.prompt_logprobs[1:] + ref.outputs[0].logprobs, ids[1:])]
    assert token_lps[1:] == pytest.approx(expected, abs=1e-5)
    assert all(len(t) in (2, 3) for t in tops[1:])  # the top 2, and the token when not in them
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(server.core.decode(PROMPT)) and text.endswith(ref.outputs[0].text)


@pytest.mark.timeout(120)
def test_max_tokens_0_scores_the_prompt_without_generating(server, client, ref):
    resp = client.completions.create(model=MODEL, prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and resp.usage.completion_tokens == 0
    assert choice.text == server.core.decode(PROMPT)
    assert len(choice.logprobs.tokens) == len(PROMPT)
    expected = [e[t] for e, t in zip(ref.prompt_logprobs[1:], PROMPT[1:])]
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert post(server, "/v1/completions", prompt=PROMPT, max_tokens=0).json()["error"]["param"] == "max_tokens"
    assert_idle(server)


def check_vllm_prompt_logprobs(shaped, ref, prompt):
    assert shaped[0] is None and len(shaped) == len(prompt)
    for entry, expected, token in zip(shaped[1:], ref.prompt_logprobs[1:], prompt[1:]):
        got = {int(t): v for t, v in entry.items()}
        assert set(got) == set(expected)
        assert [got[t]["logprob"] for t in expected] == pytest.approx(list(expected.values()), abs=1e-5)
        ranks = sorted(v["rank"] for t, v in got.items() if t != token or len(got) == 2)
        assert ranks == [1, 2] and all(isinstance(v["decoded_token"], str) for v in got.values())
        likelier = sum(lp > expected[token] for lp in expected.values())  # of the top 2 offline
        assert (got[token]["rank"] == likelier + 1) if len(got) == 2 else got[token]["rank"] > 2


@pytest.mark.timeout(120)
def test_prompt_logprobs_on_completions_and_chat(server, ref):
    body = post(server, "/v1/completions", prompt=PROMPT, max_tokens=1, prompt_logprobs=2).json()
    check_vllm_prompt_logprobs(body["choices"][0]["prompt_logprobs"], ref, PROMPT)
    messages = [{"role": "user", "content": "hello there"}]
    chat = post(server, "/v1/chat/completions", messages=messages, max_tokens=2, prompt_logprobs=2).json()
    ids = post(server, "/tokenize", messages=messages).json()["tokens"]
    llm_ref = LLM(MODEL, **ENGINE)
    chat_ref = llm_ref.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    llm_ref.engine.shutdown()
    check_vllm_prompt_logprobs(chat["prompt_logprobs"], chat_ref, ids)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=dict(
            model=MODEL, messages=messages, max_tokens=2, prompt_logprobs=0, stream=True)) as r:
        firsts = [line for line in r.iter_lines() if '"prompt_logprobs":[null' in line]
    assert len(firsts) == 1


REFUSED = [("presence_penalty", 0.5), ("frequency_penalty", -1), ("repetition_penalty", 1.2),
           ("min_p", 0.1), ("use_beam_search", True), ("best_of", 2), ("suffix", "end"),
           ("bad_words", ["x"]), ("allowed_token_ids", [1, 2]), ("truncate_prompt_tokens", 4)]
CHAT_REFUSED = [("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
                ("tool_choice", "auto"), ("parallel_tool_calls", False),
                ("functions", [{"name": "f", "parameters": {}}]), ("function_call", "auto"),
                ("presence_penalty", 1.0), ("reasoning_effort", "high")]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path, field, value", [("/v1/completions", f, v) for f, v in REFUSED]
                         + [("/v1/chat/completions", f, v) for f, v in CHAT_REFUSED])
def test_a_field_the_server_cannot_honour_gets_a_400_naming_it(server, path, field, value):
    body = dict(prompt="hi") if "chat" not in path else dict(messages=MESSAGES)
    err = post(server, path, **body, max_tokens=2, **{field: value}).json()["error"]
    assert err["param"] == field and field in err["message"], err
    if field in ("tools", "tool_choice"):
        assert "no tool parser" in err["message"]


@pytest.mark.timeout(120)
def test_neutral_values_and_tool_choice_none_are_accepted(server, client):
    out = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, tool_choice="none", presence_penalty=0,
        frequency_penalty=0, user="u1", extra_body=dict(repetition_penalty=1.0, best_of=1))
    assert out.choices[0].finish_reason in ("length", "stop")
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, suffix=None, best_of=1)
    assert out.usage.completion_tokens >= 1


@pytest.mark.timeout(120)
def test_an_unknown_field_is_served_and_logged_once(server, log):
    field = f"made_up_{uuid.uuid4().hex[:6]}"
    for _ in range(2):
        assert post(server, "/v1/completions", prompt="hi", max_tokens=1, **{field: 3}).status_code == 200
        assert post(server, "/v1/chat/completions", messages=MESSAGES, max_tokens=1,
                    **{field: 3}).status_code == 200
    warned = [line for line in log.lines if field in line]
    assert len(warned) == 1 and "present in the request but ignored" in warned[0]


@pytest.mark.timeout(120)
def test_logit_bias_changes_the_greedy_token(server, client):
    def first(**kw):
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0,
                                         logprobs=0, **kw)
    plain = first()
    top = plain.choices[0].logprobs.tokens[0]
    greedy = server.core.encode(top, add_special_tokens=False)[0] if len(top) else None
    banned = first(logit_bias={str(greedy): -100}).choices[0]
    assert banned.logprobs.tokens[0] != top
    forced = first(logit_bias={"300": 100}).choices[0]
    assert forced.text == server.core.decode([300])
    # the logprob reported is the model's, not the biased one
    assert forced.logprobs.token_logprobs[0] < plain.choices[0].logprobs.token_logprobs[0]
    err = post(server, "/v1/completions", prompt="hi", logit_bias={"99999": 1}).json()["error"]
    assert err["param"] == "logit_bias" and "outside the vocabulary" in err["message"]


@pytest.mark.timeout(60)
def test_tokenize_detokenize_and_version(server):
    text = "hello world, tokens!"
    plain = post(server, "/tokenize", prompt=text, add_special_tokens=False).json()
    assert plain["tokens"] == server.core.encode(text, add_special_tokens=False)
    assert plain["count"] == len(plain["tokens"]) and plain["max_model_len"] == ENGINE["max_model_len"]
    assert post(server, "/detokenize", tokens=plain["tokens"]).json() == {"prompt": text}
    special = post(server, "/tokenize", prompt=text).json()
    assert special["tokens"] == server.core.encode(text)
    chat = post(server, "/tokenize", messages=MESSAGES).json()
    assert chat["tokens"] == server.core.encode_chat(MESSAGES, TEMPLATE)["prompt_token_ids"]
    assert post(server, "/tokenize").json()["error"]["param"] == "prompt"
    assert post(server, "/detokenize", tokens=[99999]).json()["error"]["param"] == "tokens"
    assert httpx.get(f"{server.url}/version").json() == {"version": longserve.__version__}


@pytest.mark.timeout(60)
def test_banner_and_request_log(server, log):
    lines = banner(server.core.info())
    assert all(line in log.lines for line in lines)
    text = "\n".join(lines)
    assert "KV cache: 64 blocks of 16 tokens = 1024 tokens" in text
    assert "Maximum concurrency for 256 tokens per request: 4.00x" in text
    assert "tp=1 pcp=1 dcp=1 dp=1 on 1 x cpu" in text and "CUDA graph capture" in text
    count = lambda: sum("prompt tokens" in line for line in log.lines)  # noqa: E731
    before = count()
    post(server, "/v1/completions", prompt=PROMPT, max_tokens=1)
    assert count() == before  # off by default
    server.core.log_requests = True
    try:
        post(server, "/v1/completions", prompt=PROMPT, max_tokens=1)
    finally:
        server.core.log_requests = False
    logged = [line for line in log.lines if "prompt tokens" in line]
    assert count() == before + 1 and f": {len(PROMPT)} prompt tokens" in logged[-1]


@pytest.mark.timeout(300)
def test_lm_eval_loglikelihood_requests_match_hf_transformers(smollm2_gguf, hf_smollm2_tokenizer, hf_smollm2):
    """What lm-eval's local-completions sends for a loglikelihood (echo, logprobs=1, max_tokens
    1, temperature 0; the text of context + continuation tokens) against SmolLM2, scored as
    lm-eval does (token_logprobs[ctxlen:-1]), equals HF transformers on the same GGUF."""
    import json

    import torch
    tok, hf = hf_smollm2_tokenizer, hf_smollm2
    llm = LLM(smollm2_gguf, device="cpu", max_model_len=512)  # held: the server serves its engine
    srv = ServerThread(lambda: llm.engine)
    try:
        srv.wait_healthy(120)
        docs = [json.loads(line) for line in open("benchmarks/lm_eval/longserve_mc.jsonl")][:2]
        for doc in docs:
            ctx = tok(f"Question: {doc['question']}\nAnswer:")["input_ids"]
            for choice in doc["choices"]:
                ids = ctx + tok(f" {choice}")["input_ids"]
                body = dict(model=MODEL, prompt=tok.decode(ids), echo=True, logprobs=1, max_tokens=1,
                            temperature=0, seed=1234)
                got = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()
                lps = got["choices"][0]["logprobs"]["token_logprobs"]
                assert len(lps) == len(ids) + 1
                with torch.no_grad():
                    ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
                want = sum(ref[i - 1, ids[i]].item() for i in range(len(ctx), len(ids)))
                assert sum(lps[len(ctx):-1]) == pytest.approx(want, abs=1e-3)
                scored = httpx.post(f"{srv.url}/v1/completions", json=dict(body, max_tokens=0)).json()
                assert scored["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(lps[:-1])
    finally:
        srv.stop()
