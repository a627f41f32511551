"""Structured outputs (xgrammar): a constrained random-weight model still writes valid JSON,
regex matches and choices; bad grammars are refused at the door; the mask keeps the tokens of
asynchronous scheduling and of tp=2; abort and preemption leave the pool whole; the server's
response_format / structured_outputs / guided_* through the official openai client."""
import json
import re
import threading
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
import torch
import uvicorn
from hypothesis import given, settings, strategies as st
from pydantic import BaseModel

from conftest import per_request
from longserve import LLM, SamplingParams
from longserve.engine.executor import free_port
from longserve.engine.messages import ADD, EngineCoreRequest, decode_command, encode
from longserve.entrypoints.openai.api_server import build_app
from longserve.sampling_params import StructuredOutputsParams as SO
from longserve.tokenizer import load_tokenizer
from longserve.worker.sampler import apply_token_bitmask

MODEL = "builtin:llama-tiny"  # 512 logits, a 485-token tokenizer: the rest must stay masked
ENGINE = dict(device="cpu", max_model_len=512)
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "n"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"type": "string", "maxLength": 5}}}
REGEX = r"[a-c]{3}-\d\d"
CHOICES = ["yes", "no", "maybe so"]
PROMPTS = ["hello there", "Once upon a time", "def add(a, b):", "The quick brown fox"]


def loads(text: str):
    """xgrammar 0.2.8 writes a maxLength string as [^"\\\r\n]{0,n}: raw control characters
    (which strict JSON refuses inside strings) can appear there."""
    return json.loads(text, strict=False)


@pytest.fixture(scope="module")
def llm():
    with LLM(MODEL, **ENGINE) as llm:
        yield llm


def sampled(so, n=8, **kw):
    """n requests: greedy and seeded sampling at temperatures 0.7 and 1."""
    return [SamplingParams(temperature=0 if i == 0 else 0.7 + 0.3 * (i % 2), seed=i,
                           max_tokens=kw.get("max_tokens", 100), structured_outputs=so)
            for i in range(n)]


