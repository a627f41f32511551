"""Piecewise execution of steps with prefill (worker/piecewise_graphs.py), graphs off on CPU:
the same padding, static buffers and segment order as on CUDA, bit for bit the eager forward."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from longserve import LLM, SamplingParams
from longserve.worker.piecewise_graphs import MAX_GRAPH_TOKENS, token_buckets

BUDGET = 48  # max_num_batched_tokens: buckets 16, 32, 48; prompts below are chunked


@given(st.integers(1, 20000), st.data())
def test_bucket_is_the_smallest_that_fits(budget, data):
    buckets = token_buckets(budget)
    assert buckets == sorted(set(buckets)) and buckets[-1] == min(budget, MAX_GRAPH_TOKENS)
    t = data.draw(st.integers(1, buckets[-1]))
    b = min(x for x in buckets if x >= t)
    assert all(x < t for x in buckets if x < b)
    assert b - t < max(t, 16)  # pads by less than the step (or the smallest bucket)
    assert t <= 2048 or b - t <= t // 4  # and by at most a quarter past 2,048 tokens


def prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in lengths]


def checking_runs(runner):
    """Every piecewise run also runs the eager forward first and compares bit for bit.
    Returns the log: (tokens, decode rows, has cached context) per step.

    Rows are independent in exact arithmetic, but BLAS may pick another kernel for a tiny
    row count (matmuls of <= 4 rows differ in the last bit on x86 CPUs): steps of fewer than
    8 tokens (padded to 16) are compared to within 1e-5."""
    pw, log = runner.piecewise, []
    run = pw.run

    def both(input_ids, positions, meta):
        ref = runner.model(input_ids, positions, meta).clone()  # stores the same K/V first
        out = run(input_ids, positions, meta)
        t = input_ids.shape[0]
        assert torch.equal(out, ref) if t >= 8 else torch.allclose(out, ref, atol=1e-5, rtol=1e-5)
        log.append((input_ids.shape[0], meta.num_decode_tokens, meta.prefix is not None))
        return out
    pw.run = both
    return log


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["builtin:qwen3-tiny", "builtin:llama-tiny-kvshare"])
def test_piecewise_equals_eager_bit_for_bit(model, monkeypatch, pool_whole):
    monkeypatch.setenv("LONGSERVE_PIECEWISE", "eager")
    llm = LLM(model, device="cpu", max_num_batched_tokens=BUDGET, max_num_seqs=8,
              enable_prefix_caching=True)
    try:
        log = checking_runs(llm.engine.core.executor.driver.runner)
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        first = prompts(1, (37, 70, 9, 25))
        llm.generate(first, params, use_tqdm=False)
        # shared prefixes: prefill with cached context (prefix cache) besides chunked prefill
        again = [{"prompt_token_ids": p["prompt_token_ids"] + [7] * 20} for p in first[:2]]
        llm.generate(again + prompts(2, (5, 60)), params, use_tqdm=False)
        pool_whole(llm)
    finally:
        llm.shutdown()
    assert any(dec and ctx for _, dec, ctx in log)  # mixed: decodes + chunk with context
    assert any(t not in (16, 32, 48) for t, _, _ in log)  # padded to a bucket
    assert any(dec == 0 for _, dec, _ in log)  # prefill only


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2),
                                    dict(prefill_context_parallel_size=2),
                                    dict(prefill_context_parallel_size=2, tensor_parallel_size=2)])
def test_piecewise_layouts_give_the_tokens_of_one_rank(monkeypatch, layout):
    """TP=2 (gloo): the all-reduces inside the segments; PCP=2: the collectives in attention
    between them, the ranks' equal token counts; tokens and logprobs of one rank."""
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=5, ignore_eos=True)
    ps = prompts(3, (30, 55, 12))
    kw = dict(device="cpu", max_num_batched_tokens=BUDGET, max_num_seqs=4)
    ref_llm = LLM("builtin:qwen3-tiny", **kw)
    try:
        ref = ref_llm.generate(ps, params, use_tqdm=False)
    finally:
        ref_llm.shutdown()
    monkeypatch.setenv("LONGSERVE_PIECEWISE", "eager")
    llm = LLM("builtin:qwen3-tiny", **layout, **kw)
    try:
        outs = llm.generate(ps, params, use_tqdm=False)
        assert llm.engine.core.executor.driver.runner.piecewise.num_steps >= 3
    finally:
        llm.shutdown()
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)


def test_layouts_without_piecewise_graphs_run_eagerly(monkeypatch):
    from longserve.engine_args import EngineArgs
    from longserve.worker.piecewise_graphs import piecewise_unsupported

    def why(model="builtin:qwen3-tiny", **kw):
        return piecewise_unsupported(EngineArgs(model, device="cpu", **kw).create_engine_config())
    assert why() is None and why(tensor_parallel_size=2, decode_context_parallel_size=2) is None
    assert "expert" in why("builtin:qwen3-moe-tiny")
    assert "sequence" in why(tensor_parallel_size=2, enable_sequence_parallel=True)
    assert why(prefill_context_parallel_size=2, tensor_parallel_size=2) is None
    monkeypatch.setenv("LONGSERVE_PIECEWISE", "eager")
    llm = LLM("builtin:qwen3-moe-tiny", device="cpu")
    try:
        assert llm.engine.core.executor.driver.runner.piecewise is None
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 2
    finally:
        llm.shutdown()
