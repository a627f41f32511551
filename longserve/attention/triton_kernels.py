"""Triton kernels for the paged KV cache (store, paged attention with LSE, merge). A layer's cache:
[2, num_blocks, block_size, Hkv, D] (K = [0], V = [1]); slot = block_id * block_size + offset.
Launch choices follow shapes and ints only (graph-capturable); all run under TRITON_INTERPRET=1."""
from __future__ import annotations

import functools
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl

from longserve.attention.cp_attention import pack_partial, unpack_partial

LOG2E = 1.4426950408889634  # 1 / ln(2): scores go through exp2
FP8_MAX = tl.constexpr(448.0)  # float8 e4m3fn's largest finite value (attention/kv_quant.py)


# ---- store_kv: scatter this step's keys and values into their cache slots --------------------

@triton.jit
def _round_to_e4m3(x):
    """x float32, |x| <= 448 -> the nearest e4m3 value (ties to even), still float32, so the cast
    that follows is exact. Not the cast's own rounding: the CPU interpreter's float -> fp8 cast
    mis-rounds (a mantissa carry drops the exponent step); this way both run the same code."""
    e = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # exponent of |x|
    ulp = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    t = tl.abs(x) / ulp
    r = tl.floor(t + 0.5)
    r = tl.where((r - t == 0.5) & (r - 2.0 * tl.floor(r * 0.5) == 1.0), r - 1.0, r)  # tie: even
    return tl.where(x < 0, -r, r) * ulp


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, kv_scale_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,  # key/value [T, H, D], last dim contiguous
    stride_cslot, stride_ch,  # cache viewed as [num_slots, H, D]
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding row, or a token that another context-parallel rank stores
        return
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < H) & (d < D)
    dst = slot * stride_cslot + h * stride_ch + d
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8:  # x / scale of its head, saturated at e4m3's largest finite value
        k_scale = tl.load(kv_scale_ptr + h, mask=h < H, other=1.0)  # [H, 1]
        v_scale = tl.load(kv_scale_ptr + H + h, mask=h < H, other=1.0)
        k = _round_to_e4m3(tl.clamp(k.to(tl.float32) / k_scale, -FP8_MAX, FP8_MAX))
        v = _round_to_e4m3(tl.clamp(v.to(tl.float32) / v_scale, -FP8_MAX, FP8_MAX))
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """key/value [T, Hkv, D] (any stride on dims 0-1), k_cache/v_cache [N, B, Hkv, D],
    slot_mapping [T] int64; slot -1 leaves the cache untouched. kv_scale [2, Hkv] float32
    (contiguous): the FP8 cache's per-head K and V scales (None: a plain cast)."""
    T, H, D = key.shape
    if T == 0:
        return
    assert value.shape == key.shape and slot_mapping.shape == (T,)
    assert key.stride(-1) == 1 and value.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.stride() == v_cache.stride() and k_cache.shape[2:] == (H, D)
    assert k_cache.stride(-1) == 1 and k_cache.stride(0) == k_cache.shape[1] * k_cache.stride(1)
    assert kv_scale is None or (kv_scale.shape == (2, H) and kv_scale.is_contiguous())
    _store_kv_kernel[(T,)](
        key, value, k_cache, v_cache, slot_mapping, kv_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        H=H, D=D, BLOCK_H=triton.next_power_of_2(H), BLOCK_D=triton.next_power_of_2(D),
        FP8=kv_scale is not None, num_warps=4 if H * D <= 4096 else 8,
    )


# ---- paged attention with LSE (decode, and prefix attention of prefill chunks) ---------------
# One program owns (a tile of query rows of one request) x (one KV head) x (one KV split). M holds
# BLOCK_Q query rows times the G query heads of the KV head (row m = query row m // G, head m % G),
# so every K/V tile read feeds G * BLOCK_Q rows of tensor-core work; online softmax in float32.

@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:  # CPU interpreter: its tl.dot multiplies bf16 bit patterns as integers
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q: tl.constexpr, PAD_PER_REQ: tl.constexpr,
                  BLOCK_R: tl.constexpr):
    """The request whose q-tiles hold program `pid`: request r owns programs [start(r), start(r+1)),
    start(r) = qsl[r] // BLOCK_Q + r * PAD_PER_REQ, a monotone bound of its q-tile count without a
    prefix sum; r = #{start(r) <= pid} - 1, from one vector load of all starts (BLOCK_R >= R)."""
    r = tl.arange(0, BLOCK_R)
    r_ok = r < num_reqs
    start = tl.load(qsl_ptr + r, mask=r_ok, other=0) // BLOCK_Q + r * PAD_PER_REQ
    return tl.sum(((start <= pid) & r_ok).to(tl.int32), axis=0) - 1


