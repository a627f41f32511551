"""The decode GEMV: y = x W^T (+ b) for a few rows of x, as one streaming pass over W.

At batch 1-8 a decode step's linears are matrix-vector products: each reads its whole
weight for a handful of FLOPs, so time is bytes. cuBLAS runs Llama-3-8B's at 52-79% of an
H200's bandwidth (issue 28's profile); its smaller shapes barely fill the GPU. Here each
program streams a [BLOCK_N, K] band of W in [BLOCK_N, BLOCK_K] tiles (16-byte loads along
K), several tiles in flight, and every row of x rides along: one row accumulates products
elementwise in float32 and sums them once at the end; 2-16 rows use a tensor-core dot
(x padded to 16 rows costs no bytes). float32 accumulation, as cuBLAS.

Imported only when a kernel is about to run (`fused_ops.linear`), so a CPU install needs no
Triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # x rows a program carries (the dot's smallest M)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_x, stride_y, K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ONE_ROW: tl.constexpr, PRECISION: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    n_ok = rn < N
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]  # K % BLOCK_K == 0
    if ONE_ROW:
        acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)  # summed over K once, after the loop
        for k in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs + k, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptr + k + rk)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        rm = tl.arange(0, 1)
    else:
        rm = tl.arange(0, 16)
        x_ptrs = x_ptr + rm[:, None] * stride_x + rk[None, :]
        acc = tl.zeros((16, BLOCK_N), tl.float32)
        for k in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs + k, mask=n_ok[:, None], other=0.0)
            x = tl.load(x_ptrs + k, mask=(rm < M)[:, None], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        y = acc
    if HAS_BIAS:
        y += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm[:, None] * stride_y + rn[None, :]
    tl.store(out, y.to(y_ptr.dtype.element_ty), mask=(rm < M)[:, None] & n_ok[None, :])


def gemv_config(rows: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages), from `bench_gemv.py --sweep` on an H100: one row
    streams thin tiles of 4,096 weights along K (many programs, each with 16-byte loads and
    four tiles in flight); the dot wants 32+ columns."""
    block_k = next(b for b in (1024, 512, 256, 128, 64) if k % b == 0)  # the caller: k % 64 == 0
    return (4096 // block_k, block_k, 8, 4) if rows == 1 else (32, min(block_k, 256), 4, 4)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows), weight [N, K] contiguous -> [..., N]."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    assert m <= MAX_ROWS and weight.is_contiguous(), (m, weight.stride())
    block_n, block_k, warps, stages = config or gemv_config(m, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        _gemv_kernel[(triton.cdiv(n, block_n),)](
            x2, weight, bias if bias is not None else weight, y, m, n, x2.stride(0), y.stride(0),
            K=k, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, ONE_ROW=m == 1,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # float32: no TF32 rounding
            num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], n)
