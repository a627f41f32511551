"""Mixture-of-experts models (Qwen3-MoE, Mixtral) match HF transformers on one rank (float32)."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from hf_models import VOCAB, make_hf_model
from interpreter_utils import speed_up_interpreter
from longserve import LLM
from longserve.models.moe import FusedMoE, grouped_linear, local_experts, select_experts
from test_hf_parity import check_against_hf, prompts

speed_up_interpreter()

ARCHS = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module", params=ARCHS)
def hf_moe(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    return path, make_hf_model(request.param, path)


@pytest.mark.parametrize("engine_kwargs", [{}, {"max_num_batched_tokens": 16, "block_size": 4}],
                         ids=["plain", "chunked"])
def test_moe_matches_hf(hf_moe, engine_kwargs, pool_whole):
    path, model = hf_moe
    llm = LLM(path, device="cpu", **engine_kwargs)
    assert llm.config.model.is_moe
    check_against_hf(llm, model, prompts())
    pool_whole(llm)


def test_fused_expert_tensors_load_too(hf_moe, tmp_path, pool_whole):
    """transformers 5 keeps the experts of a layer as two 3-D tensors in memory; a checkpoint
    with those names (gate_up_proj [E, 2I, H], down_proj [E, H, I]) loads the same."""
    path, model = hf_moe
    state = load_file(os.path.join(path, "model.safetensors"))
    fused = {}
    for name, t in state.items():
        name = name.replace(".block_sparse_moe.", ".mlp.")
        if ".experts." not in name:
            fused[name] = t
    for i in range(model.config.num_hidden_layers):
        block = model.model.layers[i].mlp
        if hasattr(block, "experts"):
            p = f"model.layers.{i}.mlp.experts."
            fused[p + "gate_up_proj"] = block.experts.gate_up_proj.detach().clone()
            fused[p + "down_proj"] = block.experts.down_proj.detach().clone()
    save_file(fused, str(tmp_path / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    llm = LLM(str(tmp_path), device="cpu")
    check_against_hf(llm, model, prompts()[:2])
    pool_whole(llm)


def test_routing_is_transformers_rule():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.5, 0.5, 4.0, 1.0]])
    w, ids = select_experts(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2], [2, 3]]
    assert torch.allclose(w, probs.gather(1, ids))
    w, _ = select_experts(logits, 2, renormalize=True)
    assert torch.allclose(w.sum(-1), torch.ones(2))


@pytest.mark.parametrize("hidden", [16, 10])  # aligned: one grouped GEMM; odd: a loop
def test_grouped_linear(hidden):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(3, 8, hidden, generator=g)
    x = torch.randn(9, hidden, generator=g)
    ends = torch.tensor([4, 4, 9])  # group 1 is empty
    ref = torch.cat([x[:4] @ w[0].T, x[4:] @ w[2].T])
    assert torch.allclose(grouped_linear(x, w, ends), ref, atol=1e-5)


def test_expert_parallel_needs_expert_layers():
    with pytest.raises(ValueError, match="enable_expert_parallel.*expert layers"):
        LLM("builtin:qwen3-tiny", device="cpu", enable_expert_parallel=True)


def test_builtin_moe_configs():
    llm = LLM("builtin:qwen3-moe-tiny", device="cpu")
    m = llm.config.model
    assert (m.num_experts, m.num_experts_per_tok, m.moe_layers) == (8, 2, [0, 2])
    llm.shutdown()
    from longserve.models.builtin import resolve_model
    with open(os.path.join(resolve_model("builtin:qwen3-30b-a3b-shape"), "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["num_hidden_layers"]) == (128, 8, 48)


# ---- the fused Triton kernel (models/fused_moe_kernel.py), under the Triton interpreter ----

def ref_experts(x, w13, w2, local, weights, k):
    """float64 loop: weight * down(silu(gate x) * up x) per pair, 0 for other ranks' pairs."""
    x, w13, w2, width = x.double(), w13.double(), w2.double(), w2.shape[2]
    out = torch.zeros(local.numel(), w2.shape[1], dtype=torch.float64)
    for p, e in enumerate(local.tolist()):
        if e < w2.shape[0]:
            h = w13[e] @ x[p // k]
            out[p] = weights[p] * (w2[e] @ (torch.nn.functional.silu(h[:width]) * h[width:]))
    return out


def ref_align(local: torch.Tensor, num_local: int, block_m: int):
    """The align kernels' tensors in torch ops: local [P] each pair's expert on this rank
    (num_local: another rank's) -> slot_pair [S] (P: padding), block_expert [S / block_m]."""
    num_pairs = local.numel()
    num_slots = -(-(num_pairs + num_local * (block_m - 1)) // block_m) * block_m
    order = torch.argsort(local, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64).scatter_add_(0, local, torch.ones_like(local))
    padded = (counts[:num_local] + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    shift = (padded_end - padded) - (torch.cumsum(counts[:num_local], 0) - counts[:num_local])
    expert = local[order]
    slot = torch.arange(num_pairs) + shift[expert.clamp(max=num_local - 1)]
    slot = torch.where(expert < num_local, slot, num_slots)  # other ranks' pairs: cut off
    slot_pair = torch.full((num_slots + 1,), num_pairs, dtype=torch.int64)
    slot_pair = slot_pair.scatter_(0, slot, order)[:num_slots]
    block_expert = torch.searchsorted(padded_end, torch.arange(0, num_slots, block_m), right=True)
    return slot_pair, torch.where(block_expert < num_local, block_expert, -1)


def check_fused_kernel() -> None:
    from longserve.models import fused_moe_kernel as fk
    g = torch.Generator().manual_seed(0)
    configs = [(1 << 62, 16, 16, 32, 4, 1), (1 << 62, 32, 32, 16, 4, 1)]  # K and N tails
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        for config, (num_tokens, k), first in zip(configs, [(7, 2), (19, 3)], [0, 6]):
            fk.BLOCK_CONFIGS = [config]
            x = torch.randn(num_tokens, 40, generator=g)
            w13, w2 = torch.randn(6, 48, 40, generator=g) / 6, torch.randn(6, 40, 24, generator=g) / 5
            ids = torch.randint(-1, first + 7, (num_tokens, k), generator=g)  # not all ours
            weights = torch.rand(num_tokens, k, generator=g)
            got = fk.fused_experts(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights, first)
            local = local_experts(ids, first, 6)
            ref = ref_experts(x, w13, w2, local, weights.flatten(), k).view(num_tokens, k, -1)
            torch.testing.assert_close(got.double(), ref.sum(1), atol=tol, rtol=tol)
    check_route_kernel()
    check_place_kernel()
    check_moe_layer_fused_path()


@settings(max_examples=20, deadline=None)
@given(num_tokens=st.integers(0, 40), num_experts=st.sampled_from([2, 8, 60, 128]),
       k=st.integers(1, 8), renormalize=st.booleans(), bf16=st.booleans(),
       seed=st.integers(0, 2**31))
@example(num_tokens=17, num_experts=128, k=8, renormalize=True, bf16=True, seed=0)
def check_route_kernel(num_tokens, num_experts, k, renormalize, bf16, seed):
    """The one-kernel routing gives torch's weights and ids (k <= experts; logits without
    ties, distinct in bf16 too), for several token blocks and expert counts that are not a
    power of two; on ties it keeps the lower id, as torch.argmax does."""
    from longserve.models.fused_moe_kernel import route_triton
    k = min(k, num_experts)
    g = torch.Generator().manual_seed(seed)
    logits = torch.rand(num_tokens, num_experts, generator=g).argsort(-1)  # a permutation a row
    logits = (logits - num_experts / 2) / 8
    logits = logits.to(torch.bfloat16) if bf16 else logits + 0.01 * torch.rand(logits.shape)
    tie_w, tie_ids = route_triton(torch.zeros(3, num_experts), k, renormalize)
    assert tie_ids.tolist() == [list(range(k))] * 3 and tie_w.allclose(tie_w[:, :1])
    weights, ids = route_triton(logits, k, renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ref_w, ref_ids = torch.topk(probs, k, dim=-1)
    ref_w = ref_w / ref_w.sum(-1, keepdim=True) if renormalize else ref_w
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


def random_ids(num_local, first, num_tokens, k, one_expert, seed):
    """ids in [-1, first + 2 * num_local + 2): id -1, other ranks' experts below and above ours;
    one_expert: every pair to one of ours (the longest run)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1, first + 2 * num_local + 2, (num_tokens, k), generator=g)
    return ids.fill_(first + seed % num_local) if one_expert else ids


@settings(max_examples=30, deadline=None)
@given(num_local=st.sampled_from([1, 6, 8, 128]), first=st.integers(0, 12),
       num_tokens=st.integers(1, 48), k=st.integers(1, 8), block_m=st.sampled_from([16, 32, 64]),
       one_expert=st.booleans(), chunk=st.sampled_from([32, 128]), seed=st.integers(0, 2**31))
@example(num_local=6, first=3, num_tokens=1, k=8, block_m=16, one_expert=False, chunk=128, seed=0)
@example(num_local=128, first=0, num_tokens=48, k=8, block_m=16, one_expert=False, chunk=32, seed=0)
@example(num_local=128, first=0, num_tokens=40, k=8, block_m=16, one_expert=True, chunk=32, seed=0)
def check_place_kernel(num_local, first, num_tokens, k, block_m, one_expert, chunk, seed):
    """The align (one program or several, of pairs and of blocks) gives ref_align's blocks
    and, within each expert's run, its pairs in any order, padding last; for ids in
    [-1, first + 2 * num_local + 2): id -1, other ranks' experts below and above ours."""
    from longserve.models import fused_moe_kernel as fk
    ids = random_ids(num_local, first, num_tokens, k, one_expert, seed)
    saved, fk.PLACE_CHUNK = fk.PLACE_CHUNK, chunk
    try:
        slot_pair, block_expert = fk.align_pairs(ids, first, num_local, block_m)
    finally:
        fk.PLACE_CHUNK = saved
    ref_pair, ref_expert = ref_align(local_experts(ids, first, num_local), num_local, block_m)
    assert slot_pair.dtype == ref_pair.dtype and torch.equal(block_expert, ref_expert)
    for b in range(block_expert.numel()):  # each block holds its expert's pairs, padding last
        got, ref = (x[b * block_m:(b + 1) * block_m] for x in (slot_pair, ref_pair))
        assert torch.equal(got.sort().values, ref.sort().values)
        assert torch.equal(got >= ids.numel(), ref >= ids.numel())


def check_moe_layer_fused_path() -> None:
    """FusedMoE.experts on the fused kernels (expert parallel, rank 1 of 2: experts [6, 12) of
    12) equals its grouped torch path."""
    cfg = SimpleNamespace(num_experts=12, moe_intermediate_size=24, hidden_size=40,
                          num_experts_per_tok=3, norm_topk_prob=True)
    group = SimpleNamespace(world_size=2, rank_in_group=1)
    ps = SimpleNamespace(dp=SimpleNamespace(world_size=1, rank_in_group=0), tp=group)
    moe = FusedMoE(cfg, ps, expert_parallel=True)
    g = torch.Generator().manual_seed(1)
    for p in (moe.gate.weight, moe.w13, moe.w2):
        p.data.copy_(torch.randn(p.shape, generator=g) / 6)
    x = torch.randn(5, 40, generator=g)
    weights, ids = moe.route(x)
    ids[0, 0] = -1  # a pair for no one
    assert (local_experts(ids, 6, 6) < 6).any() and (local_experts(ids, 6, 6) == 6).any()
    pairs = moe.grouped_experts(x, local_experts(ids, 6, 6), weights.flatten(), 3)
    got = moe.experts(x, weights, ids)
    torch.testing.assert_close(got, pairs.view(5, 3, -1).sum(1), atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(300)
def test_fused_moe_kernel_under_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") == "1":
        check_fused_kernel()
        return
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([repo, os.path.join(repo, "tests")]))
    proc = subprocess.run([sys.executable, "-c", "import test_moe as t; t.check_fused_kernel()"],
                          env=env, cwd=repo, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
