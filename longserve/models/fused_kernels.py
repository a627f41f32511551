"""Triton kernels behind `fused_ops` (CUDA tensors, or the CPU under TRITON_INTERPRET=1), imported
only when one runs; each reproduces the rounding of the torch version it replaces."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---- RMSNorm, optionally fused with the residual add: one program per row --------------------

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, stride_x, stride_r, stride_o,
                     stride_ro, eps, N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_RES:  # x + residual, rounded to the dtype as torch's add does, is the new residual
        x = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0)
             .to(tl.float32)).to(x.dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=ok)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    out = h.to(x.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x, weight, eps, residual=None):
    shape, n = x.shape, x.shape[-1]
    x2 = x.reshape(-1, n)
    rows = x2.shape[0]
    out = torch.empty(rows, n, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res2 = residual.reshape(-1, n) if residual is not None else x2
    res_out = torch.empty_like(x2) if residual is not None else out
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](x2, res2, weight, out, res_out, x2.stride(0), res2.stride(0),
                                  out.stride(0), res_out.stride(0), eps, N=n, BLOCK=block,
                                  HAS_RES=residual is not None,
                                  num_warps=min(16, max(1, block // 256)))
    out = out.view(shape)
    return out if residual is None else (out, res_out.view(shape))


# ---- Neox-style rotary embedding of q and k, optionally after a per-head RMSNorm (Qwen3's q/k norm) --
# one program per token, all its q heads and then all its k heads; with STORE also the token's rotated
# k and its v into their cache slot (a decode step's KV store, one launch fewer a layer)

@triton.jit
def _rotate_heads(x_ptr, out_ptr, c, s, w_ptr, eps, H, i, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  NORM: tl.constexpr):
    """One token's H heads (x_ptr, out_ptr: at that token's row, heads 2 * HALF apart); c, s [1, BLOCK].
    Returns the rotated halves [BLOCK_H, BLOCK], as stored."""
    h = tl.arange(0, BLOCK_H)[:, None] * (2 * HALF)
    ok = (h < H * 2 * HALF) & (i < HALF)
    x1 = tl.load(x_ptr + h + i, mask=ok, other=0.0)
    x2 = tl.load(x_ptr + h + HALF + i, mask=ok, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:  # RMSNorm over each head's 2 * HALF values, rounded as rms_norm_torch rounds
        r = tl.rsqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + i, mask=i < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i, mask=i < HALF, other=0.0).to(tl.float32)
        a = ((a * r).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        b = ((b * r).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    lo, hi = (a * c - b * s).to(x1.dtype), (b * c + a * s).to(x1.dtype)
    tl.store(out_ptr + h + i, lo, mask=ok)
    tl.store(out_ptr + h + HALF + i, hi, mask=ok)
    return lo, hi


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps, stride_q, stride_k,
                   stride_qo, stride_ko, stride_c, v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_v, stride_slot,
                   HQ, HK, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                   BLOCK: tl.constexpr, NORM: tl.constexpr, STORE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)[None, :]
    dtype = q_ptr.dtype.element_ty  # cos / sin rounded to it, as HF multiplies in the model dtype
    c = tl.load(cos_ptr + t * stride_c + i, mask=i < HALF, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_c + i, mask=i < HALF, other=0.0).to(dtype).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_q, qo_ptr + t * stride_qo, c, s, qw_ptr, eps, HQ, i, HALF, BLOCK_HQ,
                  NORM)
    k_lo, k_hi = _rotate_heads(k_ptr + t * stride_k, ko_ptr + t * stride_ko, c, s, kw_ptr, eps, HK, i, HALF,
                               BLOCK_HK, NORM)
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # (-1: a padding row, or a token another CP rank stores)
            h = tl.arange(0, BLOCK_HK)[:, None] * (2 * HALF)  # the halves' layout, as _rotate_heads's
            ok = (h < HK * 2 * HALF) & (i < HALF)
            kc, vc = kc_ptr + slot * stride_slot + h + i, vc_ptr + slot * stride_slot + h + i
            v = v_ptr + t * stride_v + h + i
            tl.store(kc, k_lo, mask=ok)
            tl.store(kc + HALF, k_hi, mask=ok)
            tl.store(vc, tl.load(v, mask=ok), mask=ok)
            tl.store(vc + HALF, tl.load(v + HALF, mask=ok), mask=ok)


def rotary_triton(q, k, cos, sin, norm=None, out=None, store=None):
    (T, HQ, D), HK = q.shape, k.shape[1]
    q_out, k_out = out or (q.new_empty(q.shape), k.new_empty(k.shape))
    if T:  # each token's heads packed (views of the fused QKV output are)
        v, k_cache, v_cache, slots = store or (k, k, k, cos)  # dummy pointers without the store
        assert all(x.stride()[1:] == (D, 1) for x in (q, k, v, q_out, k_out)) and cos.stride() == sin.stride()
        assert store is None or (k_cache.dtype == k.dtype and k_cache.stride() == v_cache.stride()
                                 and k_cache.stride() == (k_cache.shape[1] * HK * D, HK * D, D, 1)
                                 and slots.shape == (T,))
        qw, kw, eps = norm or (cos, cos, 0.0)  # (and without the norm)
        _rotary_kernel[(T,)](q, k, q_out, k_out, cos, sin, qw, kw, eps, q.stride(0), k.stride(0),
                             q_out.stride(0), k_out.stride(0), cos.stride(0), v, k_cache, v_cache, slots,
                             v.stride(0), k_cache.stride(1), HQ, HK, HALF=D // 2,
                             BLOCK_HQ=triton.next_power_of_2(HQ), BLOCK_HK=triton.next_power_of_2(HK),
                             BLOCK=triton.next_power_of_2(D // 2), NORM=norm is not None,
                             STORE=store is not None, num_warps=4 if HQ * D >= 2048 else 2)
    return q_out, k_out


# ---- SiLU(gate) * up of the MLP: [T, 2I] -> [T, I] -------------------------------------------

@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + I + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # silu, rounded as F.silu's output is
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype),
             mask=ok)


def silu_and_mul_triton(x):
    T, two_i = x.shape
    i = two_i // 2
    out = torch.empty(T, i, dtype=x.dtype, device=x.device)
    if T:
        assert x.stride(-1) == 1
        block = min(1024, triton.next_power_of_2(i))
        _silu_and_mul_kernel[(T, triton.cdiv(i, block))](x, out, x.stride(0), out.stride(0), i,
                                                         BLOCK=block, num_warps=4)
    return out