def texts(llm, params, prompts=PROMPTS):
    outs = llm.generate([prompts[i % len(prompts)] for i in range(len(params))], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_params_validate_and_round_trip_to_the_core():
    for kw in [dict(), dict(json=SCHEMA, regex="a"), dict(choice=[]), dict(choice=[1]),
               dict(regex=3), dict(json_object="yes")]:
        with pytest.raises(ValueError, match="structured_outputs"):
            SO(**kw)
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})
    for so in [SO(json=SCHEMA), SO(json=json.dumps(SCHEMA)), SO(regex=REGEX), SO(choice=CHOICES),
               SO(grammar='root ::= "a" | "b"'), SO(json_object=True)]:
        params = SamplingParams(structured_outputs=so).canonical()
        req = decode_command(ADD, encode(EngineCoreRequest("1", [1, 2], params)))
        assert req.sampling_params == params and req.sampling_params.structured_outputs.key == so.key


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 100), st.data())
def test_bitmask_keeps_exactly_the_allowed_tokens_of_its_rows(vocab, data):
    """Bit j of word w allows token 32 w + j; masked rows keep exactly those (ids past the
    mask's width, a vocabulary padded beyond the tokenizer, are masked), others are untouched."""
    n = data.draw(st.integers(1, 5))
    rows = sorted(data.draw(st.sets(st.integers(0, n - 1))))
    covered = data.draw(st.integers(1, vocab))  # the ids the grammar's tokenizer has
    words = -(-covered // 32)
    bits = data.draw(st.lists(st.booleans(), min_size=len(rows) * covered, max_size=len(rows) * covered))
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
    allowed[:, :covered] = torch.tensor(bits, dtype=torch.bool).reshape(len(rows), covered)
    padded = torch.zeros(len(rows), words * 32, dtype=torch.int64)
    padded[:, :covered] = allowed[:, :covered].long()
    bitmask = (padded.reshape(len(rows), words, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(bitmask >= 2 ** 31, bitmask - 2 ** 32, bitmask).to(torch.int32)
    logits = torch.randn(n, vocab)
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask, rows)
    for i in range(n):
        keep = allowed[rows.index(i)] if i in rows else torch.ones(vocab, dtype=torch.bool)
        assert torch.equal(masked[i][keep], logits[i][keep])
        assert bool((masked[i][~keep] == float("-inf")).all())


@pytest.mark.timeout(60)  # waits on the mask thread
def test_the_mask_covers_the_tokenizer_and_leaves_the_padded_ids_out(llm):
    """xgrammar sees the 485 ids the tokenizer has (not 512: each accept scans the ids past
    them); no bit past them is set. The mask thread first accepts each row's pending tokens;
    a token the grammar refuses is kept as `rejected` and the matcher stays where it was."""
    from types import SimpleNamespace
    from longserve.engine.structured_output import GrammarState, StructuredOutputManager
    from longserve.step_plan import DecodeRows, SchedulerOutput
    manager = StructuredOutputManager(llm.config.model)
    compiler = manager.compiler()
    grammar = compiler.compile("json", json.dumps(SCHEMA))
    assert compiler.mask_vocab == 485 < llm.config.model.vocab_size
    tok = load_tokenizer(llm.config.model).tokenizer
    texts = ['{"color": "red", "n": 3, "tag": "', '{"color": "red", "n": 3}', '', 'x{']
    reqs = {str(i): SimpleNamespace(grammar=GrammarState(compiler.xgr.GrammarMatcher(grammar)))
            for i in range(len(texts))}
    for i, text in enumerate(texts):
        reqs[str(i)].grammar.pending = tok.encode(text, add_special_tokens=False).ids
    out = SchedulerOutput(decodes=DecodeRows(req_ids=list(reqs)))
    mask, rows = manager.start_bitmask(out, reqs).result()
    assert [r.grammar.pending for r in reqs.values()] == [[]] * 4  # taken by the mask thread
    bits = ((mask[:, :, None].long() >> torch.arange(32)) & 1).flatten(1)
    assert rows == [0, 1, 2, 3] and mask.shape[1] == 16 and bits[:, 485:].sum() == 0  # 485 ids
    assert bits[0, :485].sum() > 100 and bits[1, :485].tolist() == [int(t == 2) for t in range(485)]
    assert [r.grammar.rejected is not None for r in reqs.values()] == [False, False, False, True]
    assert torch.equal(bits[3], bits[2])  # the refused 'x' left it at the start, '{' unseen
    manager.shutdown()


@pytest.mark.timeout(120)
def test_through_the_engine_core_process(monkeypatch, llm):
    """The core process loads the tokenizer and compiles the grammar itself."""
    params = sampled(SO(json=SCHEMA), 2) + sampled(SO(choice=CHOICES), 2)
    want = [o.token_ids for o in texts(llm, params)]
    monkeypatch.setenv("LONGSERVE_ENABLE_MULTIPROCESSING", "1")
    with LLM(MODEL, **ENGINE) as mp:
        assert [o.token_ids for o in texts(mp, params)] == want


@pytest.mark.timeout(120)
def test_json_schema_with_enum_and_required_always_validates(llm, pool_whole):
    outs = texts(llm, sampled(SO(json=SCHEMA), 12))
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(loads(o.text), SCHEMA)
        assert all(t < 485 for t in o.token_ids)  # the tokenizer's tokens (EOS is 2)
    n3 = llm.generate(["hi"], SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=100,
                                             structured_outputs=SO(json=SCHEMA)), use_tqdm=False)
    assert len({o.text for o in n3[0].outputs}) > 1  # each choice has a matcher of its own
    for o in n3[0].outputs:
        jsonschema.validate(loads(o.text), SCHEMA)
    pool_whole(llm)


@pytest.mark.timeout(120)
def test_regex_choice_grammar_and_json_object(llm, pool_whole):
    for o in texts(llm, sampled(SO(regex=REGEX))):
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
    for o in texts(llm, sampled(SO(choice=CHOICES))):
        assert o.finish_reason == "stop" and o.text in CHOICES, o.text
    for o in texts(llm, sampled(SO(grammar='root ::= "(" [0-9]{1,3} ")" | "none"'))):
        assert o.finish_reason == "stop" and re.fullmatch(r"\(\d{1,3}\)|none", o.text), o.text
    # any JSON object: a random model writes long keys; these seeds end within 300 tokens
    params = [SamplingParams(temperature=t, seed=s, max_tokens=300, structured_outputs=SO(json_object=True))
              for s, t in [(1, 0.5), (4, 1.0), (5, 0.5), (5, 1.0)]]
    for o in texts(llm, params, ["hello there"]):
        assert o.finish_reason == "stop" and isinstance(json.loads(o.text), dict), o.text
    pool_whole(llm)


@pytest.mark.timeout(120)
def test_bad_grammar_is_refused_at_the_door_and_nothing_is_queued(llm, pool_whole):
    good = SamplingParams(max_tokens=4)
    for so, field in [(SO(json={"type": "objectx"}), "json"), (SO(json="{not json"), "json"),
                      (SO(regex="(unclosed"), "regex"), (SO(grammar="root ::= undefined_rule"), "grammar")]:
        with pytest.raises(ValueError, match=rf"structured_outputs\.{field}: xgrammar cannot compile"):
            llm.generate(["a", "b"], [good, SamplingParams(structured_outputs=so)], use_tqdm=False)
    assert llm.engine.output.num_unfinished == 0
    with llm.engine.client.paused() as core:  # past the door: the core ends it with the error
        core.add_request(EngineCoreRequest("bad", [1, 2, 3], SamplingParams(
            structured_outputs=SO(regex="(open")).canonical()))
        outs = []
        while core.has_work():
            outs += per_request(core.step())
    assert [(o.request_id, o.finish_reason) for o in outs] == [("bad", "error")]
    assert "structured_outputs.regex" in outs[0].error
    pool_whole(llm)


@pytest.mark.timeout(180)
def test_async_scheduling_on_and_off_give_the_same_tokens():
    """Chunked prefill beside decodes, structured and free requests in one batch."""
    params = sampled(SO(json=SCHEMA), 4) + sampled(SO(regex=REGEX), 3) + [SamplingParams(max_tokens=20, seed=3)]
    prompts = [p * (1 + i % 3) for i, p in enumerate(PROMPTS * 2)]
    runs = []
    for asynchronous in (False, True):
        with LLM(MODEL, **ENGINE, async_scheduling=asynchronous, max_num_batched_tokens=16) as llm:
            runs.append([(o.token_ids, o.finish_reason) for o in texts(llm, params, prompts)])
    assert runs[0] == runs[1]
    assert all(reason == "stop" for _, reason in runs[0][:7])


@pytest.mark.timeout(240)
def test_tp2_gives_the_tokens_of_one_rank(llm):
    params = sampled(SO(json=SCHEMA), 4) + sampled(SO(choice=CHOICES), 2)
    want = [o.token_ids for o in texts(llm, params)]
    with LLM(MODEL, **ENGINE, tensor_parallel_size=2) as tp2:
        assert [o.token_ids for o in texts(tp2, params)] == want


@pytest.mark.timeout(180)
def test_preemption_and_abort_leave_the_pool_whole_and_outputs_valid(llm, pool_whole):
    """A pool of 8 blocks of 16 tokens for 6 requests of ~50 tokens: recomputes after
    preemption must not feed the matcher twice (the outputs equal the unpreempted ones)."""
    params = sampled(SO(json=SCHEMA), 6)
    want = [o.token_ids for o in texts(llm, params)]
    with LLM(MODEL, **ENGINE, num_gpu_blocks=8, block_size=16) as small:
        outs = small.generate([PROMPTS[i % 4] for i in range(6)], params, use_tqdm=False)
        assert sum(o.metrics["num_preemptions"] for o in outs) > 0
        assert [o.outputs[0].token_ids for o in outs] == want
        pool_whole(small)
        # aborted while compiling, waiting and running
        eng = small.engine
        reqs = [eng.make_request(p, SamplingParams(max_tokens=80, structured_outputs=SO(json=SCHEMA)))
                for p in PROMPTS]
        with eng.client.paused() as core:
            for r in reqs:
                core.add_request(r)
            core.abort_requests([reqs[0].request_id])
            for _ in range(3):
                core.step()
            core.abort_requests([r.request_id for r in reqs[1:]])
            while core.has_work():
                core.step()
        pool_whole(small)


# ---- the server ---------------------------------------------------------------------------
class Server:
    def __init__(self, engine, name):
        self.port = free_port()
        app = build_app(lambda: engine, [name])
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.port}"
        while not self.server.started:
            time.sleep(0.02)
        deadline = time.monotonic() + 120  # loaded and warmed up (the first SSE, a chat)
        while httpx.get(f"{self.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the server did not become healthy"
            time.sleep(0.05)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(llm):
    srv = Server(llm.engine, MODEL)
    yield srv
    srv.stop()


@pytest.mark.timeout(120)
def test_server_response_format_structured_outputs_and_guided_fields(server, llm, pool_whole):
    c = server.client
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True}}
    for seed in range(4):  # the tiny model has no chat template: completions
        r = c.completions.create(model=MODEL, prompt="hi", max_tokens=100, temperature=1.0, seed=seed,
                                 extra_body=dict(response_format=fmt))
        jsonschema.validate(loads(r.choices[0].text), SCHEMA)
    for extra, ok in [(dict(structured_outputs={"regex": REGEX}), lambda t: re.fullmatch(REGEX, t)),
                      (dict(guided_regex=REGEX), lambda t: re.fullmatch(REGEX, t)),
                      (dict(guided_choice=CHOICES), lambda t: t in CHOICES),
                      (dict(guided_json=SCHEMA), lambda t: jsonschema.validate(loads(t), SCHEMA) is None),
                      (dict(guided_grammar='root ::= "x" [0-9]'), lambda t: re.fullmatch(r"x\d", t)),
                      (dict(response_format={"type": "json_object"}), lambda t: isinstance(json.loads(t), dict)),
                      (dict(response_format={"type": "text"}), lambda t: True)]:
        r = c.completions.create(model=MODEL, prompt="hi", max_tokens=300, temperature=1.0, seed=5,
                                 extra_body=extra)
        assert ok(r.choices[0].text), (extra, r.choices[0].text)
    pool_whole(llm)


