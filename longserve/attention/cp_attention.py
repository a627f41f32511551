"""Merging partial attentions by their log-sum-exp: lse = logsumexp_i(lse_i), out = sum_i
exp(lse_i - lse) * out_i. An empty shard (lse -inf, or NaN / +inf from a kernel) weighs 0; a
query with no keys gets out = 0, lse = -inf. out [T, H, D] any float dtype, lse [T, H] float32,
math in float32. The CP exchange: docs/architecture.md, 'One decode step with CP'."""
from __future__ import annotations

import torch


def _clean_lse(lse: torch.Tensor) -> torch.Tensor:
    """float32 LSE with NaN and +inf (empty shard) replaced by -inf."""
    lse = lse.float()
    return torch.where(torch.isnan(lse) | torch.isposinf(lse), float("-inf"), lse)


def _weighted(out: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """out [T, H, D] * weight [T, H] in float32; a zero weight zeroes a row even if it is NaN."""
    w = weight.unsqueeze(-1)
    return torch.where(w > 0, out.float() * w, 0.0)


def pack_partial(out: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out [N, H, D], lse [N, H] -> [N, H, D + 4 / itemsize] in `dtype`: out, then the float32 LSE's
    bytes (two columns in bf16), what the exchange sends. A prefix's partials go in the model's dtype:
    half the bytes and no cast of out (the Triton decode kernel writes the float32 layout directly)."""
    lse = lse.float().unsqueeze(-1).contiguous()
    return torch.cat([out.to(dtype), lse if dtype.itemsize == 4 else lse.view(dtype)], -1)


def unpack_partial(parts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., E] packed partials -> views (out [..., D], lse [...] float32)."""
    cols = 4 // parts.element_size()
    lse = parts[..., -cols:]
    return parts[..., :-cols], (lse if cols == 1 else lse.view(torch.float32))[..., 0]


def exchange_partials(packed: torch.Tensor, cp_group, dcp: int, row_split: int = 1, async_op: bool = False):
    """The CP merge's one collective, over the CP group (rank p * dcp + r): packed [N, Hg, E]
    (`pack_partial`, the same N rows on every rank) -> [W, N / row_split, Hg / dcp, E] packed,
    source rank first (DCP rank r keeps the r-th 1/dcp of the heads, PCP rank p the p-th 1/row_split
    of the rows; async_op: a function that waits for it, the device waits, not the host)."""
    (N, Hg, E), W = packed.shape, cp_group.world_size
    if N % row_split or Hg % dcp:
        raise ValueError(f"{N} rows / {Hg} heads must divide by {row_split} / dcp={dcp}")
    if dcp == 1 and row_split == 1:  # every rank keeps everything (PCP decode rows)
        gathered = cp_group.all_gather(packed, 0).view(W, N, Hg, E)
        return (lambda: gathered) if async_op else gathered
    parts = packed.view(row_split, N // row_split, dcp, Hg // dcp, E).transpose(1, 2)
    parts = parts.expand(W // dcp, dcp, N // row_split, Hg // dcp, E)  # rank p*dcp+r's piece
    return cp_group.all_to_all(parts.reshape(W, N // row_split, Hg // dcp, E), async_op)


def merge_partials(parts: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[W, T, H, E] (every shard's packed partial) -> out [T, H, D] in `dtype`, lse [T, H] float32:
    the log-sum-exp weighted combination (torch reference)."""
    outs, lses = unpack_partial(parts)
    lses = _clean_lse(lses)
    lse = torch.logsumexp(lses, dim=0)  # all -inf -> -inf
    weight = torch.exp(lses - torch.where(torch.isneginf(lse), 0.0, lse))  # empty shard: 0
    return _weighted(outs, weight).sum(0).to(dtype), lse


def merge_attn_states(output: torch.Tensor, prefix_output: torch.Tensor,
                      prefix_lse: torch.Tensor, suffix_output: torch.Tensor,
                      suffix_lse: torch.Tensor, output_lse: torch.Tensor | None = None) -> None:
    """Merge two partial attentions of the same queries into output [T, H, D] and, if given,
    output_lse [T, H] (natural log); the output may alias either input."""
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