@triton.jit
def _e4m3_to_f16(x):
    """e4m3 -> float16 in asm the compiler may not move (not pure): a cast is moved past V's
    transposing trip through shared memory, which then loads a byte per instruction (it bound the
    FP8 kernel); V converts first and takes bf16's path (ldmatrix.trans). GPU only: e4m3 caches
    compile on sm_89+ (Triton's fp8e4nv), which have this cvt."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
        "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _attend_tile(acc, m_i, l_i, q, n0, kv_end, bt_row, k_ptr, v_ptr, stride_kn, stride_kb, qk_scale,
                 D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 TAIL: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One online-softmax step over the KV tokens [n0, n0 + BLOCK_N) of one request and KV head.
    TAIL: the tile may run past kv_end (only the last tile does, so only it pays for masking).
    acc [M, D] float32, m_i / l_i [M] running max (log2 units) and sum of exp2."""
    n = n0 + tl.arange(0, BLOCK_N)  # logical token positions [N]
    d = tl.arange(0, BLOCK_D)
    if TAIL:
        n_ok = n < kv_end
    else:
        n_ok = tl.full([BLOCK_N], 1, tl.int1)
    if PAGE % BLOCK_N == 0:  # the whole tile lies in one page
        page = tl.load(bt_row + n0 // PAGE).to(tl.int64)
    else:
        page = tl.load(bt_row + n // PAGE, mask=n_ok, other=0).to(tl.int64)  # [N]
    tok = page * stride_kn + (n % PAGE) * stride_kb  # [N]

    k_t = tl.load(k_ptr + tok[None, :] + d[:, None],
                  mask=n_ok[None, :] & (d < D)[:, None], other=0.0).to(q.dtype)  # [D, N]
    s = _dot(q, k_t, DOT_PRECISION, DOT_UPCAST)  # [M, N] unscaled scores
    if TAIL:
        s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)  # rescales what was summed so far
    p = tl.exp2(s * qk_scale - m_new[:, None])  # scale folded into one FMA
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_ptr + tok[:, None] + d[None, :],
                mask=n_ok[:, None] & (d < D)[None, :], other=0.0)  # [N, D]
    if v.dtype == tl.float8e4nv and q.dtype == tl.float16 and not DOT_UPCAST:
        v = _e4m3_to_f16(v)
    else:
        v = v.to(q.dtype)
    acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, DOT_PRECISION, DOT_UPCAST)
    return acc, m_new, l_i


@triton.jit
def _attend_split(q, kv_begin, kv_end, bt_row, k_ptr, v_ptr, stride_kn, stride_kb, qk_scale,
                  BLOCK_M: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  SPLIT_TAIL: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """The online softmax of q over one request's KV tokens [kv_begin, kv_end) (kv_begin a whole
    tile's): (acc [M, D], m_i [M], l_i [M]) as _attend_tile leaves them (all empty for no tokens)."""
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    if SPLIT_TAIL:  # compute-bound tiles: whole tiles unmasked, only the last one masked
        full_end = kv_begin + tl.maximum(kv_end - kv_begin, 0) // BLOCK_N * BLOCK_N
        for n0 in range(kv_begin, full_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, n0, kv_end, bt_row, k_ptr, v_ptr,
                                         stride_kn, stride_kb, qk_scale, D, PAGE, BLOCK_N, BLOCK_D,
                                         False, DOT_PRECISION, DOT_UPCAST)
        if full_end < kv_end:
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, full_end, kv_end, bt_row, k_ptr, v_ptr,
                                         stride_kn, stride_kb, qk_scale, D, PAGE, BLOCK_N, BLOCK_D,
                                         True, DOT_PRECISION, DOT_UPCAST)
    else:  # memory-bound decode: one masked loop pipelines best (measured)
        for n0 in range(kv_begin, kv_end, BLOCK_N):
            acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, n0, kv_end, bt_row, k_ptr, v_ptr,
                                         stride_kn, stride_kb, qk_scale, D, PAGE, BLOCK_N, BLOCK_D,
                                         True, DOT_PRECISION, DOT_UPCAST)
    return acc, m_i, l_i


