"""Attention over the paged, CP-sharded KV cache: one algorithm with torch primitives
(`TorchAttentionBackend`, the reference) or CUDA ones (`TritonAttentionBackend`: Triton, cuDNN /
flash SDPA) picked by shapes and the thresholds below (docs/architecture.md, 'Attention, concretely')."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from longserve.attention.cp_attention import (exchange_partials, merge_attn_states, merge_partials,
                                              pack_partial, unpack_partial)
from longserve.attention.kv_cache_spec import MultipleOf
from longserve.attention.kv_quant import dequantize_kv, quantize_kv
from longserve.attention.metadata import AttentionMetadata, PagedPart, VarlenLayout
from longserve.host_to_device import to_device

HALF = (torch.float16, torch.bfloat16)
# From this many query rows a request, prefix attention gathers its K/V (cheap) for the dense kernel
DENSE_PREFIX_MIN_ROWS = 128
# Below this many (query row x key) pairs a request, flash varlen beats cuDNN's per-shape set-up
FLASH_MAX_WORK = 1 << 26


def _fused(q) -> bool:  # CUDA rows in half precision: the fused kernels' (else the reference)
    return q.is_cuda and q.dtype in HALF


def _dense_prefix(q, part: PagedPart) -> bool:  # gather the prefix K/V (else Triton paged)
    return part.max_query_len >= DENSE_PREFIX_MIN_ROWS and _fused(q)


def _flash_prefix(q, part: PagedPart) -> bool:  # all in one flash call (else SDPA a request)
    qsl = part.query_start_loc_cpu
    return _fused(q) and max((qsl[r + 1] - qsl[r]) * n
                             for r, n in enumerate(part.kv_lens_cpu)) <= FLASH_MAX_WORK


def _flash_suffix(q, meta: AttentionMetadata) -> bool:  # one flash call (else SDPA a segment)
    vl = meta.prefill_varlen
    return vl is not None and _fused(q) and \
        not (len(meta.prefill_segments) == 1 and vl.max_len > FLASH_MAX_WORK ** 0.5)


class Attention(nn.Module):
    """The attention of one layer; its KV cache tensor is bound after allocation."""

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float, kv_sharing_target: int | None = None, kv_shared: bool = False):
        super().__init__()
        self.layer_idx, self.layer_name = layer_idx, f"model.layers.{layer_idx}.self_attn.attn"
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.kv_sharing_target = kv_sharing_target  # layer index whose KV this layer reads
        self.kv_shared = kv_shared  # a later layer reads this one's KV (its step rows: meta.step_kv)
        self.kv_cache: torch.Tensor | None = None  # [2, num_blocks, block_size, Hkv, D]
        # FP8 cache: [2, Hkv] float32 K and V scales of the cache it reads, else None (kv_scales.py)
        self.kv_scale: torch.Tensor | None = None

    def forward(self, q, k, v, meta: AttentionMetadata, out=None, kv_stored: bool = False):
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D] (written into `out` when given); kv_stored:
        RoPE's kernel stored k and v (rope_store)."""
        return meta.backend.forward(self, q, k, v, meta, out, kv_stored)

    def rope_store(self, meta: AttentionMetadata) -> tuple | None:
        """(k_cache, v_cache, slot_mapping) for RoPE's kernel to store this step's K/V in (one
        launch fewer a layer): a pure decode step (no PCP gather then) on the Triton backend, into
        this layer's own cache, not FP8 (its store quantizes)."""
        if meta.backend.rope_stores and meta.num_decode_tokens == meta.num_tokens and \
                self.kv_sharing_target is None and self.kv_scale is None:
            return self.kv_cache[0], self.kv_cache[1], meta.slot_mapping
        return None


