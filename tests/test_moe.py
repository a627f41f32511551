"""Mixture-of-experts models (Qwen3-MoE, Mixtral) match HF transformers on one rank (float32)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_models import VOCAB, make_hf_model
from longserve import LLM
from longserve.models.moe import grouped_linear, select_experts
from test_hf_parity import check_against_hf, prompts

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


def check_fused_kernel() -> None:
    from longserve.models import fused_moe_kernel as fk
    g = torch.Generator().manual_seed(0)
    configs = [(1 << 62, 16, 16, 32, 4, 1), (1 << 62, 32, 32, 16, 4, 1)]  # K and N tails
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        for config, (num_tokens, k) in zip(configs, [(7, 2), (19, 3)]):
            fk.BLOCK_CONFIGS = [config]
            x = torch.randn(num_tokens, 40, generator=g)
            w13, w2 = torch.randn(6, 48, 40, generator=g) / 6, torch.randn(6, 40, 24, generator=g) / 5
            local = torch.randint(0, 7, (num_tokens * k,), generator=g)  # 6: another rank's
            weights = torch.rand(num_tokens * k, generator=g)
            got = fk.fused_experts(x.to(dtype), w13.to(dtype), w2.to(dtype), local, weights, k)
            ref = ref_experts(x, w13, w2, local, weights, k)
            torch.testing.assert_close(got.double(), ref, atol=tol, rtol=tol)
            slot_pair, block_expert = fk.align_pairs(local, 6, config[1])
            real = slot_pair < local.numel()
            assert sorted(slot_pair[real].tolist()) == (local < 6).nonzero().flatten().tolist()
            owner = block_expert.repeat_interleave(config[1])  # every real slot in its expert's block
            assert torch.equal(local[slot_pair[real]], owner[real])


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