# ints that change with a step's batch (request count, split count, the block table's width,
# the partials' strides) stay unspecialized: one compile per tile config, none while serving
@triton.jit(do_not_specialize=["num_reqs", "num_splits", "stride_bt", "stride_os", "stride_ls"])
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_table_ptr, qsl_ptr, kv_lens_ptr,
    out_ptr, lse_ptr, part_ptr, part_lse_ptr, plan_ptr, kv_scale_ptr,
    qk_scale,  # softmax scale * log2(e)
    num_reqs, num_splits,
    stride_qt, stride_qh,  # q [T, Hq, D]
    stride_kn, stride_kb, stride_kh,  # k/v cache [N, B, Hkv, D]
    stride_bt,  # block table [R, max_blocks]
    stride_os, stride_ot, stride_oh,  # out [S, T, Hq, D] (stride_os = 0 when not split)
    stride_ls, stride_lt, stride_lh,  # lse [S, T, Hq]
    stride_sc,  # kv_scale [2, Hkv] (FP8 cache)
    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr, PAD_PER_REQ: tl.constexpr, SPLIT_TAIL: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_FP8: tl.constexpr,
    DOT_F16: tl.constexpr, ITEMS: tl.constexpr,
):
    """Grid: (q-tiles, Hkv, splits), num_splits equal shares of each request's KV; or, ITEMS (decode),
    (Hkv, num_reqs + budget) items of the step's plan: a request of one item writes out / lse, the
    others' items partials [items, Hq, D] / [items, Hq] at the item's index (_merge_splits_kernel)."""
    pid, kv_head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if ITEMS:  # heads fastest: the spare programs run last (measured: the grid's order costs ~7%)
        pid, kv_head = tl.program_id(1), tl.program_id(0)
    v_scale = 1.0
    if KV_FP8:  # the head's dequantization: K's scale folds into the scores, V's into the output
        qk_scale = qk_scale * tl.load(kv_scale_ptr + kv_head)
        v_scale = tl.load(kv_scale_ptr + stride_sc + kv_head)

    shares = num_splits  # of this program's request
    if ITEMS:  # the step's plan (_plan_items_kernel)
        req, split, shares, share = _plan_entry(plan_ptr, pid)
        if req >= num_reqs:  # spare program of the upper-bound grid
            return
        row0 = tl.load(qsl_ptr + req)  # (decode: a request's one row)
    else:
        req, row0, share = _tile_rows(qsl_ptr, kv_lens_ptr, pid, num_reqs, num_splits, BLOCK_Q, BLOCK_N,
                                      PAD_PER_REQ, BLOCK_R)
    q_end = tl.load(qsl_ptr + req + 1)
    if row0 >= q_end:  # spare program of the upper-bound grid
        return
    q, row, head, d, md_ok, row_ok = _load_q(q_ptr, row0, q_end, kv_head, stride_qt, stride_qh, G, D,
                                             BLOCK_Q, BLOCK_M, BLOCK_D, DOT_F16)

    kv_len = tl.load(kv_lens_ptr + req)
    kv_begin = split * share
    acc, m_i, l_i = _attend_split(q, kv_begin, tl.minimum(kv_begin + share, kv_len),
                                  block_table_ptr + req.to(tl.int64) * stride_bt,
                                  k_cache_ptr + kv_head * stride_kh, v_cache_ptr + kv_head * stride_kh,
                                  stride_kn, stride_kb, qk_scale, BLOCK_M, D, PAGE,
                                  BLOCK_N, BLOCK_D, SPLIT_TAIL, DOT_PRECISION, DOT_UPCAST)

    if ITEMS:
        if shares > 1:  # a partial, at the item's row of [items, Hq, D] (one item: its out)
            item = pid.to(tl.int64) * (tl.num_programs(0) * G) + head
            _write_split(part_ptr + item[:, None] * D + d[None, :], part_lse_ptr + item, acc, m_i, l_i,
                         v_scale, md_ok, row_ok, shares, BLOCK_M)
            return
    o_off = (split.to(tl.int64) * stride_os + row.to(tl.int64)[:, None] * stride_ot
             + head[:, None] * stride_oh + d[None, :])
    l_off = split.to(tl.int64) * stride_ls + row.to(tl.int64) * stride_lt + head * stride_lh
    _write_split(out_ptr + o_off, lse_ptr + l_off, acc, m_i, l_i, v_scale, md_ok, row_ok, shares, BLOCK_M)


