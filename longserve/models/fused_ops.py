"""Fused elementwise steps of the decoder layer (RMSNorm(+residual), q/k-norm + RoPE, SiLU-mul) and
the decode GEMV: Triton on CUDA (imported only then), rounding as HF's torch versions; the
`*_torch` functions are the CPU path and the reference."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F


GEMV_ENV = "LONGSERVE_GEMV"  # "0": decode linears stay on cuBLAS (for A/B runs)
_GEMV = os.environ.get(GEMV_ENV, "1") != "0"
GEMV_MAX_ROWS = 16  # the most rows the GEMV takes (its dot's 16-row tile)


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or (os.environ.get("TRITON_INTERPRET") == "1" and x.device.type == "cpu")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [..., N] -> weight * norm(x); with residual: (norm(x + residual), x + residual)."""
    if not use_triton(x):
        return rms_norm_torch(x, weight, eps, residual)
    from longserve.models.fused_kernels import rms_norm_triton
    return rms_norm_triton(x, weight, eps, residual)


def rms_norm_torch(x, weight, eps, residual=None):
    if residual is not None:
        x = residual = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(x.dtype)
    return out if residual is None else (out, residual)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           norm: tuple | None = None, out: tuple | None = None, store: tuple | None = None):
    """Neox-style rotary embedding of q [T, Hq, D] and k [T, Hk, D] (each token's heads packed) in
    one kernel; cos / sin [T, D/2] float32 -> rotated (q, k), into out = (q_out, k_out) (heads
    packed) if given. norm: (q weight [D], k weight [D], eps) of per-head RMSNorms first (Qwen3).
    store (Triton only): (v, k_cache, v_cache, slot_mapping [T]) also puts each token's rotated k
    and its v in its slot of a cache of k's dtype ([N, B, Hk, D]; slot -1: not stored)."""
    if not use_triton(q):
        assert store is None, "the K/V store fused into RoPE is the Triton kernel's"
        weights = (None, None) if norm is None else norm[:2]
        return tuple(_rotary_one(x, cos, sin, w, norm and norm[2], o)
                     for x, w, o in zip((q, k), weights, out or (None, None)))
    from longserve.models.fused_kernels import rotary_triton
    return rotary_triton(q, k, cos, sin, norm, out, store)


def _rotary_one(x, cos, sin, weight, eps, out):
    x = x if weight is None else rms_norm_torch(x, weight, eps)
    return rotary_torch(x, cos, sin) if out is None else out.copy_(rotary_torch(x, cos, sin))


def rotary_torch(x, cos, sin):
    cos = torch.cat((cos, cos), dim=-1).to(x.dtype)[:, None, :]
    sin = torch.cat((sin, sin), dim=-1).to(x.dtype)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up of the MLP: [T, 2I] -> [T, I]."""
    if not use_triton(x):
        return silu_and_mul_torch(x)
    from longserve.models.fused_kernels import silu_and_mul_triton
    return silu_and_mul_triton(x)


def silu_and_mul_torch(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_rows: int = 1) -> torch.Tensor:
    """F.linear; on CUDA in bf16 / fp16, for up to max_rows rows, the Triton GEMV of
    gemv_kernel.py, which streams the weight faster than cuBLAS at one row (`bench_gemv.py`); more
    rows pay only on the LM head, which passes max_rows=GEMV_MAX_ROWS."""
    if 0 < _gemv_rows(x, weight) <= max_rows:
        from longserve.models.gemv_kernel import gemv_triton
        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(linear(x, weight)) of the MLP's [gate; up] weight; for one row, one GEMV
    kernel that writes the product (no [1, 2I] round trip, one launch fewer a layer)."""
    if _gemv_rows(x, weight) == 1:
        from longserve.models.gemv_kernel import gemv_triton
        return gemv_triton(x, weight, silu_and_mul=True)
    return silu_and_mul(F.linear(x, weight))


def _gemv_rows(x: torch.Tensor, weight: torch.Tensor) -> int:
    """x's rows where the GEMV may take it (bf16 / fp16 on CUDA, width a multiple of 256), else 0.
    Narrower multiples of 64 (SmolLM2's 576) lose to cuBLAS: the kernel's short tiles."""
    k = x.shape[-1]
    ok = (_GEMV and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and k and k % 256 == 0
          and weight.is_contiguous())
    return x.numel() // k if ok else 0