@pytest.mark.timeout(60)
def test_server_bad_schema_is_a_400_naming_the_field(server, llm, pool_whole):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    for body, field in [(dict(response_format=bad), "response_format"),
                        (dict(structured_outputs={"regex": "(open"}), "structured_outputs"),
                        (dict(structured_outputs={"jsn": {}}), "structured_outputs"),
                        (dict(guided_json={"type": "objectx"}), "guided_json"),
                        (dict(guided_choice=[]), "guided_choice"),
                        (dict(guided_regex="a", guided_choice=["a"]), "guided_choice"),
                        (dict(response_format={"type": "json_schema"}), "response_format"),
                        (dict(response_format={"type": "json_schema",  # a hint only: not offered
                                               "json_schema": {"name": "x", "schema": SCHEMA,
                                                               "strict": False}}), "response_format")]:
        for route, base in [("completions", dict(prompt="hi")),
                            ("chat/completions", dict(messages=[{"role": "user", "content": "hi"}]))]:
            r = httpx.post(f"{server.url}/v1/{route}", json=dict(base, model=MODEL, **body), timeout=30)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (body, r.text)
    assert llm.engine.output.num_unfinished == 0
    pool_whole(llm)


class City(BaseModel):
    name: str
    country: str
    size: Literal["small", "medium", "large"]
    population: int


@pytest.mark.timeout(300)
def test_chat_completions_parse_on_smollm2(smollm2_gguf):
    """The real model through `client.beta.chat.completions.parse(response_format=City)`:
    5 prompts here (20 take ~1 min on a shared 2-core CPU; all validated when run by hand)."""
    with LLM(smollm2_gguf, device="cpu", max_model_len=1024) as smol:
        srv = Server(smol.engine, "smollm2")
        try:
            out = [None] * 5

            def one(i):
                r = srv.client.beta.chat.completions.parse(
                    model="smollm2", response_format=City, max_tokens=200, temperature=0.7, seed=i,
                    messages=[{"role": "user", "content": f"Describe city number {i} as JSON."}])
                out[i] = r.choices[0].message.parsed
            threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(240)
            assert all(isinstance(city, City) for city in out), out
        finally:
            srv.stop()
