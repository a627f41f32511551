"""Scales of the FP8 KV cache, per layer, KV head and K / V, fixed at load: the checkpoint's, else a
power-of-two bound from the weights no input can exceed (docs/architecture.md, 'FP8 KV cache')."""
from __future__ import annotations

import re

import torch

from longserve.attention.kv_quant import FP8_MAX

# checkpoint tensor name -> (layer, "k" | "v" | "kv")
CHECKPOINT_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.)?(k|v|kv)_scale$")


def checkpoint_scale_key(name: str) -> tuple[int, str] | None:
    m = CHECKPOINT_SCALE.match(name)
    return None if m is None else (int(m.group(1)), m.group(2))


@torch.no_grad()
def set_kv_scales(model, checkpoint_scales: dict[tuple[int, str], torch.Tensor]) -> None:
    """Give every attention layer its `kv_scale` [2, Hkv] float32 (K row, V row); a layer
    that reads another layer's KV takes that layer's scales."""
    attns = model.attention_layers()
    for i, (layer, attn) in enumerate(zip(model.layers, attns)):
        if attn.kv_sharing_target is None:
            bound = weight_bound(layer.input_layernorm.weight, layer.self_attn)
            scale = torch.exp2(torch.ceil(torch.log2((bound / FP8_MAX).clamp_min(2.0 ** -100))))
            for row, kind in enumerate("kv"):
                given = checkpoint_scales.get((i, kind), checkpoint_scales.get((i, "kv")))
                if given is not None:
                    scale[row] = heads_of(given, layer.self_attn.qkv_proj)
            attn.kv_scale = scale.contiguous()
    for attn in attns:
        if attn.kv_sharing_target is not None:
            attn.kv_scale = attns[attn.kv_sharing_target].kv_scale


def heads_of(given: torch.Tensor, qkv) -> torch.Tensor:
    """A checkpoint scale (scalar, or one per KV head of the model) -> this rank's heads."""
    given = given.float().reshape(-1).to(qkv.weight.device)
    first, n = qkv.kv_start, qkv.num_kv_heads
    return given.expand(n) if given.numel() == 1 else given[first:first + n]


def weight_bound(input_norm_weight: torch.Tensor, attn_module) -> torch.Tensor:
    """[2, Hkv]: per KV head of this rank, a bound on |k| (after RoPE) and |v| (see above)."""
    qkv = attn_module.qkv_proj
    d, q, kv = qkv.head_dim, qkv.q_size, qkv.kv_size
    w = qkv.weight.float() * input_norm_weight.float()  # gamma folded into the rows
    rows = w.norm(dim=1) * w.shape[1] ** 0.5  # [q + 2 kv]
    if qkv.bias is not None:
        rows = rows + qkv.bias.float().abs()
    k_rows, v_rows = rows[q:q + kv].view(-1, d), rows[q + kv:].view(-1, d)
    if attn_module.k_norm is not None:
        k_bound = (attn_module.k_norm.weight.float().abs().max() * d ** 0.5).expand(k_rows.shape[0])
    else:
        k_bound = torch.hypot(k_rows[:, :d // 2], k_rows[:, d // 2:]).amax(1)
    return torch.stack([k_bound, v_rows.amax(1)])
