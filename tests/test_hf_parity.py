"""The single rank matches HF transformers: greedy tokens and log-probabilities (float32, CPU)."""
import pytest
import torch

from hf_models import VOCAB, hf_greedy, make_hf_model
from longserve import LLM, SamplingParams

ARCHS = ["llama", "qwen2", "qwen3"]
LENGTHS = (5, 17, 33, 40)
MAX_TOKENS = 6


@pytest.fixture(scope="module", params=ARCHS)
def hf_model(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return path, make_hf_model(request.param, path)


def prompts(seed=1, lengths=LENGTHS):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def check_against_hf(llm, model, ps, max_tokens=MAX_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=VOCAB, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for p, o in zip(ps, outs):
        tokens, logprobs = hf_greedy(model, p, max_tokens)
        assert o.outputs[0].token_ids == tokens
        for step, ref in zip(o.outputs[0].logprobs, logprobs):
            ours = torch.tensor([step[k] for k in range(VOCAB)])
            assert torch.allclose(ours, ref, atol=1e-4, rtol=0)
    return outs


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 16},  # chunked prefill: every prompt but one spans steps
    {"block_size": 4, "max_num_seqs": 2},
], ids=["plain", "chunked", "small-blocks"])
def test_matches_hf(hf_model, engine_kwargs, pool_whole):
    path, model = hf_model
    llm = LLM(path, device="cpu", **engine_kwargs)
    check_against_hf(llm, model, prompts())
    pool_whole(llm)


def test_prefix_cache_hit_gives_same_tokens(hf_model, pool_whole):
    path, model = hf_model
    llm = LLM(path, device="cpu", block_size=4)
    ps = prompts()
    first = check_against_hf(llm, model, ps)
    hits_before = llm.engine.core.kv.num_cached_tokens_hit
    second = check_against_hf(llm, model, ps)
    assert llm.engine.core.kv.num_cached_tokens_hit - hits_before >= sum(len(p) // 4 * 4 - 4 for p in ps)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    pool_whole(llm)


def test_preemption_with_tiny_pool(hf_model, pool_whole):
    path, model = hf_model
    # 14 blocks of 4 tokens; four requests growing to 24 tokens each need 24 blocks at once
    llm = LLM(path, device="cpu", block_size=4, num_gpu_blocks=14)
    outs = check_against_hf(llm, model, prompts(2, (9, 10, 11, 12)), max_tokens=12)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0
    pool_whole(llm)
