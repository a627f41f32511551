"""SamplingParams.n: the choices of a prompt share its KV blocks (the prompt is computed once,
then choices 1..n-1 fork from choice 0), offline, in parallel layouts and over HTTP."""
import openai
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from longserve import LLM, SamplingParams
from longserve.engine.messages import EngineCoreRequest
from longserve.engine.request import Request
from test_openai_server import ENGINE, MODEL, ServerThread
from test_scheduler_liveness import PREFIXES, SchedulerMachine

PROMPT = list(range(3, 40))  # 37 tokens: 2 full blocks of 16 and a tail of 5
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def gen(llm, params, prompt=PROMPT):
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]


def ids(out):
    return [c.token_ids for c in out.outputs]


@pytest.fixture(scope="module")
def llm():
    # no prefix caching: what the choices share comes from the fork alone
    with LLM(MODEL, **ENGINE, enable_prefix_caching=False) as llm:
        yield llm


def test_greedy_choices_equal_one_choice_and_the_prompt_is_computed_once(llm, pool_whole):
    one = gen(llm, GREEDY)
    before = llm.engine.core_stats()["num_prompt_tokens_computed"]
    three = gen(llm, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))
    computed = llm.engine.core_stats()["num_prompt_tokens_computed"] - before
    assert [c.index for c in three.outputs] == [0, 1, 2] and len(one.outputs) == 1
    assert ids(three) == ids(one) * 3 and three.outputs[2].text == one.outputs[0].text
    assert [c.finish_reason for c in three.outputs] == ["length"] * 3
    assert computed == 37 + 2 * 5  # choice 0 the prompt, the others its last partial block
    pool_whole(llm)


def test_seeded_choices_differ_and_repeat(llm, pool_whole):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    a, b = gen(llm, params), gen(llm, params)
    assert ids(a) == ids(b) and len({tuple(t) for t in ids(a)}) == 3
    # choice i samples with seed + i: choice 1 of seed 11 is choice 0 of seed 12
    assert ids(gen(llm, SamplingParams(temperature=1.0, seed=12, max_tokens=8, ignore_eos=True)))[0] \
        == ids(a)[1]
    pool_whole(llm)


def test_choices_hold_the_prompt_blocks_by_reference(llm, pool_whole):
    """Once the parent's prompt is planned the children hold its 2 full prompt blocks (refcount
    3), then each a block of its own for the tail; aborting the request returns every block."""
    params = SamplingParams(n=3, max_tokens=20, ignore_eos=True)
    with llm.engine.client.paused() as core:
        core.add_request(EngineCoreRequest("x", PROMPT, params))
        core.step()
        reqs = [core.scheduler.requests[f"x-{i}"] for i in range(3)]
        assert [len(r.block_ids) for r in reqs] == [3, 2, 2]
        core.step()  # the children compute the tail
        shared = reqs[0].block_ids[:2]
        assert all(r.block_ids[:2] == shared for r in reqs)
        assert [core.kv.ref_cnt[b] for b in shared] == [3, 3]
        assert len({r.block_ids[2] for r in reqs[1:]} | {reqs[0].block_ids[2]}) == 3
        for _ in range(3):
            core.step()
        assert all(len(r.output_token_ids) >= 2 for r in reqs)
        core.abort_requests([f"x-{i}" for i in range(3)])
        while core.has_work():
            core.step()
    pool_whole(llm)


def test_abort_mid_way_returns_every_block_and_ends_every_choice(llm, pool_whole):
    req = llm.engine.make_request({"prompt_token_ids": PROMPT}, SamplingParams(n=3, max_tokens=200,
                                                                              ignore_eos=True))
    stream = llm.engine.add_request(req)
    seen = {}
    for out in stream:
        seen[out.index] = out
        if len(seen) == 3 and not any(o.finished for o in seen.values()):
            llm.engine.abort(req.request_id)
    assert sorted(seen) == [0, 1, 2]
    assert all(o.finished and o.finish_reason == "abort" for o in seen.values())
    pool_whole(llm)


