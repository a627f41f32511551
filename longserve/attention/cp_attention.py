"""Merging partial attentions by their log-sum-exp (LSE).

A shard of keys gives, per query and head, out_i = softmax-weighted values over the shard
and lse_i = log(sum of exp(scores) over the shard). Attention over the union of shards is

    lse = logsumexp_i(lse_i)        out = sum_i exp(lse_i - lse) * out_i

An empty shard has lse_i = -inf (kernels may report NaN or +inf there: both count as
-inf) and weight 0; a query with no keys anywhere gets out = 0 and lse = -inf, never NaN.

Shapes: out [T, H, D] (any float dtype), lse [T, H] float32; math in float32.
"""
from __future__ import annotations

import math

import torch

_LN2 = math.log(2.0)


def _clean_lse(lse: torch.Tensor) -> torch.Tensor:
    """float32 LSE with NaN and +inf (empty shard) replaced by -inf."""
    lse = lse.float()
    return torch.where(torch.isnan(lse) | torch.isposinf(lse), float("-inf"), lse)


def _weighted(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out [T, H, D] * weight [T, H] in float32; a zero weight zeroes the row even if the
    row is NaN (an empty shard's output is undefined)."""
    w = weight.unsqueeze(-1)
    return torch.where(w > 0, out.float() * w, 0.0)


def correct_attn_out(out: torch.Tensor, lses: torch.Tensor, cp_rank: int, ctx=None,
                     is_lse_base_on_e: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale this rank's partial output by its share of the global softmax mass.

    out [T, H, D]: this rank's partial output; lses [N, T, H]: every rank's LSE.
    Returns (out * exp(lses[cp_rank] - lse) as a new tensor of out's dtype, lse [T, H]
    float32 in the input's base). Summing the corrected outputs over ranks gives the
    attention over all shards. `ctx` is accepted for kernel-cache compatibility; the torch
    path needs none. Base-2 LSEs (is_lse_base_on_e=False) are scaled by ln 2 for the math.
    """
    scale = 1.0 if is_lse_base_on_e else _LN2
    lses = _clean_lse(lses) * scale
    lse = torch.logsumexp(lses, dim=0)  # all -inf -> -inf
    safe_lse = torch.where(torch.isneginf(lse), 0.0, lse)
    factor = torch.where(torch.isneginf(lse), 0.0, torch.exp(lses[cp_rank] - safe_lse))
    return _weighted(out, factor).to(out.dtype), lse / scale


def _gather_lses(cp_attn_lse: torch.Tensor, cp_group) -> torch.Tensor:
    """[T, H] on each rank -> [N, T, H], rank order."""
    return cp_group.all_gather(cp_attn_lse.float().unsqueeze(0).contiguous(), 0)


def cp_lse_ag_out_rs(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group,
                     ctx=None, return_lse: bool = False, is_lse_base_on_e: bool = True,
                     scatter_dim: int = 1):
    """All-gather LSEs, correct, then sum the outputs over the group keeping this rank's slice.

    cp_attn_out [T, H, D], cp_attn_lse [T, H] of this rank's KV shard for the same queries
    on every rank. scatter_dim=1 (DCP decode: heads were all-gathered before attention):
    returns [T, H / N, D]. scatter_dim=0 (PCP: queries were all-gathered along tokens):
    returns [T / N, H, D]. With return_lse, also the global LSE sliced the same way.
    """
    N = cp_group.world_size
    if N == 1:
        return (cp_attn_out, cp_attn_lse) if return_lse else cp_attn_out
    if cp_attn_out.shape[scatter_dim] % N != 0:
        raise ValueError(f"dim {scatter_dim} of the attention output "
                         f"({cp_attn_out.shape[scatter_dim]}) must divide by the CP group "
                         f"size {N}")
    out, lse = correct_attn_out(cp_attn_out, _gather_lses(cp_attn_lse, cp_group),
                                cp_group.rank_in_group, ctx, is_lse_base_on_e)
    out = cp_group.reduce_scatter(out, dim=scatter_dim)
    if not return_lse:
        return out
    return out, lse.chunk(N, dim=scatter_dim)[cp_group.rank_in_group].contiguous()


def cp_lse_ag_out_ar(cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group,
                     ctx=None, return_lse: bool = False, is_lse_base_on_e: bool = True):
    """As cp_lse_ag_out_rs, but every rank keeps the whole merged output [T, H, D]."""
    if cp_group.world_size == 1:
        return (cp_attn_out, cp_attn_lse) if return_lse else cp_attn_out
    out, lse = correct_attn_out(cp_attn_out, _gather_lses(cp_attn_lse, cp_group),
                                cp_group.rank_in_group, ctx, is_lse_base_on_e)
    out = cp_group.all_reduce(out)
    return (out, lse) if return_lse else out


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor,
                      prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
                      suffix_lse: torch.Tensor, output_lse: torch.Tensor | None = None) -> None:
    """Merge two partial attentions of the same queries (e.g. cached context and new tokens).

    Writes output [T, H, D] and, if given, output_lse [T, H] (natural-log LSEs). The
    output may alias either input."""
    p_lse, s_lse = _clean_lse(prefix_lse), _clean_lse(suffix_lse)
    m = torch.maximum(p_lse, s_lse)
    m = torch.where(torch.isneginf(m), 0.0, m)  # both empty: weights become exp(-inf) = 0
    p_w, s_w = torch.exp(p_lse - m), torch.exp(s_lse - m)
    total = p_w + s_w  # >= 1 unless both shards are empty
    inv = torch.where(total > 0, 1.0 / total, 0.0)
    merged = _weighted(prefix_output, p_w * inv) + _weighted(suffix_output, s_w * inv)
    output.copy_(merged)
    if output_lse is not None:
        output_lse.copy_(m + torch.log(total))  # log(0) = -inf for two empty shards
