"""SamplingParams(prompt_logprobs=k): every prompt token's logprob given its prefix equals HF
transformers' full-forward log-softmax (float32, 1e-4), through chunked prefill, prefix-cache
hits (recomputed), preemption (no duplicates) and the parallel layouts."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_models import VOCAB, make_hf_model
from longserve import LLM, SamplingParams

LENGTHS = (1, 5, 17, 33, 40)


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    out = {}
    for arch in ("llama", "qwen2", "qwen3"):
        path = str(tmp_path_factory.mktemp(arch))
        out[arch] = (path, make_hf_model(arch, path))
    return out


def prompts(seed=1, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


@torch.no_grad()
def hf_prompt_logprobs(model, prompt):
    """[len - 1, vocab]: row t - 1 is the distribution of prompt[t] given prompt[:t]."""
    return torch.log_softmax(model(torch.tensor([prompt])).logits[0, :-1].float(), -1)


def generate(llm, ps, k=VOCAB, max_tokens=4):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=k)
    return llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)


def assert_matches(out, prompt, ref, k=VOCAB):
    """One entry per prompt token, the first None; entry t holds prompt[t] and the top-k."""
    lps = out.prompt_logprobs
    assert len(lps) == len(prompt) and lps[0] is None
    for t in range(1, len(prompt)):
        entry, row = lps[t], ref[t - 1]
        assert prompt[t] in entry
        top = set(row.topk(k).indices.tolist()) if k else set()
        assert set(entry) == top | {prompt[t]}
        ids = sorted(entry)
        assert torch.allclose(torch.tensor([entry[i] for i in ids]), row[ids], atol=1e-4, rtol=0)


def assert_all_match(outs, ps, model, k=VOCAB):
    for o, p in zip(outs, ps):
        assert_matches(o, p, hf_prompt_logprobs(model, p), k)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_matches_hf_with_chunked_prefill(hf_models, arch, pool_whole):
    path, model = hf_models[arch]
    llm = LLM(path, device="cpu", max_num_batched_tokens=16, block_size=4)
    llm.engine.core.executor.driver.runner.sampling.prompt_logprob_rows_per_slice = 3  # logits in slices
    ps = prompts()
    assert_all_match(generate(llm, ps), ps, model)
    pool_whole(llm)


def test_top_k_and_actual_token_only(hf_models, pool_whole):
    path, model = hf_models["qwen3"]
    llm = LLM(path, device="cpu")
    ps = prompts(3, (9, 21))
    for k in (0, 1, 5):
        assert_all_match(generate(llm, ps, k), ps, model, k)
    pool_whole(llm)


def test_mixed_batch_only_the_asking_requests_get_them(hf_models, pool_whole):
    """Requests with and without prompt logprobs share steps (decodes next to prefill chunks)."""
    path, model = hf_models["llama"]
    llm = LLM(path, device="cpu", max_num_batched_tokens=12)
    ps = prompts(4, (20, 7, 30))
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, prompt_logprobs=k)
              for k in (None, 2, VOCAB)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    assert outs[0].prompt_logprobs is None
    assert_matches(outs[1], ps[1], hf_prompt_logprobs(model, ps[1]), 2)
    assert_matches(outs[2], ps[2], hf_prompt_logprobs(model, ps[2]))
    plain = llm.generate([{"prompt_token_ids": p} for p in ps],
                         SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    pool_whole(llm)


def test_prefix_cache_hit_is_recomputed(hf_models, pool_whole):
    """A request asking for prompt logprobs does not read the prefix cache but still fills it."""
    path, model = hf_models["qwen2"]
    llm = LLM(path, device="cpu", block_size=4)
    ps = prompts(5, (17, 33))
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in ps], plain, use_tqdm=False)  # fills the cache
    kv = llm.engine.core.kv
    hits = kv.num_cached_tokens_hit
    assert_all_match(generate(llm, ps), ps, model)
    assert kv.num_cached_tokens_hit == hits  # recomputed, not read
    llm.generate([{"prompt_token_ids": p} for p in ps], plain, use_tqdm=False)
    assert kv.num_cached_tokens_hit > hits  # the cache is still there for the others
    assert_all_match(generate(llm, ps), ps, model)
    pool_whole(llm)


def spy_preemptions(llm):
    """Record (prompt logprobs collected, prompt length) of every preempted request."""
    sched, seen = llm.engine.core.scheduler, []
    preempt = sched._preempt

    def spy(req):
        seen.append((len(req.prompt_logprobs), req.num_prompt_tokens, req.num_steps_in_flight))
        preempt(req)
    sched._preempt = spy
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_mid_prompt_gives_no_duplicates(hf_models, pool_whole, async_scheduling):
    path, model = hf_models["llama"]
    llm = LLM(path, device="cpu", block_size=4, num_gpu_blocks=14, max_num_batched_tokens=8,
              async_scheduling=async_scheduling)
    seen = spy_preemptions(llm)
    ps = prompts(2, (21, 22, 23))
    assert_all_match(generate(llm, ps, max_tokens=12), ps, model)
    if async_scheduling:  # preempted while a step with its prompt rows was still in flight
        assert any(in_flight and got < n - 1 for got, n, in_flight in seen)
    else:  # preempted with part of them collected
        assert any(0 < got < n - 1 for got, n, _ in seen)
    pool_whole(llm)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lengths=st.lists(st.integers(1, 30), min_size=1, max_size=4),
       budget=st.integers(4, 40), block_size=st.sampled_from([2, 4, 8]), spare=st.integers(0, 12),
       prefix_cache=st.booleans())
def test_any_chunking_and_pool_gives_each_entry_once(hf_models, lengths, budget, block_size, spare,
                                                     prefix_cache):
    path, model = hf_models["qwen3"]
    need = -(-(max(lengths) + 6) // block_size)  # the longest request alone always fits
    llm = LLM(path, device="cpu", block_size=block_size, num_gpu_blocks=need + spare,
              max_num_batched_tokens=budget, max_num_seqs=4, enable_prefix_caching=prefix_cache)
    ps = prompts(sum(lengths), lengths)
    assert_all_match(generate(llm, ps + ps[:1], k=2, max_tokens=6), ps + ps[:1], model, k=2)
    kv = llm.engine.core.kv
    assert kv.num_free_blocks == kv.num_blocks


@pytest.mark.parametrize("value", [-1, 1.5, True, "3"])
def test_bad_prompt_logprobs_is_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)


def test_prompt_logprobs_above_vocab_refused_at_the_door(hf_models, pool_whole):
    llm = LLM(hf_models["llama"][0], device="cpu")
    good = SamplingParams(max_tokens=2, prompt_logprobs=VOCAB)
    bad = SamplingParams(max_tokens=2, prompt_logprobs=VOCAB + 1)
    with pytest.raises(ValueError, match=rf"prompt_logprobs must be in \[0, {VOCAB}\]"):
        llm.generate([{"prompt_token_ids": [3, 4]}] * 2, [good, bad], use_tqdm=False)
    pool_whole(llm)


# ---- parallel layouts against one rank ----------------------------------------------------

LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pcp2": dict(prefill_context_parallel_size=2),
    "tp2-dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2),
    "pcp2-tp2-dcp2": dict(prefill_context_parallel_size=2, tensor_parallel_size=2,
                          decode_context_parallel_size=2),
    "dp2": dict(data_parallel_size=2),
}


def assert_same_entries(outs, ref):
    for o, r in zip(outs, ref):
        assert len(o.prompt_logprobs) == len(r.prompt_logprobs)
        for a, b in zip(o.prompt_logprobs[1:], r.prompt_logprobs[1:]):
            assert a.keys() == b.keys()
            ids = sorted(b)
            assert torch.allclose(torch.tensor([a[i] for i in ids]), torch.tensor([b[i] for i in ids]),
                                  atol=1e-4, rtol=0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_match_one_rank(hf_models, layout):
    """Chunked prefill (a prompt over several steps) and a second round that would hit the cache."""
    path, _ = hf_models["llama"]
    ps = prompts(6, (5, 17, 33))
    kw = dict(device="cpu", block_size=4, max_num_batched_tokens=16)
    with LLM(path, **kw) as llm:
        ref = generate(llm, ps, k=5)
    with LLM(path, **kw, **LAYOUTS[layout]) as llm:
        first, second = generate(llm, ps, k=5), generate(llm, ps, k=5)
        assert all(s["num_free_blocks"] == s["num_blocks"] for s in llm.engine.pool_states())
    assert_same_entries(first, ref)
    assert_same_entries(second, ref)


@pytest.mark.timeout(60)
def test_refused_with_kv_transfer_params(hf_models, pool_whole):
    """A KV consumer loads the prompt's KV instead of computing it: no prompt logprobs there."""
    with LLM(hf_models["llama"][0], device="cpu", kv_transfer_config={"kv_role": "kv_consumer"}) as llm:
        params = SamplingParams(max_tokens=2, prompt_logprobs=1,
                                extra_args={"kv_transfer_params": {"do_remote_prefill": True}})
        with pytest.raises(ValueError, match="prompt_logprobs cannot be combined with kv_transfer"):
            llm.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
        pool_whole(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_max_tokens_0_scores_the_prompt_and_generates_nothing(hf_models, pool_whole, async_scheduling):
    path, model = hf_models["qwen2"]
    llm = LLM(path, device="cpu", block_size=4, max_num_batched_tokens=8, async_scheduling=async_scheduling)
    ps = prompts(3)
    outs = generate(llm, ps, k=3, max_tokens=0)
    assert all(o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "length" for o in outs)
    assert_all_match(outs, ps, model, k=3)
    pool_whole(llm)
