"""The decode GEMV: y = x W^T (+ b) for 1-16 rows of x, one streaming pass over W in [BLOCK_N,
BLOCK_K] tiles, float32 accumulation; for one row, optionally SiLU(gate) * up of the MLP's
[gate; up] weight (docs/architecture.md, 'CUDA graphs'). Imported only when it runs."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # x rows a program carries (the dot's smallest M)


@triton.jit
def _row_dot(w_ptr, x_ptr, rn, n_ok, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One row of x times rows rn of W: [BLOCK_N] float32, summed over K once, after the loop."""
    rk = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]  # K % BLOCK_K == 0
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for k in range(0, K, BLOCK_K):
        w = tl.load(w_ptrs + k, mask=n_ok[:, None], other=0.0)
        acc += w.to(tl.float32) * tl.load(x_ptr + k + rk).to(tl.float32)[None, :]
    return tl.sum(acc, axis=1)


@triton.jit(do_not_specialize=["M"])  # one variant for the LM head's 2-16 rows
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, stride_x, stride_y, K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ONE_ROW: tl.constexpr, SILU_MUL: tl.constexpr, PRECISION: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    if ONE_ROW:
        y = _row_dot(w_ptr, x_ptr, rn, n_ok, K, BLOCK_N, BLOCK_K)
        if SILU_MUL:  # W is [gate; up], each N rows: SiLU(gate) * up, rounded as silu_and_mul
            dtype = y_ptr.dtype.element_ty
            up = _row_dot(w_ptr, x_ptr, rn + N, n_ok, K, BLOCK_N, BLOCK_K).to(dtype).to(tl.float32)
            g = y.to(dtype).to(tl.float32)
            y = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32) * up
        y = y[None, :]  # [1, BLOCK_N]
        rm = tl.arange(0, 1)
    else:
        rm = tl.arange(0, 16)
        rk = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
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
    """(BLOCK_N, BLOCK_K, warps, stages), from `bench_gemv.py --sweep`: one row streams thin tiles
    of 4,096 weights along K (many programs, 16-byte loads, 4 tiles in flight); dots want 32+."""
    block_k = next(b for b in (1024, 512, 256, 128, 64) if k % b == 0)  # the caller: k % 64 == 0
    return (4096 // block_k, block_k, 8, 4) if rows == 1 else (32, min(block_k, 256), 4, 4)


def gemv_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: tuple[int, int, int, int] | None = None, silu_and_mul: bool = False):
    """x [..., K] (at most MAX_ROWS rows), weight [N, K] contiguous -> [..., N]. With
    silu_and_mul (one row, no bias): SiLU(x gate^T) * (x up^T) of W = [gate; up] -> [..., N/2]."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    assert m <= MAX_ROWS and weight.is_contiguous(), (m, weight.stride())
    assert not silu_and_mul or (m == 1 and bias is None and n % 2 == 0), (m, n)
    n_out = n // 2 if silu_and_mul else n
    block_n, block_k, warps, stages = config or gemv_config(m, k)
    y = torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if m:
        _gemv_kernel[(triton.cdiv(n_out, block_n),)](
            x2, weight, bias if bias is not None else weight, y, m, n_out, x2.stride(0), y.stride(0),
            K=k, HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, ONE_ROW=m == 1,
            SILU_MUL=silu_and_mul, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], n_out)