@triton.jit
def _tile_rows(qsl_ptr, kv_lens_ptr, pid, num_reqs, num_splits, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
               PAD_PER_REQ: tl.constexpr, BLOCK_R: tl.constexpr):
    """A q-tile program's request (_find_request), its first query row, and the tokens of one of
    num_splits equal shares of the request's KV (whole tiles)."""
    req = _find_request(qsl_ptr, pid, num_reqs, BLOCK_Q, PAD_PER_REQ, BLOCK_R)
    q_start = tl.load(qsl_ptr + req)
    share = tl.cdiv(tl.cdiv(tl.load(kv_lens_ptr + req), num_splits), BLOCK_N) * BLOCK_N
    return req, q_start + (pid - (q_start // BLOCK_Q + req * PAD_PER_REQ)) * BLOCK_Q, share


@triton.jit
def _plan_entry(plan_ptr, pid):
    """Item pid's (request, split, its request's items, share tokens) from plan [items, 4]."""
    return (tl.load(plan_ptr + 4 * pid), tl.load(plan_ptr + 4 * pid + 1), tl.load(plan_ptr + 4 * pid + 2),
            tl.load(plan_ptr + 4 * pid + 3))


@triton.jit
def _load_q(q_ptr, row0, q_end, kv_head, stride_qt, stride_qh, G: tl.constexpr, D: tl.constexpr,
            BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, DOT_F16: tl.constexpr):
    """The program's queries: BLOCK_Q rows from row0 x the KV head's G heads on M; q [M, D], row,
    head [M], d [D], and the masks md_ok [M, D], row_ok [M]."""
    m = tl.arange(0, BLOCK_M)
    row = row0 + m // G  # [M]
    head = kv_head * G + m % G  # [M]
    row_ok = (m < BLOCK_Q * G) & (row < q_end)
    d = tl.arange(0, BLOCK_D)
    md_ok = row_ok[:, None] & (d < D)[None, :]
    q = tl.load(q_ptr + row.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=md_ok, other=0.0)  # [M, D]
    if DOT_F16:  # every tile's K, P and V follow q's dtype (see FP8_DOT_F16)
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    return q, row, head, d, md_ok, row_ok


@triton.jit
def _write_split(o_ptrs, l_ptrs, acc, m_i, l_i, v_scale, md_ok, row_ok, num_splits, BLOCK_M: tl.constexpr):
    """This split's out [M, D] (normalized) and lse [M] (natural log) where the kernel writes. An
    empty range (kv_len == 0, or a split past the end) gives lse -inf, and out 0 when unsplit; a
    split's empty partial is not written (the merge does not read what weighs 0)."""
    nonempty = l_i > 0
    l_safe = tl.where(nonempty, l_i, 1.0)
    unsplit = tl.zeros([BLOCK_M], dtype=tl.int32) + num_splits == 1
    tl.store(o_ptrs, (acc * (v_scale / l_safe)[:, None]).to(o_ptrs.dtype.element_ty),
             mask=md_ok & (nonempty | unsplit)[:, None])
    lse = tl.where(nonempty, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # * ln(2)
    tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def _clean(lse):
    """NaN or +inf LSE (an empty or broken state) -> -inf: it weighs 0."""
    return tl.where((lse != lse) | (lse == float("inf")), float("-inf"), lse)


@triton.jit
def _merge_head(lse_row, out_row, o_dst, l_dst, stride_ps, stride_qs, num_splits, d0, D: tl.constexpr,
                BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """One row and head: the weights from all LSEs, then the partials up to the last non-empty
    split, CHUNK_S at a time (a short request's empty splits skipped), into o_dst (and l_dst)."""
    s = tl.arange(0, BLOCK_S).to(tl.int64)
    lse = _clean(tl.load(lse_row + s * stride_qs, mask=s < num_splits, other=float("-inf")))  # [S]
    m = tl.max(lse, axis=0)
    m = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.exp(lse - m), axis=0)  # empty splits weigh 0
    used = tl.max(tl.where(lse > float("-inf"), s + 1, 0), axis=0)  # past the last non-empty split
    d = d0 + tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s0 in range(0, used, CHUNK_S):
        sc = (s0 + tl.arange(0, CHUNK_S)).to(tl.int64)
        sc_ok = sc < used
        w = tl.exp(_clean(tl.load(lse_row + sc * stride_qs, mask=sc_ok, other=float("-inf"))) - m)
        o = tl.load(out_row + sc[:, None] * stride_ps + d[None, :],
                    mask=(sc_ok & (w > 0))[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)  # [C, D]
        acc += tl.sum(tl.where(w[:, None] > 0, o * w[:, None], 0.0), axis=0)
    denom_safe = tl.where(denom > 0, denom, 1.0)
    tl.store(o_dst + d, (acc / denom_safe).to(o_dst.dtype.element_ty), mask=d < D)
    if d0 == 0:
        tl.store(l_dst, tl.where(denom > 0, m + tl.log(denom_safe), float("-inf")))


@triton.jit(do_not_specialize=["stride_ps", "stride_qs", "num_splits"])  # per step: no variants
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, items_ptr, qsl_ptr,
    stride_ps, stride_pt, stride_ph,  # part_out [S, T, H, D]
    stride_qs, stride_qt, stride_qh,  # part_lse [S, T, H]
    stride_ot, stride_oh, stride_lt, stride_lh,  # out [T, H, D], lse [T, H]
    num_splits, D: tl.constexpr, BLOCK_S: tl.constexpr, CHUNK_S: tl.constexpr,
    BLOCK_D: tl.constexpr, ITEMS: tl.constexpr,
):
    """A program per (row, head, BLOCK_D of head_dim). ITEMS: a program per (request, ...): its n
    items from its first, as [items, 1, H, D] partials (the strides of S and T alike), into its
    row; a request of one item wrote its row already."""
    t = tl.program_id(0).to(tl.int64)
    d0 = tl.program_id(2) * BLOCK_D
    first = t
    if ITEMS:
        row = tl.load(qsl_ptr + t)
        num_splits = tl.load(items_ptr + 2 * t + 1)
        if (num_splits == 1) | (row >= tl.load(qsl_ptr + t + 1)):
            return
        first = tl.load(items_ptr + 2 * t).to(tl.int64)
        t = row.to(tl.int64)
    h = tl.program_id(1)
    _merge_head(part_lse_ptr + first * stride_qt + h * stride_qh, part_out_ptr + first * stride_pt + h * stride_ph,
                out_ptr + t * stride_ot + h * stride_oh, lse_ptr + t * stride_lt + h * stride_lh,
                stride_ps, stride_qs, num_splits, d0, D, BLOCK_S, CHUNK_S, BLOCK_D)


@triton.jit
def _plan_items_kernel(kv_lens_ptr, plan_ptr, items_ptr, num_reqs, budget, min_share,
                       ALIGN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr):
    """Once a step, decode's work items: request r's KV in n_r = max(1, kv_r // chunk) shares, chunk =
    max(sum(kv) / budget, min_share); <= num_reqs + budget items, none above ~2 chunks, so one long
    request beside many short ones no longer holds a step. BLOCK_I items a program, from one load of
    all kv_lens: item i's (request, split, n_r, share tokens: a multiple of ALIGN) into plan
    [R + budget, 4], each request's (first item, n_r) into items [R, 2] (the merge's)."""
    r = tl.arange(0, BLOCK_R)
    kv = tl.load(kv_lens_ptr + r, mask=r < num_reqs, other=0)
    chunk = tl.maximum(tl.cdiv(tl.sum(kv, axis=0), budget), min_share)
    n = tl.where(r < num_reqs, tl.maximum(kv // chunk, 1), 0)
    ends = tl.cumsum(n, axis=0)
    i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    req = tl.sum((ends[None, :] <= i[:, None]).to(tl.int32), axis=1)  # [I]; num_reqs: a spare item
    mine = r[None, :] == req[:, None]  # [I, R]
    n_req = tl.maximum(tl.sum(tl.where(mine, n[None, :], 0), axis=1), 1)
    first = tl.sum(tl.where(mine, ends[None, :], 0), axis=1) - n_req
    share = tl.cdiv(tl.cdiv(tl.sum(tl.where(mine, kv[None, :], 0), axis=1), n_req), ALIGN) * ALIGN
    c = tl.arange(0, 4)[None, :]
    entry = tl.where(c == 0, req[:, None], tl.where(c == 1, (i - first)[:, None],
                                                    tl.where(c == 2, n_req[:, None], share[:, None])))
    tl.store(plan_ptr + 4 * i[:, None] + c, entry, mask=(i < num_reqs + budget)[:, None])
    c = tl.arange(0, 2)[None, :]
    heads = (i == first) & (req < num_reqs)
    tl.store(items_ptr + 2 * req[:, None] + c, tl.where(c == 0, first[:, None], n_req[:, None]),
             mask=heads[:, None])


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter on CPU: small, so tests exercise the split path
    return torch.cuda.get_device_properties(device).multi_processor_count


MIN_SHARE = 256  # decode: a work item's fewest KV tokens
SPLIT_BUFFER_BYTES = 64 << 20  # the float32 partials [splits, T, Hq, D] of a call, at most


def _auto_splits(T: int, Hq: int, Hkv: int, D: int, BLOCK_Q: int, max_context: int,
                 device: torch.device) -> int:
    """A prefix part's KV splits: for ~4 programs an SM; >= 256 tokens a split, <= 256, partials
    within SPLIT_BUFFER_BYTES; a power of two (few variants); shapes only."""
    busy = triton.cdiv(T, BLOCK_Q) * Hkv  # programs that do work when requests fill T
    want = max(1, 4 * _num_sms(device) // busy)  # 512 programs on 132 SMs: 1
    cap = SPLIT_BUFFER_BYTES // (T * Hq * (D + 1) * 4)
    splits = max(1, min(want, triton.cdiv(max_context, 256), 256, cap))
    return 1 << (splits.bit_length() - 1)


def _decode_budget(R: int, Hq: int, Hkv: int, D: int, device: torch.device) -> int:
    """Decode's work items past one a request (_plan_items_kernel): ~4 programs an SM, or R (shares near the
    mean context), partials within SPLIT_BUFFER_BYTES; shapes only."""
    want = max(4 * _num_sms(device) // Hkv, R)
    return max(1, min(want, SPLIT_BUFFER_BYTES // (Hq * (D + 1) * 4) - R))


SHARE_ALIGN = 128  # a decode share's tokens: whole tiles of every decode tile (BLOCK_N <= 128)


def plan_decode(kv_lens: torch.Tensor, Hq: int, Hkv: int, D: int, budget: int | None = None):
    """Decode's work items, once a step (the backend keeps them for every layer): (budget, plan
    [R + budget, 4], items [R, 2]) int32, from _plan_items_kernel; budget None: from shapes."""
    R, dev = kv_lens.shape[0], kv_lens.device
    budget = budget or _decode_budget(R, Hq, Hkv, D, dev)
    buf = torch.empty(4 * (R + budget) + 2 * R, dtype=torch.int32, device=dev)
    plan, items = buf[:4 * (R + budget)].view(R + budget, 4), buf[4 * (R + budget):].view(R, 2)
    BLOCK_R = _request_bucket(R)
    BLOCK_I = max(1, 8192 // BLOCK_R)  # [I, R] tiles of ~8K int32s
    _plan_items_kernel[(triton.cdiv(R + budget, BLOCK_I),)](
        kv_lens, plan, items, R, budget, MIN_SHARE, ALIGN=SHARE_ALIGN if dev.type == "cuda" else 16,
        BLOCK_R=BLOCK_R, BLOCK_I=BLOCK_I)
    return budget, plan, items


def _request_bucket(num_reqs: int) -> int:
    """BLOCK_R >= R: 256 up to 256 requests. Each value compiles a variant (a compile while serving
    stalls a burst's TTFT), while a few hundred extra loads cost little."""
    return max(256, triton.next_power_of_2(num_reqs))


def _attn_tiles(G: int, D: int, T: int, Hkv: int, max_query_len: int, device: torch.device,
                fp8: bool = False):
    """(BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages) from shapes; tuned: bf16, D = 128."""
    BLOCK_D = max(16, triton.next_power_of_2(D))
    on_gpu = device.type == "cuda"
    if max_query_len <= 1:  # decode: only the G heads of the KV head on M
        BLOCK_Q = 1
    else:  # prefix attention: fill M with query rows x heads; 128 rows only when that
        # still gives 2 programs per SM (else fewer, smaller tiles balance better)
        target_m = 128 if BLOCK_D <= 128 else 64
        if triton.cdiv(T, max(1, target_m // G)) * Hkv < 2 * _num_sms(device):
            target_m = 64
        # rounded up to a power of two, so the chunk length compiles few variants
        BLOCK_Q = max(1, min((target_m if on_gpu else 16) // G, triton.next_power_of_2(max_query_len)))
    BLOCK_M = max(16, triton.next_power_of_2(BLOCK_Q * G))
    if not on_gpu:
        return BLOCK_Q, BLOCK_M, 16, BLOCK_D, 4, 1
    if BLOCK_Q == 1 and T * Hkv < 4 * _num_sms(device):  # decode, few programs: long requests' shares
        n, warps, stages = SPLIT_DECODE_FP8 if fp8 else SPLIT_DECODE_WIDE if BLOCK_M >= 32 else SPLIT_DECODE
        return BLOCK_Q, BLOCK_M, n, BLOCK_D, warps, stages
    if BLOCK_M >= 128:  # compute-bound prefix tiles
        return BLOCK_Q, BLOCK_M, 32, BLOCK_D, 8, 3
    if BLOCK_Q == 1:  # decode: memory-bound, deep pipeline (2 warps: best of a sweep)
        return BLOCK_Q, BLOCK_M, 64 if BLOCK_D <= 128 else 32, BLOCK_D, 2 if BLOCK_D <= 128 else 4, 3
    return BLOCK_Q, BLOCK_M, 64 if BLOCK_D <= 128 else 32, BLOCK_D, 4, 2


# split decode's (BLOCK_N, num_warps, num_stages), from benchmarks/bench_decode_attn.py --sweep
SPLIT_DECODE = (64, 4, 2)
SPLIT_DECODE_WIDE = (128, 4, 4)  # 32+ query heads on a KV head (tp=2 x dcp=2, one KV head): faster
# FP8 (V converted first, _e4m3_to_f16): 64-token tiles keep registers low enough for 128K in one wave
SPLIT_DECODE_FP8 = (64, 4, 2)
# FP8 cache with bf16 queries: dot in fp16. e4m3 -> fp16 is one cvt per two values on sm_90,
# -> bf16 goes through fp16 and fp32 (three more per pair), on every K and V element read;
# fp16 holds every e4m3 value and every bf16 query in [-65504, 65504] exactly (q is clamped).
FP8_DOT_F16 = True


def _split_buffers(out: torch.Tensor, lse: torch.Tensor, num_kv_splits: int):
    """Where the kernel writes: straight into (out, lse) with one split (split stride 0),
    else float32 partials [splits, T, Hq, D] / [splits, T, Hq] for `_merge_kv_splits`."""
    if num_kv_splits == 1:
        return out, lse, (0, out.stride(0), out.stride(1)), (0, lse.stride(0), lse.stride(1))
    T, Hq, D = out.shape
    o_buf = torch.empty(num_kv_splits, T, Hq, D, dtype=torch.float32, device=out.device)
    l_buf = torch.empty(num_kv_splits, T, Hq, dtype=torch.float32, device=out.device)
    return o_buf, l_buf, o_buf.stride()[:3], l_buf.stride()


def _item_buffers(R: int, budget: int, Hq: int, D: int, device: torch.device):
    """Decode's float32 partials [R + budget, 1, Hq, D] / [R + budget, 1, Hq], an item's at its index."""
    n = R + budget
    buf = torch.empty(n * Hq * (D + 1), dtype=torch.float32, device=device)
    return buf[:n * Hq * D].view(n, 1, Hq, D), buf[n * Hq * D:].view(n, 1, Hq)


def _merge_kv_splits(o_buf, l_buf, out, lse, cp_ranks: bool = False, items=None, qsl=None) -> None:
    """LSE-merge the partials into out [T, Hq, D], lse [T, Hq]: one variant up to 256 splits (a
    whole head a program, or 32 of head_dim when rows are few) or per CP size (2-16 ranks').
    items, qsl: decode's work items (plan_decode), a program per request (and head, ...)."""
    num_kv_splits, T, Hq, D = o_buf.shape
    rows = T if items is None else items.shape[0]
    few = triton.next_power_of_2(max(num_kv_splits - (0 if items is None else rows), 2))  # items: budget
    block_s, chunk_s, block_d = max(256, few), 16, triton.next_power_of_2(D)
    if cp_ranks:
        block_s, chunk_s = few, few
    elif rows * Hq < 2 * _num_sms(o_buf.device):  # one request at 128K: 256 splits over 8 heads
        chunk_s, block_d = 64, min(32, block_d)
    _merge_splits_kernel[(rows, Hq, triton.cdiv(D, block_d))](
        o_buf, l_buf, out, lse, items, qsl,
        *o_buf.stride()[:3], *l_buf.stride(),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        num_kv_splits, D=D, BLOCK_S=block_s, CHUNK_S=chunk_s, BLOCK_D=block_d,
        ITEMS=items is not None, num_warps=2 if cp_ranks else 4,
    )


def merge_partials_triton(parts: torch.Tensor, dtype: torch.dtype):
    """[S, T, H, E] packed partials (out, then its LSE: the CP exchange, attention/cp_attention.py)
    -> out [T, H, D] in `dtype`, lse [T, H]: one launch."""
    part_out, part_lse = unpack_partial(parts)
    S, T, H, D = part_out.shape
    out = torch.empty(T, H, D, dtype=dtype, device=parts.device)
    lse = torch.empty(T, H, dtype=torch.float32, device=parts.device)
    if T:
        _merge_kv_splits(part_out, part_lse, out, lse, cp_ranks=S <= 16)
    return out, lse


def paged_attention_lse(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        block_table: torch.Tensor, query_start_loc: torch.Tensor,
                        kv_lens: torch.Tensor, scale: float, max_query_len: int,
                        num_kv_splits: int | None = None, kv_scale: torch.Tensor | None = None,
                        out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
                        plan: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-causal attention of each request's query rows over its first kv_lens[r] cached tokens.

    q [T, Hq, D]; k_cache/v_cache [N, B, Hkv, D]; block_table [R, max_blocks], query_start_loc
    [R + 1], kv_lens [R] int32; kv_scale [2, Hkv] float32 (FP8 cache) or None. Returns out [T, Hq,
    D] (q's dtype, or the given `out`) and lse [T, Hq] float32, natural log (or the given `lse`; any
    strides, last dim contiguous); rows outside query_start_loc[0]:query_start_loc[R] unwritten.
    max_query_len (>= the longest request's rows) picks the tiling; num_kv_splits: a prefix's KV splits,
    decode's work-item budget (_plan_items_kernel), None: from shapes; plan: decode's (plan_decode), else built."""
    T, Hq, D = q.shape
    _, B, Hkv, Dk = k_cache.shape
    R = kv_lens.shape[0]
    assert Dk == D and Hq % Hkv == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert v_cache.stride() == k_cache.stride() and query_start_loc.shape[0] == R + 1
    G = Hq // Hkv
    out = torch.empty(T, Hq, D, dtype=q.dtype, device=q.device) if out is None else out
    lse = torch.empty(T, Hq, dtype=torch.float32, device=q.device) if lse is None else lse
    if T == 0 or R == 0:
        return out, lse

    on_gpu = q.device.type == "cuda"
    BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages = _attn_tiles(
        G, D, T, Hkv, max_query_len, q.device, kv_scale is not None)
    items = part = part_lse = None
    if BLOCK_Q == 1:  # decode: work items (plan_decode), num_kv_splits their budget
        num_kv_splits, plan, items = plan or plan_decode(kv_lens, Hq, Hkv, D, num_kv_splits)
        grid = (Hkv, R + num_kv_splits, 1)
        part, part_lse = _item_buffers(R, num_kv_splits, Hq, D, q.device)
    else:  # request r owns q-tile programs [qsl[r] // BLOCK_Q + r, ...): see _find_request
        num_kv_splits = num_kv_splits or _auto_splits(T, Hq, Hkv, D, BLOCK_Q, block_table.shape[1] * B, q.device)
        grid = (T // BLOCK_Q + R, Hkv, num_kv_splits)
    o_buf, l_buf, o_strides, l_strides = _split_buffers(out, lse, 1 if BLOCK_Q == 1 else num_kv_splits)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, block_table, query_start_loc, kv_lens, o_buf, l_buf, part, part_lse,
        plan, kv_scale, scale * LOG2E, R, num_kv_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table.stride(0),
        *o_strides, *l_strides, 0 if kv_scale is None else kv_scale.stride(0),
        G=G, D=D, PAGE=B, BLOCK_Q=BLOCK_Q, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D,
        BLOCK_R=_request_bucket(R), PAD_PER_REQ=int(BLOCK_Q > 1), SPLIT_TAIL=BLOCK_Q > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or not on_gpu else "tf32",
        DOT_UPCAST=not on_gpu or os.environ.get("TRITON_INTERPRET") == "1",
        KV_FP8=kv_scale is not None, num_warps=num_warps, num_stages=num_stages,
        DOT_F16=FP8_DOT_F16 and kv_scale is not None and q.dtype == torch.bfloat16, ITEMS=BLOCK_Q == 1,
    )
    if items is not None:
        _merge_kv_splits(part, part_lse, out, lse, items=items, qsl=query_start_loc)
    elif num_kv_splits > 1:
        _merge_kv_splits(o_buf, l_buf, out, lse)
    return out, lse


def compile_attention_variants(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               kv_scale: torch.Tensor | None, dtype: torch.dtype,
                               max_tokens: int, max_seqs: int) -> int:
    """Run the paged kernel once per tile variant a step can pick (query-length buckets 1..128, few
    and many programs, one KV split and several for prefixes), and the two merges of prefill,
    so none compiles while serving. Reads block 0 of the cache; returns the variants run."""
    _, B, Hkv, D = k_cache.shape
    dev, seen, calls = k_cache.device, set(), []
    ints = dict(dtype=torch.int32, device=dev)
    for mql in [1 << i for i in range(8)]:
        for R in sorted({1, min(max_tokens // mql, max_seqs)} - {0}):  # requests of mql rows
            T = R * mql
            tiles = _attn_tiles(num_heads // Hkv, D, T, Hkv, mql, dev, kv_scale is not None)
            for splits in ((None,) if mql == 1 else (1, 2)):  # (decode: its plan's budget)
                key = (tiles, splits, _request_bucket(R))  # (R = 1 and a full batch can share
                if key in seen:  # tiles, not BLOCK_R: a tp=2 batch of 512 compiled one)
                    continue
                seen.add(key)
                calls.append(functools.partial(
                    paged_attention_lse, torch.zeros(T, num_heads, D, dtype=dtype, device=dev),
                    k_cache, v_cache, torch.zeros(R, 1, **ints), torch.arange(0, T + 1, mql, **ints),
                    torch.ones(R, **ints), 1.0, mql, splits, kv_scale))
    calls += merge_variants(num_heads, D, dtype, dev)
    run_in_threads(calls, dev)
    return len(seen) + 2


def merge_variants(num_heads: int, head_dim: int, dtype: torch.dtype, device, cp_size: int = 1) -> list:
    """The two merges of prefill (a prefix-cache hit's; a segment's, with its LSE; else CP's first
    chunk with a prefix compiles them), one call each; under CP also the ranks' packed partials'."""
    o = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    lse = torch.zeros(1, num_heads, device=device)
    calls = [functools.partial(merge_attn_states_triton, torch.empty_like(o), o, lse, o, lse, out_lse)
             for out_lse in (None, lse.clone())]
    if cp_size > 1:
        parts = pack_partial(o, lse, dtype).expand(cp_size, -1, -1, -1).contiguous()
        calls.append(functools.partial(merge_partials_triton, parts, dtype))
    return calls


def run_in_threads(calls: list, device: torch.device) -> None:
    """Call each (a first launch: Triton compiles) from a thread pool, as Triton compiles mostly outside
    the GIL (LLVM, ptxas); under the interpreter (CPU tests) one at a time."""
    if device.type != "cuda":
        for call in calls:
            call()
        return
    _serialize_launcher_loads()
    with ThreadPoolExecutor(int(os.environ.get("LONGSERVE_COMPILE_THREADS", 8)),
                            initializer=torch.cuda.set_device, initargs=(device,)) as pool:
        list(pool.map(lambda call: call(), calls))


_LAUNCHER_LOADS = threading.Lock()


def _serialize_launcher_loads() -> None:
    """A kernel's first launch loads its launcher (Triton 3.6: a module built for its signature, every
    one under the same name) and its binary. Two threads loading at once could bind a kernel to
    another's launcher (start-up failed with "function takes exactly 56 arguments (36 given)"): the
    loads go one at a time, the compiles before them still in parallel."""
    from triton.compiler.compiler import CompiledKernel
    load = CompiledKernel._init_handles
    if getattr(load, "serialized", False):
        return

    def serialized(self):
        with _LAUNCHER_LOADS:
            return load(self)
    serialized.serialized = True
    CompiledKernel._init_handles = serialized


# ---- merge of two partial attention states (e.g. prefix over the cache + causal suffix) ------

# LSE strides and alignment follow a chunk's length (SDPA's LSE is [H, T]): no compile mid-run
@triton.jit(do_not_specialize=["stride_plt", "stride_plh", "stride_slt", "stride_slh",
                               "stride_olt", "stride_olh"],
            do_not_specialize_on_alignment=["out_lse_ptr", "p_lse_ptr", "s_lse_ptr"])
def _merge_two_kernel(
    out_ptr, out_lse_ptr, p_out_ptr, p_lse_ptr, s_out_ptr, s_lse_ptr,
    stride_ot, stride_oh, stride_pt, stride_ph, stride_st, stride_sh,  # outs [T, H, D]
    stride_plt, stride_plh, stride_slt, stride_slh, stride_olt, stride_olh,  # lses [T, H]
    H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [H]
    d = tl.arange(0, BLOCK_D)
    h_ok = h < H
    hd_ok = h_ok[:, None] & (d < D)[None, :]
    pl = _clean(tl.load(p_lse_ptr + t * stride_plt + h * stride_plh, mask=h_ok, other=float("-inf")))
    sl = _clean(tl.load(s_lse_ptr + t * stride_slt + h * stride_slh, mask=h_ok, other=float("-inf")))
    m = tl.maximum(pl, sl)
    m = tl.where(m == float("-inf"), 0.0, m)
    wp = tl.exp(pl - m)
    ws = tl.exp(sl - m)
    denom = wp + ws
    denom_safe = tl.where(denom > 0, denom, 1.0)
    po = tl.load(p_out_ptr + t * stride_pt + h[:, None] * stride_ph + d[None, :], mask=hd_ok, other=0.0)
    so = tl.load(s_out_ptr + t * stride_st + h[:, None] * stride_sh + d[None, :], mask=hd_ok, other=0.0)
    # skip a weight-0 state entirely: its output may be garbage or NaN
    out = (tl.where(wp[:, None] > 0, po.to(tl.float32) * (wp / denom_safe)[:, None], 0.0)
           + tl.where(ws[:, None] > 0, so.to(tl.float32) * (ws / denom_safe)[:, None], 0.0))
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hd_ok)
    if WRITE_LSE:
        tl.store(out_lse_ptr + t * stride_olt + h * stride_olh,
                 tl.where(denom > 0, m + tl.log(denom_safe), float("-inf")), mask=h_ok)


def merge_attn_states_triton(output: torch.Tensor, prefix_out: torch.Tensor, prefix_lse: torch.Tensor,
                             suffix_out: torch.Tensor, suffix_lse: torch.Tensor,
                             output_lse: torch.Tensor | None = None) -> None:
    """output [T, H, D] = softmax-weighted merge of two attention states over disjoint keys; lses [T, H]
    float32 (natural log), NaN / +inf counting as -inf; both -inf: output 0, lse -inf."""
    T, H, D = output.shape
    if T == 0:
        return
    for x in (output, prefix_out, suffix_out):
        assert x.shape == (T, H, D) and x.stride(-1) == 1
    lse_out = output_lse if output_lse is not None else prefix_lse  # dummy when not written
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_H = min(triton.next_power_of_2(H), max(1, 2048 // BLOCK_D))  # ~2K elements a program
    _merge_two_kernel[(T, triton.cdiv(H, BLOCK_H))](
        output, lse_out, prefix_out, prefix_lse, suffix_out, suffix_lse,
        output.stride(0), output.stride(1), prefix_out.stride(0), prefix_out.stride(1),
        suffix_out.stride(0), suffix_out.stride(1),
        prefix_lse.stride(0), prefix_lse.stride(1), suffix_lse.stride(0), suffix_lse.stride(1),
        lse_out.stride(0), lse_out.stride(1),
        H=H, D=D, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D, WRITE_LSE=output_lse is not None,
        num_warps=4,
    )
