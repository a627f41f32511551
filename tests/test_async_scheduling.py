"""Asynchronous scheduling gives the tokens of synchronous scheduling.

On the CPU the code path is the GPU's: step N+1 is planned and launched before step N's
sampled ids are read, its decodes carry PLACEHOLDER ids that the worker fills in from the
last step's samples; only the overlap itself is missing.
"""
import pickle

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import per_request
from longserve import LLM, SamplingParams
from longserve.engine.request import Request
from longserve.engine import executor as executor_mod
from longserve.engine_args import EngineArgs
from longserve.step_plan import PLACEHOLDER, DecodeRows, ScheduledRequest, SchedulerOutput
from longserve.worker.model_runner import ModelRunner
from longserve.worker.step_inputs import build_block_table

MODEL = "builtin:llama-tiny"
PROMPTS = [[(7 * i + 3 * j) % 300 + 5 for j in range(n)] for i, n in enumerate([5, 23, 40, 9, 61, 17])]
SHARED = [PROMPTS[4][:32] + [9, 8, 7], PROMPTS[4][:48] + [3]]  # prefix-cache hits


def engine(asynchronous: bool, **kw) -> LLM:
    kw = {"max_model_len": 256, "max_num_batched_tokens": 32, **kw}  # chunked, mixed steps
    return LLM(MODEL, device="cpu", async_scheduling=asynchronous, **kw)


@pytest.fixture(scope="module")
def pair():
    llms = engine(False), engine(True)
    assert not llms[0].config.scheduler.async_scheduling and llms[1].config.scheduler.async_scheduling
    yield llms
    for llm in llms:
        llm.shutdown()