class TorchAttentionBackend:
    name = "TORCH_REFERENCE"
    supports_pcp = True
    can_return_lse_for_decode = True
    supports_mtp_with_cp_non_trivial_interleave_size = False
    rope_stores = False  # the K/V store stays here (the Triton backend's goes into RoPE's kernel)

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [MultipleOf(1)]

    def forward(self, layer: Attention, q, k, v, meta: AttentionMetadata, out=None, kv_stored=False):
        ps = meta.ps
        if meta.pcp_kv_index is not None:  # the step's K/V of every PCP rank, request order
            k, v = (ps.pcp.all_gather(x, 0)[meta.pcp_kv_index] for x in (k, v))
        if layer.kv_sharing_target is None:
            if not kv_stored:
                self.store_kv(k, v, layer.kv_cache[0], layer.kv_cache[1], meta.slot_mapping, layer.kv_scale)
            if layer.kv_shared:  # kept to the step's end (a decode graph's, as long as the graph)
                meta.step_kv[layer.layer_idx] = (k, v)
        else:  # cross-layer KV sharing: the target's K/V, for the new tokens and the cache alike
            k, v = meta.step_kv[layer.kv_sharing_target]
        nd = meta.num_decode_tokens
        if nd and nd == meta.num_tokens and out is None:  # pure decode: its result is the output
            return self.sharded_paged_attention(layer, q, meta.decode, ps, False)[0]
        out = torch.empty_like(q) if out is None else out
        if nd:
            out[:nd] = self.sharded_paged_attention(layer, q[:nd], meta.decode, ps, False)[0]
        if meta.num_tokens > nd:
            out[nd:] = self.prefill_attention(layer, q[nd:], k, v, meta)
        return out

    def prefill_attention(self, layer: Attention, q, k, v, meta: AttentionMetadata):
        k, v = self.suffix_kv_heads(layer, k, v, meta.ps)
        if meta.prefix is None:
            return self.suffix_attention(q, k, v, meta, layer.scale, False)[0]
        prefix = self.sharded_paged_attention(layer, meta.ps.pcp.all_gather(q, 0), meta.prefix, meta.ps,
                                              meta.ps.pcp.world_size > 1, async_op=True)
        out, lse = self.suffix_attention(q, k, v, meta, layer.scale, True)  # under the exchange
        p_out, p_lse = prefix()
        self.merge_states(out, p_out, p_lse, out, lse)  # in place: the merge may alias an input
        return out

    def suffix_attention(self, q, k, v, meta: AttentionMetadata, scale, need_lse):
        """The prefill rows q against the step's new K/V, segment by segment."""
        need_lse = need_lse or any(s.ka > s.k0 for s in meta.prefill_segments)
        out = torch.empty_like(q)
        lse = torch.full(q.shape[:2], float("-inf"), device=q.device) if need_lse else None
        base = meta.num_decode_tokens
        for s in meta.prefill_segments:
            rows = slice(s.q0 - base, s.q1 - base)
            out[rows], l = self.segment_attention(q[rows], k, v, s, scale, need_lse)
            if need_lse:
                lse[rows] = l
        return out, lse

    def segment_attention(self, q, k, v, s, scale, need_lse):
        """q rows of one segment against its keys: full over [k0, ka), causal over [ka, kb)."""
        out, lse = self.dense_attention(q, k[s.ka:s.kb], v[s.ka:s.kb], True, scale, need_lse)
        if s.ka > s.k0:
            o2, l2 = self.dense_attention(q, k[s.k0:s.ka], v[s.k0:s.ka], False, scale, True)
            self.merge_states(out, o2, l2, out, lse, lse)  # in place: the merge may alias an input
        return out, lse

    @staticmethod
    def suffix_kv_heads(layer: Attention, k, v, ps):
        """With DCP a rank holds the KV heads of its whole DCP group (see kv_heads_of_rank);
        its own query heads, the r-th 1/dcp of the group's, read only their share."""
        dcp = ps.dcp.world_size
        if dcp == 1:
            return k, v
        per_kv = layer.num_heads * dcp // layer.num_kv_heads  # query heads per KV head
        first = ps.dcp.rank_in_group * layer.num_heads // per_kv
        count = max(1, layer.num_heads // per_kv)
        return k[:, first:first + count], v[:, first:first + count]

    def sharded_paged_attention(self, layer: Attention, q, part: PagedPart, ps, rows_split: bool,
                                async_op: bool = False):
        """Attention of q over every CP rank's shard of the cache. q [N, Hq, D]: this rank's rows, or
        (rows_split) the PCP all-gather of all ranks' rows; returns this rank's rows and heads (async_op:
        a function returning them, the exchange of partials in flight until it is called)."""
        q = ps.dcp.all_gather(q, 1)  # the DCP group's heads: they share the KV heads stored here
        args = (q, layer.kv_cache[0], layer.kv_cache[1], part, layer.scale, layer.kv_scale)
        if ps.cp.world_size == 1:
            result = self.paged_attention(*args)
            return (lambda: result) if async_op else result
        parts = exchange_partials(self.packed_paged_attention(*args), ps.cp, ps.dcp.world_size,
                                  ps.pcp.world_size if rows_split else 1, async_op=True)
        merge = lambda: self.merge_partials(parts(), q.dtype)  # noqa: E731
        return merge if async_op else merge()

    def packed_paged_attention(self, *args):
        """paged_attention's (out, lse) as one tensor in q's dtype (pack_partial)."""
        return pack_partial(*self.paged_attention(*args), args[0].dtype)

    # the primitives, reference versions (TritonAttentionBackend swaps in its own)
    @staticmethod
    def store_kv(k, v, k_cache, v_cache, slot_mapping, kv_scale=None):
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        n_heads, d = k_cache.shape[-2:]
        k_scale, v_scale = (None, None) if kv_scale is None else kv_scale
        k_cache.view(-1, n_heads, d)[slots] = quantize_kv(k[keep], k_scale, k_cache.dtype)
        v_cache.view(-1, n_heads, d)[slots] = quantize_kv(v[keep], v_scale, v_cache.dtype)

    merge_states = staticmethod(merge_attn_states)  # merge two partial attentions by LSE
    merge_partials = staticmethod(merge_partials)  # merge every CP rank's partial by LSE

    @staticmethod
    def paged_attention(q, k_cache, v_cache, part: PagedPart, scale, kv_scale=None):
        """Row group r of q over the first kv_lens[r] cached tokens of its block-table row."""
        if part.max_query_len == 1 and q.shape[0] == len(part.kv_lens_cpu):  # decode: one row a request
            return batched_decode_attention(q, k_cache, v_cache, part, scale, kv_scale)
        return gathered_paged_attention(q, k_cache, v_cache, part, scale, kv_scale)

    @staticmethod
    def dense_attention(q, k, v, causal, scale, need_lse):
        o, lse = reference_attention(q, k, v, causal, scale)
        return o.to(q.dtype), lse


def reference_attention(q, k, v, causal: bool, scale: float):
    """Softmax attention in float32. q [Sq, Hq, D], k/v [Sk, Hk, D] (GQA: Hq % Hk == 0).
    Causal is top-left aligned (row i sees keys 0..i). Returns out [Sq, Hq, D], lse [Sq, Hq]."""
    sq, hq, _ = q.shape
    if k.shape[0] == 0:
        return torch.zeros_like(q, dtype=torch.float32), torch.full((sq, hq), float("-inf"), device=q.device)
    group = hq // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if causal:
        mask = torch.ones(sq, k.shape[0], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Sq]
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return out, lse.transpose(0, 1).contiguous()


FUSED_SDPA = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


class TritonAttentionBackend(TorchAttentionBackend):
    """CUDA: Triton kernels for the paged cache, cuDNN / flash SDPA for the new tokens."""
    name = "TRITON"
    rope_stores = True

    def __init__(self, device: torch.device, dtype: torch.dtype, head_dim: int):
        from longserve.attention import triton_kernels as tk  # (Triton only where this runs)
        self.store_kv, self.paged_kernel, self.plan_decode = tk.store_kv, tk.paged_attention_lse, tk.plan_decode
        self.merge_states, self.merge_partials = tk.merge_attn_states_triton, tk.merge_partials_triton
        if device.type == "cuda":  # which SDPA op runs: decided now, before serving
            sdpa_choice(device, dtype, head_dim)

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [16, 32, 64, 128]

    def paged_attention(self, q, k_cache, v_cache, part: PagedPart, scale, kv_scale=None, out=None, lse=None):
        """out / lse (with packed_paged_attention): where the Triton kernel writes."""
        if _dense_prefix(q, part) and out is None:
            return gathered_paged_attention(q, k_cache, v_cache, part, scale, kv_scale)
        plan = None
        if part.max_query_len <= 1:  # decode's work items: planned by the step's first layer
            plan = part.packed = part.packed or self.plan_decode(part.kv_lens, q.shape[1], k_cache.shape[2],
                                                                 q.shape[2])
        return self.paged_kernel(q, k_cache, v_cache, part.block_table, part.query_start_loc,
                                 part.kv_lens, scale, part.max_query_len, kv_scale=kv_scale,
                                 out=out, lse=lse, plan=plan)

    def packed_paged_attention(self, q, k_cache, v_cache, part: PagedPart, scale, kv_scale=None):
        """Out and LSE written straight into the exchange's layout, no cat: a gathered prefix in q's
        dtype (its output's unfold copy is this write), the Triton kernel's in float32."""
        dense = _dense_prefix(q, part)
        dtype = q.dtype if dense else torch.float32
        packed = torch.empty(*q.shape[:2], q.shape[2] + 4 // dtype.itemsize, dtype=dtype, device=q.device)
        attend = gathered_paged_attention if dense else self.paged_attention
        attend(q, k_cache, v_cache, part, scale, kv_scale, *unpack_partial(packed))
        return packed

    def suffix_attention(self, q, k, v, meta: AttentionMetadata, scale, need_lse):
        """The requests' chunks (no PCP) in one flash varlen call instead of one call each; a
        single long chunk keeps cuDNN (faster there, and its per-shape set-up is amortised)."""
        if not _flash_suffix(q, meta):
            return super().suffix_attention(q, k, v, meta, scale, need_lse)
        vl = meta.prefill_varlen
        return varlen_causal(q, k[vl.k_begin:vl.k_end], v[vl.k_begin:vl.k_end], vl, scale)

    @staticmethod
    def dense_attention(q, k, v, causal, scale, need_lse):
        if need_lse or (causal and q.shape[0] > k.shape[0]):
            return sdpa_with_lse(q, k, v, causal, scale)
        group = q.shape[1] // k.shape[1]  # fused kernels want [B, H, S, D] and equal heads
        qt, kt, vt = (x.transpose(0, 1).unsqueeze(0) for x in
                      (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
        with sdpa_kernel(FUSED_SDPA):  # never the math fallback: it materialises S x S scores
            out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale)
        return out[0].transpose(0, 1), None


def sdpa_with_lse(q, k, v, causal: bool, scale: float, out=None):
    """Fused attention that also returns the LSE (the op `sdpa_choice` found), [S, H, D] layout;
    out: where the output goes (a view of the exchange's buffer, say)."""
    op, cudnn_gqa = sdpa_choice(q.device, q.dtype, q.shape[2]) if q.is_cuda else (None, False)
    group = q.shape[1] // k.shape[1]
    if k.shape[0] and op is not None and not causal and group > 1:  # GQA without copying K/V:
        return _folded_gqa(q, k, v, scale, out)  # fold each group's heads into rows
    if out is not None:  # (only the fold writes in place)
        o, lse = sdpa_with_lse(q, k, v, causal, scale)
        return out.copy_(o), lse
    if k.shape[0] == 0 or op is None:  # (None: no fused op runs here)
        out, lse = reference_attention(q, k, v, causal, scale)
        return out.to(q.dtype), lse
    if causal and q.shape[0] > k.shape[0]:  # rows past the keys (PCP pads) see every key
        n = k.shape[0]
        o1, l1 = sdpa_with_lse(q[:n], k, v, True, scale)
        o2, l2 = sdpa_with_lse(q[n:], k, v, False, scale)
        return torch.cat([o1, o2]), torch.cat([l1, l2])
    if group > 1 and cudnn_gqa:  # cuDNN takes the fewer K/V heads: no copy
        op = "cudnn"
    else:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    res = SDPA_WITH_LSE[op](*(x.transpose(0, 1).unsqueeze(0) for x in (q, k, v)), causal, scale)
    # out [H, S, D]; lse [H, S] (flash), [H, S, 1] (cuDNN) or [H, S'] with S' >= S (efficient pads)
    out, lse = res[0][0], res[1][0].reshape(q.shape[1], -1)[:, :q.shape[0]]
    return out.transpose(0, 1), lse.float().transpose(0, 1).contiguous()


def _folded_gqa(q, k, v, scale, out=None):
    """Non-causal GQA as MHA over Hkv heads: a KV head's G query heads become G x S rows of it (each
    row sees every key, so order does not matter); the output unfolds in one copy, into `out`."""
    s, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    qf = q.view(s, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, s * g, d)
    o, lse = sdpa_with_lse(qf.transpose(0, 1), k, v, False, scale)  # [S*G, Hkv, D]
    out = torch.empty_like(q) if out is None else out
    out.view(s, hkv, g, d).copy_(o.view(s, g, hkv, d).permute(0, 2, 1, 3))
    return out, lse.view(s, g, hkv).permute(0, 2, 1).reshape(s, hq)


# The fused SDPA kernels that return the LSE, private ATen ops that skip SDPA's checks (never
# give cuDNN or flash float32: wrong values): [B, H, S, D] in, (out [B, H, S, D], lse, ...) out.
SDPA_WITH_LSE = {
    "cudnn": lambda q, k, v, causal, scale: torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale),
    "flash": lambda q, k, v, causal, scale: torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale),
    "efficient": lambda q, k, v, causal, scale: torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale)}


