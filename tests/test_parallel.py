"""Every parallel layout gives the greedy tokens of one rank, logits within 1e-4 (gloo, float32).

Each case starts real worker processes (one per rank) that talk over gloo.
"""
import pytest
import torch

from hf_models import VOCAB, make_hf_model
from longserve import LLM, SamplingParams

# Prompt lengths 5..40 force PCP padding (not multiples of 2*pcp) and span several blocks.
LENGTHS = (5, 17, 33, 40)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths = {}
    for arch in ("llama", "qwen2", "qwen3"):
        paths[arch] = str(tmp_path_factory.mktemp(arch))
        make_hf_model(arch, paths[arch])
    return paths


def run(path, prompts, vocab=VOCAB, **kw):
    llm = LLM(path, device="cpu", **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=vocab, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        kv = llm.engine.core.kv
        assert kv.num_free_blocks == kv.num_blocks and not llm.engine.core.scheduler.has_unfinished()
        return outs, kv
    finally:
        llm.shutdown()


def prompts(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def assert_same(outs, ref):
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert a.keys() == b.keys()
            x = torch.tensor([a[k] for k in sorted(b)])
            y = torch.tensor([b[k] for k in sorted(b)])
            assert torch.allclose(x, y, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("sp", [False, True], ids=["no-sp", "sp"])
def test_tensor_parallel(models, arch, sp):
    ps = prompts()
    ref, _ = run(models[arch], ps)
    outs, _ = run(models[arch], ps, tensor_parallel_size=2, enable_sequence_parallel=sp)
    assert_same(outs, ref)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("dcp", [1, 2, 4])
def test_tp4_on_a_single_kv_head_replicated_or_split_by_dcp(dcp):
    """One KV head over 4 TP ranks: replicated (dcp=1), or its tokens split over dcp ranks (issue
    44's layouts)."""
    ps = prompts()
    ref, _ = run("builtin:llama-tiny-mqa", ps, vocab=512)
    outs, _ = run("builtin:llama-tiny-mqa", ps, vocab=512, tensor_parallel_size=4, decode_context_parallel_size=dcp)
    assert_same(outs, ref)


CP_CASES = {
    "pcp2": dict(prefill_context_parallel_size=2),
    "pcp2-chunked": dict(prefill_context_parallel_size=2, max_num_batched_tokens=16),
    "tp2-dcp2": dict(tensor_parallel_size=2, decode_context_parallel_size=2),
    "pcp2-interleave-block": dict(prefill_context_parallel_size=2, block_size=8,
                                  cp_kv_cache_interleave_size=8, max_num_batched_tokens=24),
    "pcp2-tp2-dcp2": dict(prefill_context_parallel_size=2, tensor_parallel_size=2,
                          decode_context_parallel_size=2, max_num_batched_tokens=24),
}


@pytest.mark.parametrize("case", list(CP_CASES))
def test_context_parallel(models, case):
    ps = prompts()
    ref, _ = run(models["llama"], ps)
    outs, kv = run(models["llama"], ps, **CP_CASES[case])
    assert_same(outs, ref)


def test_context_parallel_prefix_cache_hits(models):
    """The second round hits the sharded prefix cache; tokens stay those of one rank."""
    ps = prompts()
    ref, _ = run(models["qwen3"], ps + ps, block_size=4)
    llm = LLM(models["qwen3"], device="cpu", prefill_context_parallel_size=2, block_size=4)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=VOCAB, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        second = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        assert llm.engine.core.kv.num_cached_tokens_hit > 0
        assert_same(first + second, ref)
        assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
    finally:
        llm.shutdown()


def test_context_parallel_with_preemption(models):
    """A pool too small for the batch: requests are preempted and recomputed on the sharded cache."""
    ps = prompts()
    ref, _ = run(models["llama"], ps)
    outs, _ = run(models["llama"], ps, prefill_context_parallel_size=2, block_size=4, num_gpu_blocks=9)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    assert_same(outs, ref)


# Four-rank PCP layouts (issue 42): block 4, so a block-table entry covers 4 x pcp x dcp tokens;
# a budget of 20 tokens a step cuts the prompts into chunks below, at and above that, and the
# second round reads the sharded prefix back from the cache.
FOUR_RANK_CP = {
    "pcp4": dict(prefill_context_parallel_size=4),
    "pcp2-tp2": dict(prefill_context_parallel_size=2, tensor_parallel_size=2),
    "pcp2-tp2-dcp2": dict(prefill_context_parallel_size=2, tensor_parallel_size=2,
                          decode_context_parallel_size=2),
}


@pytest.fixture(scope="module")
def two_rounds_one_rank(models):
    ps = prompts(seed=2)
    return ps, run(models["llama"], ps + ps, block_size=4, max_num_batched_tokens=20)[0]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(FOUR_RANK_CP))
def test_four_rank_context_parallel_chunks_and_prefix_hits(models, two_rounds_one_rank, case):
    ps, ref = two_rounds_one_rank
    llm = LLM(models["llama"], device="cpu", block_size=4, max_num_batched_tokens=20,
              **FOUR_RANK_CP[case])
    try:
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=VOCAB, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        second = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        kv = llm.engine.core.kv
        assert kv.num_cached_tokens_hit > 0
        assert_same(first + second, ref)
        assert kv.num_free_blocks == kv.num_blocks
    finally:
        llm.shutdown()
