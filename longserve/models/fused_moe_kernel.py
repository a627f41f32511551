"""Fused MoE kernels, imported only when one runs (docs/architecture.md, 'Experts on the GPU')."""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from longserve.attention.triton_kernels import _dot

# (up to this many pairs, BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): the best of
# benchmarks/bench_moe_kernel.py --sweep at Qwen3-30B-A3B's shapes, 16-8,192 tokens (within 4%)
BLOCK_CONFIGS = [(1024, 16, 64, 128, 4, 3), (2048, 32, 64, 64, 4, 4), (8192, 64, 64, 64, 4, 3),
                 (1 << 62, 128, 128, 64, 8, 3)]
PLACE_CHUNK, PLACE_BLOCKS = 128, 8  # pairs and blocks of one _place_kernel program


def block_config(num_pairs: int) -> tuple:
    return next(c[1:] for c in BLOCK_CONFIGS if num_pairs <= c[0])


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, first, num_local, num_pairs, CHUNK: tl.constexpr):
    """counts[e] += this chunk's pairs of this rank's expert e (counts zeroed before)."""
    pairs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    local = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) - first
    tl.atomic_add(counts_ptr + local, 1, mask=(local >= 0) & (local < num_local))


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _place_kernel(ids_ptr, counts_ptr, slot_pair_ptr, block_expert_ptr, first, num_local,
                  num_pairs, num_blocks, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCKS: tl.constexpr, E_BINS: tl.constexpr):
    """Each pair of this program's chunk to its expert's run (runs padded to BLOCK_M, end to end)
    at a place taken by an atomic; then its share of the blocks: their expert and padding slots."""
    e = tl.arange(0, E_BINS)
    counts = tl.load(counts_ptr + e, mask=e < num_local, other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    run_end = tl.cumsum(padded, 0)
    run_start = run_end - padded
    pairs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    local = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1) - first
    mine = (local >= 0) & (local < num_local)
    place = tl.atomic_add(counts_ptr + E_BINS + local, 1, mask=mine)  # the cursors row
    start = tl.sum(tl.where(local[:, None] == e[None, :], run_start[None, :], 0), 1)
    tl.store(slot_pair_ptr + start + place, pairs.to(tl.int64), mask=mine)
    blocks = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    expert = tl.sum((run_end[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), 1)
    tl.store(block_expert_ptr + blocks, tl.where(expert < num_local, expert, -1), mask=blocks < num_blocks)
    used_end = tl.sum(tl.where(expert[:, None] == e[None, :], (run_start + counts)[None, :], 0), 1)
    slots = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    pad = (slots >= used_end[:, None]) | (expert >= num_local)[:, None]
    tl.store(slot_pair_ptr + slots, num_pairs, mask=pad & (blocks < num_blocks)[:, None])


def align_pairs(ids: torch.Tensor, first: int, num_local: int, block_m: int):
    """ids [...] global expert ids (this rank holds [first, first + num_local)) -> slot_pair [S]
    (the pair in each sorted slot, num_pairs for padding) and block_expert [S / block_m] (-1:
    unused); S = P + num_local * (block_m - 1), the worst case."""
    ids = ids.reshape(-1).contiguous()
    num_pairs, e_bins = ids.numel(), triton.next_power_of_2(num_local)
    num_slots = triton.cdiv(num_pairs + num_local * (block_m - 1), block_m) * block_m
    slot_pair = ids.new_empty(num_slots)
    block_expert = ids.new_empty(num_slots // block_m)
    counts = torch.zeros(2, e_bins, dtype=torch.int32, device=ids.device)  # counts, cursors
    _count_kernel[(triton.cdiv(num_pairs, PLACE_CHUNK),)](ids, counts, first, num_local,
                                                         num_pairs, CHUNK=PLACE_CHUNK)
    grid = max(triton.cdiv(num_pairs, PLACE_CHUNK), triton.cdiv(block_expert.numel(), PLACE_BLOCKS))
    _place_kernel[(grid,)](ids, counts, slot_pair, block_expert, first, num_local, num_pairs,
                           block_expert.numel(), BLOCK_M=block_m, CHUNK=PLACE_CHUNK,
                           BLOCKS=PLACE_BLOCKS, E_BINS=e_bins)
    return slot_pair, block_expert


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
            up += _dot(a_tile, tl.load(b + N * stride_bn + k, mask=b_mask, other=0.0), PRECISION, UPCAST)
    if GATE_UP:
        out, c_rows = acc / (1.0 + tl.exp(-acc)) * up, slots
    else:
        out = acc * tl.load(weight_ptr + pairs, mask=real, other=0.0)[:, None]
        c_rows = pairs
    c = c_ptr + c_rows.to(tl.int64)[:, None] * stride_c + cols[None, :]
    tl.store(c, out.to(c_ptr.dtype.element_ty), mask=real[:, None] & (cols < N)[None, :])


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor,
                  weights: torch.Tensor, first: int = 0) -> torch.Tensor:
    """x [T, hidden]; w13 [E, 2 * width, hidden] (gate rows, then up); w2 [E, hidden, width];
    ids [T, top_k] global expert ids (this rank's: [first, first + E)); weights [T, top_k]
    float32 -> [T, hidden]: sum over the token's pairs of this rank's experts (not other
    ranks', nor id -1) of weight * expert(x[token])."""
    (num_tokens, top_k), (num_local, hidden, width) = ids.shape, w2.shape
    num_pairs = num_tokens * top_k
    config = block_config(num_pairs)
    slot_pair, block_expert = align_pairs(ids, first, num_local, config[0])
    weights = weights.flatten().float()  # no copy for select_experts' [T, k] float32
    h = x.new_empty(slot_pair.numel(), width)
    out = x.new_empty(num_pairs, hidden)  # rows of other ranks' pairs stay unwritten
    x = x.contiguous()  # rows of x (and of the weights) are read with unit stride
    expert_gemm(True, x, w13, h, slot_pair, block_expert, weights, top_k, config)
    expert_gemm(False, h, w2, out, slot_pair, block_expert, weights, top_k, config)
    return combine_pairs(out, ids, first, num_local)


def expert_gemm(gate_up: bool, a, b, c, slot_pair, block_expert, weights, top_k: int, config: tuple) -> None:
    """One launch over the sorted slots: gate-up (a: x by token, b: w13, c: h by slot, SiLU-and-mul)
    or down (a: h, b: w2, c: the pairs' rows, times their weight); config: a BLOCK_CONFIGS row's tiles."""
    bm, bn, bk, warps, stages = config
    n, k = (b.shape[1] // 2, b.shape[2]) if gate_up else b.shape[1:]  # b's rows: n outputs, k inputs
    on_gpu = a.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    _expert_gemm[(block_expert.numel(), triton.cdiv(n, bn))](
        a, b, c, slot_pair, block_expert, weights, n, k, weights.numel(), top_k, a.stride(0), b.stride(0),
        b.stride(1), c.stride(0), GATE_UP=gate_up, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
        num_stages=stages, PRECISION="ieee" if a.dtype == torch.float32 or not on_gpu else "tf32",
        UPCAST=not on_gpu)


@triton.jit
def _combine_kernel(pairs_ptr, ids_ptr, out_ptr, first, num_local, hidden,
                    TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[t, cols] = sum over this rank's pairs j of token t of pairs[t * TOP_K + j, cols],
    in float32 in pair order (the rows of other ranks' pairs are never read)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(TOP_K):
        local = tl.load(ids_ptr + t * TOP_K + j) - first
        end = tl.where((local >= 0) & (local < num_local), hidden, 0)  # 0: not ours, skip
        acc += tl.load(pairs_ptr + (t * TOP_K + j) * hidden + cols, mask=cols < end, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def combine_pairs(pairs: torch.Tensor, ids: torch.Tensor, first: int, num_local: int):
    """pairs [T * k, hidden] (rows of this rank's pairs written) -> [T, hidden]: one kernel
    for the zero fill, the float32 sum over k and the rounding it replaces."""
    (num_tokens, k), hidden = ids.shape, pairs.shape[1]
    out = pairs.new_empty(num_tokens, hidden)
    if num_tokens:
        block = min(1024, triton.next_power_of_2(hidden))
        _combine_kernel[(num_tokens, triton.cdiv(hidden, block))](
            pairs, ids.contiguous(), out, first, num_local, hidden, TOP_K=k, BLOCK=block,
            num_warps=4)
    return out


@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_tokens, num_experts, stride_l,
                  TOP_K: tl.constexpr, K_BLOCK: tl.constexpr, E_BLOCK: tl.constexpr,
                  T_BLOCK: tl.constexpr, RENORMALIZE: tl.constexpr):
    """select_experts for T_BLOCK tokens: float32 softmax over the experts, top-k by k
    rounds of argmax (the lower id on ties), the kept weights divided by their sum."""
    rows = tl.program_id(0) * T_BLOCK + tl.arange(0, T_BLOCK)
    experts, ks = tl.arange(0, E_BLOCK), tl.arange(0, K_BLOCK)
    row_ok = rows < num_tokens
    logits = tl.load(logits_ptr + rows.to(tl.int64)[:, None] * stride_l + experts[None, :],
                     mask=row_ok[:, None] & (experts < num_experts)[None, :],
                     other=float("-inf")).to(tl.float32)
    logits = tl.where(row_ok[:, None], logits, 0.0)  # rows past the end: no NaN
    probs = tl.exp(logits - tl.max(logits, 1)[:, None])
    probs = probs / tl.sum(probs, 1)[:, None]
    weights = tl.zeros((T_BLOCK, K_BLOCK), tl.float32)
    ids = tl.zeros((T_BLOCK, K_BLOCK), tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.argmax(probs, 1, tie_break_left=True)
        weights = tl.where(ks[None, :] == j, tl.max(probs, 1)[:, None], weights)
        ids = tl.where(ks[None, :] == j, best[:, None].to(tl.int64), ids)
        probs = tl.where(experts[None, :] == best[:, None], -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 1)[:, None]
    out = rows.to(tl.int64)[:, None] * TOP_K + ks[None, :]
    ok = row_ok[:, None] & (ks < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=ok)
    tl.store(ids_ptr + out, ids, mask=ok)


def route_triton(logits: torch.Tensor, top_k: int, renormalize: bool):
    """The router's logits [T, E] -> weights [T, k] float32, expert ids [T, k] int64, in one
    kernel (torch's softmax, top-k, sum and divide are five)."""
    num_tokens, num_experts = logits.shape
    weights = logits.new_empty(num_tokens, top_k, dtype=torch.float32)
    ids = logits.new_empty(num_tokens, top_k, dtype=torch.int64)
    if num_tokens:
        assert logits.stride(1) == 1
        t_block = 16
        _route_kernel[(triton.cdiv(num_tokens, t_block),)](
            logits, weights, ids, num_tokens, num_experts, logits.stride(0), TOP_K=top_k,
            K_BLOCK=triton.next_power_of_2(top_k), E_BLOCK=triton.next_power_of_2(num_experts),
            T_BLOCK=t_block, RENORMALIZE=renormalize, num_warps=4)
    return weights, ids