@functools.cache
def sdpa_choice(device: torch.device, dtype: torch.dtype, head_dim: int) -> tuple[str | None, bool]:
    """(the first op of SDPA_WITH_LSE that runs this dtype and head size here, None: the reference
    math; whether cuDNN takes fewer K/V heads than query heads), found once by trying each."""
    def runs(op: str, kv_heads: int) -> bool:
        q = torch.zeros(1, 2, 17, head_dim, dtype=dtype, device=device)
        k = torch.zeros(1, kv_heads, 17, head_dim, dtype=dtype, device=device)
        try:
            for causal in (True, False):
                SDPA_WITH_LSE[op](q, k, k, causal, 1.0)
        except (RuntimeError, TypeError, NotImplementedError):
            return False
        return True
    ops = ("cudnn", "flash", "efficient") if dtype in HALF else ("efficient",)
    return next((op for op in ops if runs(op, 2)), None), dtype in HALF and runs("cudnn", 1)


def gathered_paged_attention(q, k_cache, v_cache, part: PagedPart, scale, kv_scale=None, out=None, lse=None):
    """Per request, gather its cached K/V pages (an FP8 cache dequantized to q's dtype) and attend
    without a mask: the reference paged attention, and the CUDA path for long chunks.
    q [T, Hq, D] -> out [T, Hq, D], lse [T, Hq] float32 (given: written in place, and returned)."""
    if _flash_prefix(q, part):
        o, l = flash_prefix_attention(q, k_cache, v_cache, part, scale, kv_scale)
        return (o, l) if out is None else (out.copy_(o), lse.copy_(l))
    k_scale, v_scale = (None, None) if kv_scale is None else kv_scale
    page, hkv, d = k_cache.shape[1:]
    out = torch.empty_like(q) if out is None else out
    lse = torch.empty(q.shape[:2], device=q.device) if lse is None else lse
    qsl = part.query_start_loc_cpu
    out[qsl[-1]:], lse[qsl[-1]:] = 0.0, float("-inf")  # rows past the requests' (none, as a rule)
    for r, kv_len in enumerate(part.kv_lens_cpu):
        rows = slice(qsl[r], qsl[r + 1])
        if kv_len == 0 or rows.start == rows.stop:  # no prefix: weighs 0 in the merge
            out[rows], lse[rows] = 0.0, float("-inf")
            continue
        pages = part.block_table[r, :-(-kv_len // page)].long()
        k = dequantize_kv(k_cache[pages].reshape(-1, hkv, d)[:kv_len], k_scale, q.dtype)
        v = dequantize_kv(v_cache[pages].reshape(-1, hkv, d)[:kv_len], v_scale, q.dtype)
        lse[rows] = sdpa_with_lse(q[rows], k, v, False, scale, out[rows])[1]
    return out, lse


def decode_slots(part: PagedPart, page: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, L] cache slot of each request's cached tokens (L: the longest; pads read slot 0)
    and [R, L] True at real tokens. Built once a step, by the first layer (part.packed)."""
    lens = torch.tensor(part.kv_lens_cpu, dtype=torch.int64, device=device)
    tok = torch.arange(max(part.kv_lens_cpu + [1]), device=device)
    valid = tok[None] < lens[:, None]
    table = F.pad(part.block_table.long(), (0, 1))  # a column even when no request has blocks
    pages = table.gather(1, (tok // page).clamp(max=table.shape[1] - 1).expand(len(lens), -1))
    return torch.where(valid, pages * page + tok % page, 0), valid


def batched_decode_attention(q, k_cache, v_cache, part: PagedPart, scale, kv_scale=None):
    """Decode rows (row r is request r) in one gather and one masked softmax, no Python loop over the
    requests: q [R, Hq, D] -> out [R, Hq, D], lse [R, Hq] float32 (an empty request: 0, -inf)."""
    if part.packed is None:
        part.packed = decode_slots(part, k_cache.shape[1], q.device)
    slots, valid = part.packed
    (R, hq, d), hkv = q.shape, k_cache.shape[2]
    k_scale, v_scale = (None, None) if kv_scale is None else kv_scale
    k = dequantize_kv(k_cache.flatten(0, 1)[slots], k_scale, q.dtype).float()  # [R, L, Hkv, D]
    v = dequantize_kv(v_cache.flatten(0, 1)[slots], v_scale, q.dtype).float()
    scores = torch.einsum("rhgd,rlhd->rhgl", q.float().view(R, hkv, hq // hkv, d), k) * scale
    scores = scores.masked_fill(~valid[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    out = torch.einsum("rhgl,rlhd->rhgd", probs, v).reshape(R, hq, d)
    return out.to(q.dtype), lse.reshape(R, hq)


@dataclass
class PackedPrefix:
    """Every request's (rows, cached tokens) as one varlen batch: the query rows of requests
    with a prefix, the cache slot of each of their cached tokens, and the cumulative lengths."""
    rows: torch.Tensor | None  # [Tq] rows of q taking part (None: all of them)
    slots: torch.Tensor  # [Tk] flat cache slot of each cached token, request after request
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int


def pack_prefix(part: PagedPart, page: int, device) -> PackedPrefix:
    qsl, lens = part.query_start_loc_cpu, part.kv_lens_cpu
    reqs = [r for r, n in enumerate(lens) if n > 0 and qsl[r + 1] > qsl[r]]
    nq = np.array([qsl[r + 1] - qsl[r] for r in reqs], dtype=np.int64)
    nk = np.array([lens[r] for r in reqs], dtype=np.int64)
    req_of_tok = np.repeat(np.array(reqs, dtype=np.int64), nk)
    tok = np.arange(int(nk.sum())) - np.repeat(np.cumsum(nk) - nk, nk)  # position in its prefix
    pages = part.block_table.long()[to_device(req_of_tok, device), to_device(tok // page, device)]
    slots = pages * page + to_device(tok % page, device)
    rows = None
    if len(reqs) < len(lens) or int(nq.sum()) != qsl[-1]:
        rows = to_device(np.concatenate([np.arange(qsl[r], qsl[r + 1]) for r in reqs]), device)
    cu = [to_device(np.concatenate(([0], np.cumsum(x))).astype(np.int32), device) for x in (nq, nk)]
    return PackedPrefix(rows, slots, cu[0], cu[1], int(nq.max()), int(nk.max()))


def flash_prefix_attention(q, k_cache, v_cache, part: PagedPart, scale, kv_scale=None):
    """Every request's rows against its whole cached prefix (no mask) in one flash varlen call over
    K/V gathered from the pages; rows of requests without a prefix get out 0 and lse -inf."""
    page, hkv, d = k_cache.shape[1:]
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], float("-inf"), device=q.device)
    if not any(n > 0 and b > a for n, a, b in zip(part.kv_lens_cpu, part.query_start_loc_cpu,
                                                  part.query_start_loc_cpu[1:])):
        return out, lse
    if part.packed is None:
        part.packed = pack_prefix(part, page, q.device)
    p = part.packed
    k_scale, v_scale = (None, None) if kv_scale is None else kv_scale
    k = dequantize_kv(k_cache.reshape(-1, hkv, d)[p.slots], k_scale, q.dtype)
    v = dequantize_kv(v_cache.reshape(-1, hkv, d)[p.slots], v_scale, q.dtype)
    q_in = q if p.rows is None else q[p.rows]
    o, l = torch.ops.aten._flash_attention_forward(q_in, k, v, p.cu_q, p.cu_k, p.max_q, p.max_k,
                                                   0.0, False, False, scale=scale)[:2]
    if p.rows is None:
        return o, l.transpose(0, 1)
    out[p.rows], lse[p.rows] = o, l.transpose(0, 1)
    return out, lse


def varlen_causal(q, k, v, vl: VarlenLayout, scale: float):
    """Flash attention over packed sequences, each causal over itself; q [T, Hq, D],
    k/v [T, Hkv, D] (GQA native). Returns out [T, Hq, D], lse [T, Hq] float32."""
    out, lse = torch.ops.aten._flash_attention_forward(
        q, k, v, vl.cu_seqlens, vl.cu_seqlens, vl.max_len, vl.max_len, 0.0, True, False,
        scale=scale)[:2]
    return out, lse.transpose(0, 1)  # varlen lse is [Hq, T]