def test_a_stop_string_ends_one_choice(llm, pool_whole):
    params = dict(n=3, temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    free = gen(llm, SamplingParams(**params))
    texts = [c.text for c in free.outputs]
    stop = next(texts[1][i:i + 3] for i in range(len(texts[1]) - 2)
                if texts[1][i:i + 3] not in texts[0] + texts[2])
    out = gen(llm, SamplingParams(**params, stop=[stop]))
    assert [c.finish_reason for c in out.outputs] == ["length", "stop", "length"]
    assert out.outputs[1].text == texts[1][:texts[1].index(stop)]
    assert [out.outputs[i].text for i in (0, 2)] == [texts[0], texts[2]]
    pool_whole(llm)


def test_only_choice_0_scores_the_prompt(llm, pool_whole):
    one = gen(llm, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=1))
    three = gen(llm, SamplingParams(n=3, temperature=0, max_tokens=4, prompt_logprobs=1))
    assert three.prompt_logprobs == one.prompt_logprobs and len(one.prompt_logprobs) == 37
    assert ids(three) == ids(one) * 3
    pool_whole(llm)


@pytest.mark.timeout(120)
def test_engine_core_in_its_own_process(llm, pool_whole, monkeypatch):
    monkeypatch.setenv("LONGSERVE_ENABLE_MULTIPROCESSING", "1")
    with LLM(MODEL, **ENGINE) as mp:
        out = gen(mp, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))
        assert ids(out) == ids(gen(llm, GREEDY)) * 3
        pool_whole(mp)


def test_bad_n_is_refused_at_the_door(llm):
    for n, match in [(0, "n must be in"), (1.0, "n must be an integer"), (300, "max_num_seqs")]:
        with pytest.raises(ValueError, match=match):
            gen(llm, SamplingParams(n=n) if n != 300 else SamplingParams(n=n, max_tokens=1))
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(n=3, seed=(1 << 64) - 2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(prefill_context_parallel_size=2, block_size=4),
                                    dict(max_num_batched_tokens=16, async_scheduling=False),
                                    dict(num_gpu_blocks=6)],  # preempts
                         ids=["tp2", "pcp2", "chunked-sync", "preempt"])
def test_parallel_layouts_give_one_rank_tokens(layout):
    params = [SamplingParams(n=3, temperature=0, max_tokens=6, ignore_eos=True),
              SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)]
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:21]}]
    kw = dict(device="cpu", max_model_len=128, block_size=layout.get("block_size", 16))
    with LLM(MODEL, **kw) as one:
        want = [ids(o) for o in one.generate(prompts, params, use_tqdm=False)]
    with LLM(MODEL, **{**kw, **layout}) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        got = [ids(o) for o in outs]
        kv = llm.engine.core.kv
        assert kv.num_free_blocks == kv.num_blocks
        preempted = sum(o.metrics["num_preemptions"] for o in outs)
    assert got == want and (preempted > 0) == ("num_gpu_blocks" in layout)


@pytest.mark.timeout(180)
def test_kv_consumer_choices_fork_from_the_loaded_prompt(pool_whole):
    from pd_utils import Producer
    prompt = {"prompt_token_ids": PROMPT}
    params = dict(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(MODEL, device="cpu", max_model_len=256) as plain:
        want = ids(gen(plain, SamplingParams(**params)))
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60})
    try:
        kv = prod.call("prefill", prompt)
        with LLM(MODEL, device="cpu", max_model_len=256,
                 kv_transfer_config={"kv_role": "kv_consumer", "kv_transfer_timeout_s": 5}) as cons:
            out = gen(cons, SamplingParams(n=3, **params, extra_args={"kv_transfer_params": kv}))
            stats = cons.engine.core_stats()
            assert ids(out) == want * 3 and stats["kv_connector_num_loaded_tokens"] == 36
            assert stats["num_prompt_tokens_computed"] == 1 + 2 * 5  # its last token; the tails
            pool_whole(cons)
    finally:
        prod.close()
    with LLM(MODEL, device="cpu", max_model_len=256, kv_transfer_config={"kv_role": "kv_producer"}) as p:
        with pytest.raises(ValueError, match="n must be 1 on a KV producer"):
            gen(p, SamplingParams(n=2))


