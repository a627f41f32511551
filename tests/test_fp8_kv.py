"""The FP8 KV cache (kv_cache_dtype="fp8", float8 e4m3, per-head scales) on the torch path.

Greedy tokens against the model's-dtype cache (float32 on CPU): equal, or at the first
difference the FP8 token is in the reference's top 2 (a flipped near-tie; a K scale off by
2x already fails it at the first or second token). For one rank (built-in models, SmolLM2),
tp=2, pcp=2 with chunked prefill and prefix hits, tp=2 x dcp=2, CPU offload and a P/D
transfer; the weight-derived scales never saturate; a producer and a consumer with
different KV dtypes or scales are refused.
"""
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from longserve import LLM, SamplingParams
from longserve.attention import backends
from longserve.attention.kv_quant import FP8_MAX, dequantize_kv, quantize_kv
from longserve.engine_args import EngineArgs
from longserve.kv_transfer.p2p import P2pConnectorWorker
from longserve.kv_transfer.topology import KVLayout, KVPiece, plan_kv_pieces
from longserve.models.builtin import resolve_model
from conftest import assert_pool_whole
from pd_utils import Producer

PROMPTS = [[(7 * i + 3) % 400 + 5 for i in range(37)], [(11 * i + 1) % 400 + 5 for i in range(70)],
           [(5 * i + 2) % 300 + 5 for i in range(9)]]
N = 8


def greedy(llm, prompts=PROMPTS, rounds=1, **kw):
    sp = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=2, **kw)
    outs = [o.outputs[0] for _ in range(rounds)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)]
    return [(o.token_ids, o.logprobs) for o in outs]


def assert_close_tokens(got, ref):
    """Equal, or the first difference is a top-2 token of the reference."""
    for (toks, _), (ref_toks, ref_lps) in zip(got, ref, strict=True):
        diff = next((i for i, (a, b) in enumerate(zip(toks, ref_toks)) if a != b), None)
        if diff is not None:
            assert toks[diff] in ref_lps[diff], f"step {diff}: {toks} vs {ref_toks}, top 2 {ref_lps[diff]}"


def run(model, rounds=1, **kw):
    with LLM(model, device="cpu", max_model_len=256, **kw) as llm:
        out = greedy(llm, rounds=rounds)
        assert_pool_whole(llm)
        return out, llm.engine.core.kv.num_cached_tokens_hit


@pytest.fixture(scope="module")
def reference():
    return run("builtin:llama-tiny", rounds=2, block_size=4)[0]


