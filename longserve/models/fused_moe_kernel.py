"""A fused mixture-of-experts kernel: both expert GEMMs over the step's (token, expert) pairs.

The pairs are sorted by expert and each expert's run is padded to a multiple of BLOCK_M
(`align_pairs`, torch ops with no host sync), so every block of BLOCK_M sorted slots holds the
pairs of one expert, or none (blocks past the used ones exit at once). One kernel, launched twice:
  1. gate-up: x's rows gathered by token -> silu(x W_gate^T) * (x W_up^T) -> h [slots, width]
  2. down:    h in slot order -> (h W_down^T) * routing weight -> out [pairs, hidden], pair order
A block reads its expert's weights once: at decode (a few pairs an expert) the step reads each
hit expert once, its bytes floor. Every shape depends only on the pair count (the grid covers
the worst case), so both launches are captured in CUDA graphs.
Imported only when it runs (CUDA tensors, or the CPU under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from longserve.attention.triton_kernels import _dot

# (up to this many pairs, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): provisional, until
# benchmarks/bench_moe_kernel.py --sweep has timed the others at Qwen3-30B-A3B's shapes
BLOCK_CONFIGS = [(256, 16, 64, 128, 4, 4), (2048, 32, 64, 64, 4, 4), (1 << 62, 64, 128, 64, 8, 3)]


def block_config(num_pairs: int) -> tuple:
    return next(c[1:] for c in BLOCK_CONFIGS if num_pairs <= c[0])


def align_pairs(local: torch.Tensor, num_local: int, block_m: int):
    """local [P]: each pair's expert on this rank (num_local: another rank's) -> slot_pair [S]
    (the pair in each sorted slot, P for padding) and block_expert [S / block_m] (-1: unused).
    S covers the worst case, P + num_local * (block_m - 1), so it depends on P alone."""
    num_pairs, dev = local.numel(), local.device
    num_slots = triton.cdiv(num_pairs + num_local * (block_m - 1), block_m) * block_m
    order = torch.argsort(local, stable=True)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev)
    counts = counts.scatter_add_(0, local, torch.ones_like(local))[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    shift = (padded_end - padded) - (torch.cumsum(counts, 0) - counts)  # slot - sorted position
    expert = local[order]
    mine = expert < num_local
    slot = torch.arange(num_pairs, device=dev) + shift[expert.clamp(max=num_local - 1)]
    slot = torch.where(mine, slot, num_slots)  # other ranks' pairs: a slot that is cut off
    slot_pair = torch.full((num_slots + 1,), num_pairs, dtype=torch.int64, device=dev)
    slot_pair = slot_pair.scatter_(0, slot, order)[:num_slots]
    starts = torch.arange(0, num_slots, block_m, device=dev)
    block_expert = torch.searchsorted(padded_end, starts, right=True)
    return slot_pair, torch.where(block_expert < num_local, block_expert, -1)


@triton.jit(do_not_specialize=["num_pairs"])  # one compile for every batch
def _expert_gemm(a_ptr, b_ptr, c_ptr, slot_pair_ptr, block_expert_ptr, weight_ptr, N, K,
                 num_pairs, top_k, stride_a, stride_be, stride_bn, stride_c,
                 GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One [BLOCK_M slots, BLOCK_N columns] tile of one expert's GEMM (b: [E, rows, K])."""
    expert = tl.load(block_expert_ptr + tl.program_id(0)).to(tl.int64)
    if expert < 0:
        return
    slots = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(slot_pair_ptr + slots)
    real = pairs < num_pairs
    a_rows = pairs // top_k if GATE_UP else slots  # x by token, or h by slot
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a = a_ptr + a_rows.to(tl.int64)[:, None] * stride_a + ks[None, :]
    b = b_ptr + expert * stride_be + cols[None, :] * stride_bn + ks[:, None]  # W^T [K, N] tile
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        k_ok = ks < K - k
        a_tile = tl.load(a + k, mask=real[:, None] & k_ok[None, :], other=0.0)
        b_mask = k_ok[:, None] & (cols < N)[None, :]
        acc += _dot(a_tile, tl.load(b + k, mask=b_mask, other=0.0), PRECISION, UPCAST)
        if GATE_UP:  # the up rows follow the N gate rows
            up += _dot(a_tile, tl.load(b + N * stride_bn + k, mask=b_mask, other=0.0),
                       PRECISION, UPCAST)
    if GATE_UP:
        out, c_rows = acc / (1.0 + tl.exp(-acc)) * up, slots
    else:
        out = acc * tl.load(weight_ptr + pairs, mask=real, other=0.0)[:, None]
        c_rows = pairs
    c = c_ptr + c_rows.to(tl.int64)[:, None] * stride_c + cols[None, :]
    tl.store(c, out.to(c_ptr.dtype.element_ty), mask=real[:, None] & (cols < N)[None, :])


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, local: torch.Tensor,
                  weights: torch.Tensor, top_k: int) -> torch.Tensor:
    """x [T, hidden]; w13 [E, 2 * width, hidden] (gate rows, then up); w2 [E, hidden, width];
    local [T * top_k] each pair's local expert (E: none here); weights [T * top_k] float32
    -> [T * top_k, hidden]: weight * expert(x[token]) per pair, zero for other ranks' pairs."""
    num_pairs, (num_local, hidden, width) = local.numel(), w2.shape
    bm, bn, bk, warps, stages = block_config(num_pairs)
    slot_pair, block_expert = align_pairs(local, num_local, bm)
    h = x.new_empty(slot_pair.numel(), width)
    out = x.new_zeros(num_pairs, hidden)
    on_gpu = x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    kw = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
              PRECISION="ieee" if x.dtype == torch.float32 or not on_gpu else "tf32",
              UPCAST=not on_gpu)
    x = x.contiguous()  # rows of x (and of the weights) are read with unit stride
    launches = ((True, x, w13, h, width, hidden), (False, h, w2, out, hidden, width))
    for gate_up, a, b, c, n, k in launches:  # (b's rows: n outputs, k inputs)
        _expert_gemm[(block_expert.numel(), triton.cdiv(n, bn))](
            a, b, c, slot_pair, block_expert, weights, n, k, num_pairs, top_k, a.stride(0),
            b.stride(0), b.stride(1), c.stride(0), GATE_UP=gate_up, **kw)
    return out