def run(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def same(a, b):
    for x, y in zip(a, b, strict=True):
        ox, oy = x.outputs[0], y.outputs[0]
        assert (ox.token_ids, ox.text, ox.finish_reason, ox.stop_reason) == \
            (oy.token_ids, oy.text, oy.finish_reason, oy.stop_reason)
        if ox.logprobs is not None:
            assert [sorted(d) for d in ox.logprobs] == [sorted(d) for d in oy.logprobs]
            for dx, dy in zip(ox.logprobs, oy.logprobs):
                assert all(abs(dx[t] - dy[t]) < 1e-5 for t in dx)


def mixed_params(free_text: str):
    """Greedy and seeded sampling, logprobs, stop strings / ids, EOS, min_tokens, max 1."""
    stop = free_text[len(free_text) // 2:][:3].strip() or "a"
    return [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
            SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True),
            SamplingParams(temperature=0, max_tokens=1),
            SamplingParams(temperature=0, max_tokens=12, logprobs=2, stop_token_ids=[7, 8]),
            SamplingParams(temperature=0, max_tokens=30, min_tokens=4)]


@pytest.mark.timeout(120)
def test_same_tokens_for_a_mixed_workload(pair, pool_whole):
    sync, asyn = pair
    free = run(sync, PROMPTS[2:3], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    params = mixed_params(free[0].outputs[0].text)
    want = run(sync, PROMPTS + SHARED, params + params[:2])
    assert want[2].outputs[0].finish_reason == "stop"  # the stop string was met
    same(want, run(asyn, PROMPTS + SHARED, params + params[:2]))
    same(want, run(asyn, PROMPTS + SHARED, params + params[:2]))  # now from the prefix cache
    pool_whole(asyn)


@pytest.mark.timeout(120)
def test_same_tokens_under_preemption(pool_whole):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = []
    for asynchronous in (False, True):
        with engine(asynchronous, block_size=4, num_gpu_blocks=40) as llm:
            outs.append(run(llm, PROMPTS, params))
            pool_whole(llm)
    assert sum(o.metrics["num_preemptions"] for o in outs[1]) > 0
    same(*outs)


@pytest.mark.timeout(120)
def test_abort_while_a_step_is_in_flight(pair, pool_whole):
    """Stepping the engine core by hand: a request aborted while its next token is still on the
    device ends, the others give synchronous scheduling's tokens, the pool is whole."""
    sync, asyn = pair
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in run(sync, PROMPTS[:3], params)]
    reqs = [asyn.engine.make_request({"prompt_token_ids": p}, params) for p in PROMPTS[:4]]
    tokens = {r.request_id: [] for r in reqs}
    with asyn.engine.client.paused() as core:
        for r in reqs:
            core.add_request(r)
        for _ in range(4):
            collect(per_request(core.step()), tokens)
        aborted = core.scheduler.requests[reqs[3].request_id]
        assert core._in_flight is not None and aborted.num_output_placeholders > 0
        core.abort_requests([reqs[3].request_id])  # decoding, its next token still on the device
        while core.has_work():
            collect(per_request(core.step()), tokens)
    assert aborted.finish_reason == "abort"
    assert [tokens[r.request_id] for r in reqs[:3]] == want
    pool_whole(asyn)


@pytest.mark.timeout(120)
def test_the_kept_block_table_is_the_block_lists(monkeypatch, pool_whole):
    """While a step has the rows of the step before, the runner patches the last block table:
    through block boundaries, finished requests and preemptions (a small pool) it equals the
    table built afresh from the requests' block lists at every step."""
    build, kept = ModelRunner._block_table, []

    def checked(self, out, ids):
        kept.append(self._table is not None and self._table[0] == ids)
        table = build(self, out, ids)
        fresh = build_block_table([self.requests[i].block_ids.view() for i in ids])
        assert np.array_equal(table, fresh)
        return table
    monkeypatch.setattr(ModelRunner, "_block_table", checked)
    with engine(True, block_size=4, num_gpu_blocks=40) as llm:
        outs = run(llm, PROMPTS, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        pool_whole(llm)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert sum(kept) > 20 and not all(kept)


@pytest.mark.timeout(120)
def test_an_id_used_again_samples_with_its_new_parameters(pair):
    """The runner keeps the sampling parameters of a run of steps with the same rows; a new
    request under a finished one's id (same rows) brings its own."""
    _, asyn = pair
    got = []
    with asyn.engine.client.paused() as core:
        for params in (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)):
            req = asyn.engine.make_request({"prompt_token_ids": PROMPTS[1]}, params)
            req.request_id = "again"
            core.add_request(req)
            outputs = []
            while core.has_work():
                outputs += per_request(core.step())
            got.append([o.new_logprobs for o in outputs if o.new_token_ids])
    assert all(lp is None for lp in got[0]) and all(lp and len(lp[0]) >= 1 for lp in got[1])


def collect(outputs, tokens: dict) -> None:
    for o in outputs:
        tokens[o.request_id] += o.new_token_ids


@pytest.mark.timeout(120)
def test_next_step_is_launched_before_the_last_results_are_read(pair, monkeypatch):
    _, asyn = pair
    events, ex = [], asyn.engine.core.executor
    launch, result = ex.execute_async, executor_mod.PendingStep.result

    def spy_launch(out):
        pending = launch(out)
        placeholders = sum(PLACEHOLDER in r.token_ids for r in out.all_requests())
        events.append(("launch", pending.step, placeholders))
        return pending

    def spy_result(self):
        events.append(("result", self.step, 0))
        return result(self)
    monkeypatch.setattr(ex, "execute_async", spy_launch)
    monkeypatch.setattr(executor_mod.PendingStep, "result", spy_result)
    run(asyn, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    order = [(kind, step) for kind, step, _ in events]
    for kind, step in order:
        if kind == "result" and ("launch", step + 1) in order:
            assert order.index(("launch", step + 1)) < order.index(("result", step))
    assert sum(n for _, _, n in events) > 0  # decodes were planned on placeholders


@pytest.mark.timeout(120)
def test_never_plans_past_max_tokens(pair, monkeypatch):
    _, asyn = pair
    sched, samples = asyn.engine.core.scheduler, {}
    schedule = sched.schedule

    def spy():
        out = schedule()
        for r in out.all_requests():
            samples[r.req_id] = samples.get(r.req_id, 0) + r.sample
        return out
    monkeypatch.setattr(sched, "schedule", spy)
    outs = run(asyn, PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                               for n in (1, 2, 3, 5, 8, 13)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3, 5, 8, 13]
    assert [samples[o.request_id] for o in outs] == [1, 2, 3, 5, 8, 13]  # no wasted decode


def test_refused_where_a_step_must_be_read_before_the_next():
    def config(**kw):
        return EngineArgs(MODEL, device="cpu", **kw).create_engine_config()
    assert config().scheduler.async_scheduling  # the default
    assert config(data_parallel_size=2).scheduler.async_scheduling
    with pytest.raises(ValueError, match="KV transfer or kv_offload_gb"):
        config(kv_offload_gb=0.01, async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling must be True, False or None"):
        config(async_scheduling="yes")


@given(prompt=st.integers(1, 20), outputs=st.integers(0, 20), placeholders=st.integers(0, 2),
       data=st.data())
def test_scheduled_token_ids_are_the_tokens_then_placeholders(prompt, outputs, placeholders, data):
    """A plan's token ids [start, end): the known tokens, PLACEHOLDER past them (the ones
    sampled on the device and not read back), for every window of the sequence."""
    req = Request("r", list(range(prompt)), SamplingParams(), [])
    req.output_token_ids = list(range(100, 100 + outputs))
    req.num_output_placeholders = placeholders
    full = req.prompt_token_ids + req.output_token_ids + [PLACEHOLDER] * placeholders
    start = data.draw(st.integers(0, len(full)))
    end = data.draw(st.integers(start, len(full)))
    assert req.scheduled_token_ids(start, end) == full[start:end]


requests_st = st.builds(
    ScheduledRequest, req_id=st.text(max_size=8), token_ids=st.lists(st.integers(-1, 9)),
    num_computed_tokens=st.integers(0, 99), block_ids=st.lists(st.integers(0, 99)),
    new=st.booleans(), sample=st.booleans(),
    sampling_params=st.none() | st.builds(SamplingParams, max_tokens=st.integers(1, 9)),
    seed_offset=st.integers(0, 9), resumed_from_preemption=st.booleans(),
    prompt_logprob_targets=st.none() | st.lists(st.integers(0, 9)),
    prompt_logprob_row=st.integers(0, 9))


@st.composite
def decode_rows_st(draw):
    ids = draw(st.lists(st.text(max_size=4), max_size=6, unique=True))
    ints = st.lists(st.integers(-1, 99), min_size=len(ids), max_size=len(ids))
    rows = st.lists(st.integers(0, 99), min_size=1, max_size=3)
    new_blocks = draw(st.dictionaries(st.integers(0, max(len(ids) - 1, 0)), rows)) if ids else {}
    return DecodeRows(ids, draw(ints), draw(ints), draw(ints), new_blocks)


@given(reqs=st.lists(requests_st, max_size=6), finished=st.lists(st.text(max_size=4)),
       new_blocks=st.lists(st.integers(0, 99)), decodes=decode_rows_st())
def test_a_plan_reaches_the_workers_whole(reqs, finished, new_blocks, decodes):
    """The plan the workers unpickle is the plan that was sent; its decode rows read back as
    the requests they stand for."""
    out = SchedulerOutput(reqs, finished, new_blocks, {"connector": [1]}, decodes)
    back = pickle.loads(pickle.dumps(out))
    assert back == out and all(type(r) is ScheduledRequest for r in back.requests)
    every = back.all_requests()
    assert [r.req_id for r in every] == decodes.req_ids + [r.req_id for r in reqs]
    assert back.num_tokens == sum(len(r.token_ids) for r in every)
    for i, r in enumerate(every[:len(decodes.req_ids)]):
        assert (r.token_ids, r.num_computed_tokens, r.sample, r.new) == \
            ([decodes.token_ids[i]], decodes.num_computed[i], True, False)
        assert r.block_ids == decodes.new_blocks.get(i, [])