# ---- units -----------------------------------------------------------------------------------
def test_kv_cache_dtype_is_checked_at_the_door():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM("builtin:llama-tiny", device="cpu", kv_cache_dtype="fp8_e5m2")


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2 ** 31 - 1), st.integers(-12, 4))
def test_quantize_round_trip(seed, log2_scale):
    """Within e4m3's normal range a value comes back within half a step (2^-4 relative);
    beyond 448 s it saturates; the smallest values lose at most s * 2^-10."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([2.0 ** log2_scale, 2.0 ** (log2_scale - 3)])
    x = torch.randn(64, 2, 8, generator=g) * scale[:, None] * torch.exp2(torch.randint(-12, 10, (64, 2, 1), generator=g))
    q = quantize_kv(x, scale, torch.float8_e4m3fn)
    back = dequantize_kv(q, scale, torch.float32)
    limit = FP8_MAX * scale[:, None]
    inside = x.abs() <= limit
    err = (back - x).abs()
    assert (err[inside] <= torch.maximum(x.abs() * 2 ** -4, (scale[:, None] * 2 ** -10).expand_as(x))[inside]).all()
    assert torch.equal(back[~inside], (torch.sign(x) * limit.expand_as(x))[~inside])


def test_fp8_cache_holds_twice_the_tokens():
    blocks = {}
    for d in ("auto", "fp8"):
        with LLM("builtin:llama-tiny", device="cpu", dtype="bfloat16", kv_cache_dtype=d,
                 cpu_kv_cache_gb=0.001) as llm:
            blocks[d] = llm.engine.num_blocks
            assert llm.engine.core.executor.driver.runner.kv_caches[0].element_size() == (1 if d == "fp8" else 2)
    assert blocks["fp8"] == 2 * blocks["auto"]


def test_transfer_refuses_another_kv_dtype_or_other_scales():
    fp8, bf16 = KVLayout(2, 16, kv_dtype="float8_e4m3fn"), KVLayout(2, 16, tp=2, kv_dtype="bfloat16")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        plan_kv_pieces(bf16, fp8, 0)
    worker = object.__new__(P2pConnectorWorker)  # the scale check alone: a producer rank's view
    worker.scales = [torch.tensor([[0.5, 0.25], [0.125, 1.0]]), torch.tensor([[1.0, 2.0], [4.0, 8.0]])]
    piece = KVPiece(0, 0, 0, 0, 0, 1, 1)  # the consumer reads the producer's head 1
    theirs = worker._piece_scales(1, 1)
    assert worker._same_scales({"pieces": [piece], "kv_scales": [theirs]})
    assert not worker._same_scales({"pieces": [piece], "kv_scales": [theirs * 2]})
    assert not worker._same_scales({"pieces": [piece], "kv_scales": [None]})


# ---- one rank --------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "llama-tiny-kvshare"])
def test_one_rank_builtins_and_the_scales_never_saturate(model, monkeypatch):
    """qwen2: biases; qwen3: q/k norms; kvshare: layers that read another layer's FP8 cache.
    (The MoE built-ins' attention is the same; their random routers turn a small attention
    error into another expert, and a flip past the top 2, at times.)"""
    seen = []
    store = backends.TorchAttentionBackend.store_kv

    def spy(k, v, k_cache, v_cache, slots, kv_scale=None):
        if kv_scale is not None:  # the largest |x| / s of the step, per K and V
            seen.append(max((x.abs().amax((0, 2)) / s).max().item() for x, s in zip((k, v), kv_scale)))
        return store(k, v, k_cache, v_cache, slots, kv_scale)
    monkeypatch.setattr(backends.TorchAttentionBackend, "store_kv", staticmethod(spy))
    ref, _ = run(f"builtin:{model}")
    got, _ = run(f"builtin:{model}", kv_cache_dtype="fp8")
    assert_close_tokens(got, ref)
    assert seen and max(seen) <= FP8_MAX


@pytest.mark.timeout(120)
def test_smollm2(smollm2_gguf):
    with LLM(smollm2_gguf, device="cpu") as llm:
        tok = llm.get_tokenizer()
        prompts = [tok.encode(p).ids for p in ["The capital of France is",
                                               "Alice was beginning to get very tired of sitting by her"]]
        ref = greedy(llm, prompts)
    with LLM(smollm2_gguf, device="cpu", kv_cache_dtype="fp8") as llm:
        assert_close_tokens(greedy(llm, prompts), ref)


@pytest.mark.timeout(120)
def test_checkpoint_scales_are_used(tmp_path):
    """vLLM's k_scale / v_scale (per layer, or per head) replace the weight bound; a model's
    dtype cache ignores them; a malformed one is refused naming it."""
    src = resolve_model("builtin:llama-tiny")
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    w = load_file(dst / "model.safetensors")
    w["model.layers.0.self_attn.k_scale"] = torch.tensor(0.0625)
    w["model.layers.1.self_attn.v_scale"] = torch.tensor([0.25, 0.5])
    save_file(w, dst / "model.safetensors")
    ref = run("builtin:llama-tiny")[0]
    with LLM(str(dst), device="cpu", kv_cache_dtype="fp8") as llm:
        attn = llm.engine.core.executor.driver.runner.model.attention_layers()
        assert torch.equal(attn[0].kv_scale[0], torch.tensor([0.0625, 0.0625]))
        assert torch.equal(attn[1].kv_scale[1], torch.tensor([0.25, 0.5]))
        assert_close_tokens(greedy(llm), ref)
    with LLM(str(dst), device="cpu") as llm:
        assert llm.engine.core.executor.driver.runner.model.attention_layers()[0].kv_scale is None
    w["model.layers.1.self_attn.v_scale"] = torch.tensor([0.25, 0.5, 1.0])
    save_file(w, dst / "model.safetensors")
    with pytest.raises(ValueError, match="v_scale"):
        LLM(str(dst), device="cpu", kv_cache_dtype="fp8")


# ---- several ranks, offload, P/D --------------------------------------------------------------
LAYOUTS = {
    "tp2": dict(tensor_parallel_size=2),
    "pcp2-chunked-prefix-hits": dict(prefill_context_parallel_size=2, max_num_batched_tokens=16),
    "tp2-dcp2-chunked": dict(tensor_parallel_size=2, decode_context_parallel_size=2,
                             max_num_batched_tokens=16),
}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_layouts(case, reference):
    """Each layout runs the prompts twice: the second round hits the (sharded) prefix cache."""
    got, hits = run("builtin:llama-tiny", rounds=2, block_size=4, kv_cache_dtype="fp8", **LAYOUTS[case])
    assert hits > 0
    assert_close_tokens(got, reference)


@pytest.mark.timeout(180)
def test_cpu_offload_moves_the_fp8_bytes(pool_whole):
    """Evicted FP8 blocks come back from the host pool bit for bit: the tokens of a cache
    large enough for all, with loads."""
    kw = dict(device="cpu", max_model_len=256, block_size=4, kv_cache_dtype="fp8")
    with LLM("builtin:llama-tiny", **kw) as big:
        want = [greedy(big, [p])[0][0] for _ in range(2) for p in PROMPTS]
    with LLM("builtin:llama-tiny", num_gpu_blocks=28, kv_offload_gb=0.001, **kw) as off:
        assert off.engine.core.executor.driver.runner.kv_bytes_per_block() == 512  # 2 x 4 x 2 x 16 x 1 B x 2 layers
        got = [greedy(off, [p])[0][0] for _ in range(2) for p in PROMPTS]
        assert off.engine.core_stats()["kv_connector_num_loaded_tokens"] > 0
        pool_whole(off)
    assert got == want


@pytest.mark.timeout(240)
def test_pd_transfer(reference, pool_whole):
    """An FP8 producer (pcp=2) and an FP8 consumer (tp=2): the consumer decodes from the
    pulled FP8 KV. A consumer with the model's dtype cache is refused at the door."""
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60},
                    prefill_context_parallel_size=2, kv_cache_dtype="fp8", block_size=4)
    try:
        params = [prod.call("prefill", {"prompt_token_ids": p}) for p in PROMPTS]
        assert all(p["remote_layout"]["kv_dtype"] == "float8_e4m3fn" for p in params)
        kvt = {"kv_role": "kv_consumer", "kv_transfer_timeout_s": 10}
        with LLM("builtin:llama-tiny", device="cpu", max_model_len=256, kv_cache_dtype="fp8",
                 tensor_parallel_size=2, kv_transfer_config=kvt) as cons:
            got = [greedy(cons, [p], extra_args={"kv_transfer_params": q})[0] for p, q in zip(PROMPTS, params)]
            assert cons.engine.core_stats()["kv_connector_num_loaded_tokens"] == sum(len(p) - 1 for p in PROMPTS)
            pool_whole(cons)
        assert_close_tokens(got, reference[:len(PROMPTS)])
        with LLM("builtin:llama-tiny", device="cpu", max_model_len=256, kv_transfer_config=kvt) as plain:
            with pytest.raises(ValueError, match="kv_cache_dtype"):
                greedy(plain, PROMPTS[:1], extra_args={"kv_transfer_params": params[0]})
            pool_whole(plain)
    finally:
        prod.close()
