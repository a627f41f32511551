"""Cross-layer KV sharing: layers 2 and 3 of builtin:llama-tiny-kvshare read the KV of layers
0 and 1. Checked against a plain torch implementation of the same model (no cache)."""
import json
import os

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from longserve import LLM, SamplingParams
from longserve.models.builtin import resolve_model


def rms(x, w, eps=1e-6):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    f = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


@torch.no_grad()
def reference_logits(w, cfg, ids):
    nh, nkv, h = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    d, sharing = h // nh, {int(k): v for k, v in cfg["longserve_kv_sharing"].items()}
    x, pos, kv = w["model.embed_tokens.weight"][ids], torch.arange(len(ids)), {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        hid = rms(x, w[p + "input_layernorm.weight"])
        q = rope((hid @ w[p + "self_attn.q_proj.weight"].T).view(-1, nh, d), pos, cfg["rope_theta"])
        k = rope((hid @ w[p + "self_attn.k_proj.weight"].T).view(-1, nkv, d), pos, cfg["rope_theta"])
        v = (hid @ w[p + "self_attn.v_proj.weight"].T).view(-1, nkv, d)
        k, v = kv[sharing[i]] if i in sharing else kv.setdefault(i, (k, v))
        a = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(nh // nkv, 0),
                                           v.transpose(0, 1).repeat_interleave(nh // nkv, 0), is_causal=True)
        x = x + a.transpose(0, 1).reshape(len(ids), -1) @ w[p + "self_attn.o_proj.weight"].T
        hid = rms(x, w[p + "post_attention_layernorm.weight"])
        mlp = F.silu(hid @ w[p + "mlp.gate_proj.weight"].T) * (hid @ w[p + "mlp.up_proj.weight"].T)
        x = x + mlp @ w[p + "mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8, "block_size": 4},
                                {"prefill_context_parallel_size": 2}], ids=["plain", "chunked", "pcp2"])
def test_kv_sharing_matches_plain_torch(kw):
    path = resolve_model("builtin:llama-tiny-kvshare")
    cfg = json.load(open(os.path.join(path, "config.json")))
    w = load_file(os.path.join(path, "model.safetensors"))
    llm = LLM("builtin:llama-tiny-kvshare", device="cpu", **kw)
    try:
        prompts = [[1, 50, 60, 70, 80], list(range(3, 30))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3),
                            use_tqdm=False)
        for p, o in zip(prompts, outs):
            ids = list(p)
            for tok, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs):
                ref = torch.log_softmax(reference_logits(w, cfg, torch.tensor(ids))[-1], -1)
                assert tok == int(ref.argmax())
                assert abs(lp[tok] - ref[tok].item()) < 1e-4
                ids.append(tok)
        # the sharing layers own no cache: only layers 0 and 1 are allocated
        runner = llm.engine.core.executor.driver.runner
        assert runner.layers["model.layers.2.self_attn.attn"].kv_cache is runner.layers["model.layers.0.self_attn.attn"].kv_cache
        assert len({c.data_ptr() for c in runner.kv_caches}) == 2
    finally:
        llm.shutdown()


def test_only_a_layer_read_by_others_keeps_its_step_kv():
    """A step's K/V rows stay referenced past their layer (meta.step_kv) only where a later layer
    reads them: a decode graph keeps its metadata, and with every layer's rows (views of the QKV
    output) each graph held ~10 KB a token a layer (an H200 ran out of memory capturing them)."""
    import numpy as np
    from longserve.attention.backends import Attention, TorchAttentionBackend
    from longserve.attention.metadata import AttentionMetadata
    from longserve.distributed.parallel_state import single_rank_state
    from longserve.worker.step_inputs import CPLayout, add_prefill_parts
    ps = single_rank_state()
    meta = AttentionMetadata(num_decode_tokens=0, num_tokens=3, slot_mapping=torch.arange(3), decode=None,
                             ps=ps, backend=TorchAttentionBackend())
    add_prefill_parts(meta, np.array([3]), np.array([0]), np.array([0, 3]), np.array([0, 3]), 0,
                      torch.zeros(1, 2, dtype=torch.int32), CPLayout(4, 1, 0, 1), ps, "cpu")
    layers = [Attention(0, 2, 1, 8, 0.3), Attention(1, 2, 1, 8, 0.3, kv_shared=True),
              Attention(2, 2, 1, 8, 0.3, kv_sharing_target=1)]
    for a in layers:
        a.kv_cache = torch.zeros(2, 2, 4, 1, 8)
    q, k, v = torch.randn(3, 2, 8), torch.randn(3, 1, 8), torch.randn(3, 1, 8)
    outs = [a(q, k, v, meta) for a in layers]
    assert list(meta.step_kv) == [1]
    torch.testing.assert_close(outs[2], outs[1])  # the reader attends over its target's rows