# ---- the scheduler's fork rules, for any workload (the liveness machine with choices) ----------
class ForkMachine(SchedulerMachine):
    children: frozenset = frozenset()  # ids of choices 1..n-1

    @rule(prefix=st.integers(0, len(PREFIXES)), suffix=st.lists(st.integers(30, 60), max_size=12),
          max_tokens=st.one_of(st.none(), st.integers(1, 30)), n=st.integers(1, 3))
    def arrive(self, prefix, suffix, max_tokens, n):
        prompt = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix
        if not prompt or len(prompt) >= self.sched.config.max_model_len or \
                n > self.sched.config.max_num_seqs:
            return  # the door refuses these
        try:
            self.sched.check_fits(len(prompt), max_tokens)
        except ValueError:
            return
        params = SamplingParams(n=n, max_tokens=max_tokens, ignore_eos=True)
        reqs = [Request(f"{self.n}-{i}", prompt, params.choice(i)) for i in range(n)]
        self.n += 1
        reqs[0].children = reqs[1:]
        self.all.update((r.request_id, r) for r in reqs)
        self.children = self.children | {r.request_id for r in reqs[1:]}
        self.sched.add_request(reqs[0])

    @rule()
    def step(self):
        before = {r.request_id: r.num_computed_tokens for r in self.sched.running}
        super().step()
        tpb = self.kv.tokens_per_block
        for r in self.sched.running:  # a child joins on its parent's full prompt blocks
            if r.request_id in self.children and r.request_id not in before \
                    and not r.num_preemptions:
                assert r.num_computed_tokens == (r.num_prompt_tokens - 1) // tpb * tpb


TestForkRules = ForkMachine.TestCase
TestForkRules.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow])


# ---- the server --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def client():
    llms = []
    srv = ServerThread(lambda: (llms.append(LLM(MODEL, **ENGINE)) or llms[0]).engine)
    srv.wait_healthy()
    yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=60)
    srv.stop()


@pytest.mark.timeout(120)
def test_server_n_choices(client):
    kw = dict(model=MODEL, max_tokens=8, extra_body=dict(ignore_eos=True))
    out = client.completions.create(prompt="Once upon a time", n=3, temperature=0, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2] and len({c.text for c in out.choices}) == 1
    one = client.completions.create(prompt="Once upon a time", temperature=0, **kw)
    assert out.usage.prompt_tokens == one.usage.prompt_tokens and out.usage.completion_tokens == 24
    two = client.completions.create(prompt=["a b", "c d e"], n=2, seed=1, **kw)
    assert [c.index for c in two.choices] == [0, 1, 2, 3] and two.usage.completion_tokens == 32
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], n=3,
                                          seed=2, **kw)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(prompt="hi", best_of=2, **kw)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_server_streams_interleave_choices(client, api):
    kw = dict(model=MODEL, max_tokens=8, n=3, temperature=0, stream=True,
              stream_options={"include_usage": True}, extra_body=dict(ignore_eos=True))
    if api == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], **kw))
        text = lambda c: c.delta.content or ""  # noqa: E731
    else:
        chunks = list(client.completions.create(prompt="Once upon a time", **kw))
        text = lambda c: c.text  # noqa: E731
    texts, ends = {}, {}
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + text(c)
            if c.finish_reason:
                ends[c.index] = c.finish_reason
    assert ends == {0: "length", 1: "length", 2: "length"}
    assert len(set(texts.values())) == 1 and texts[0]
    assert chunks[-1].usage.completion_tokens == 24
