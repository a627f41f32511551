"""Mixture-of-experts layer (Qwen3-MoE, Mixtral): router, top-k, experts over the DP x TP ranks
(dispatch / combine: docs/architecture.md, 'Expert layers'). `stages()` yields while a collective
is in flight (for DBO); `forward()` runs it to the end."""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from longserve.config import ModelConfig
from longserve.distributed.parallel_state import (ParallelState, all_gather_async, all_reduce_async,
                                                 all_to_all_async, reduce_scatter_async)
from longserve.models.fused_ops import linear, silu_and_mul, use_triton
from longserve.models.layers import _copy_checked, _param

# EP dispatches by all-gather: all-to-all measured no faster at any size (bench_dp.py --mode moe)
DISPATCH_ENV = "LONGSERVE_MOE_DISPATCH"  # "all_to_all": tests and benchmarks force it


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """transformers' routing: softmax over every expert (float32), top-k, renormalised when asked
    (Mixtral, Qwen3-MoE's norm_topk_prob) -> weights [T, k] float32, expert ids [T, k] int64."""
    if use_triton(router_logits):
        from longserve.models.fused_moe_kernel import route_triton
        return route_triton(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, expert_parallel: bool):
        super().__init__()
        num_experts, width, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        size = ps.dp.world_size * ps.tp.world_size  # the DP x TP ranks share each expert layer
        rank = ps.dp.rank_in_group * ps.tp.world_size + ps.tp.rank_in_group
        self.dp, self.tp = ps.dp, ps.tp
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts, self.expert_parallel = num_experts, expert_parallel
        if expert_parallel:  # whole experts [first, first + num_local) (the door checked the split)
            self.num_local = num_experts // size
            self.first, self.width, self.width_start = rank * self.num_local, width, 0
        else:  # every expert, columns [width_start, width_start + width) of its hidden layer
            self.num_local, self.first, self.width = num_experts, 0, width // size
            self.width_start = rank * self.width
        self.gate = ReplicatedLinear(hidden, num_experts)  # the router
        self.w13 = _param(self.num_local, 2 * self.width, hidden, loader=self.load_w13)
        self.w2 = _param(self.num_local, hidden, self.width, loader=self.load_w2)
        self.w13.expand_shard = self.w2.expand_shard = self._expand_shard

    # ---- weights: per-expert tensors (shard (kind, expert)) or fused 3-D ones ----------
    def _expand_shard(self, shard) -> list:
        """The per-expert shards a checkpoint shard stands for (for the missing-weight check)."""
        kind, expert = shard
        if expert is not None:
            return [shard]
        kinds = ("gate", "up") if kind == "gate_up" else (kind,)
        return [(k, e) for e in range(self.num_experts) for k in kinds]

    def load_w13(self, param, loaded, shard):
        kind, expert = shard
        if expert is None:  # fused [E, 2 * width, hidden]: gate rows then up rows
            full = loaded.shape[1] // 2
            for e in range(self.num_experts):
                self.load_w13(param, loaded[e, :full], ("gate", e))
                self.load_w13(param, loaded[e, full:], ("up", e))
        elif self.first <= expert < self.first + self.num_local:  # (another rank's: skipped)
            offset = 0 if kind == "gate" else self.width
            _copy_checked(param.data[expert - self.first].narrow(0, offset, self.width),
                          loaded.narrow(0, self.width_start, self.width))

    def load_w2(self, param, loaded, shard):
        _, expert = shard
        if expert is None:  # fused [E, hidden, width]
            for e in range(self.num_experts):
                self.load_w2(param, loaded[e], ("down", e))
        elif self.first <= expert < self.first + self.num_local:
            _copy_checked(param.data[expert - self.first], loaded.narrow(1, self.width_start, self.width))

    def forward(self, x: torch.Tensor, reduce: str = "all", dp_pad: int | None = None):
        return drain(self.stages(x, reduce, dp_pad, async_op=False))

    def stages(self, x: torch.Tensor, reduce: str = "all", dp_pad: int | None = None, async_op: bool = True):
        """x [T, hidden] (this DP rank's tokens, the same on its TP ranks) -> [T, hidden]
        (or this TP rank's T/tp rows with reduce="scatter"). dp_pad: the token count every
        DP rank pads to (needed when dp > 1). Yields while a collective is in flight."""
        num_tokens = x.shape[0]
        if self.dp.world_size > 1:
            if dp_pad is None or dp_pad < num_tokens:
                raise ValueError(f"expert layer with data_parallel_size={self.dp.world_size} "
                                 f"needs the DP-agreed token count (got {dp_pad} for {num_tokens})")
            x = F.pad(x, (0, 0, 0, dp_pad - num_tokens))
            all_to_all = self.expert_parallel and os.environ.get(DISPATCH_ENV) == "all_to_all"
            dispatch = self.all_to_all if all_to_all else self.all_gather
            y = (yield from dispatch(x, async_op))[:num_tokens]
        else:
            y = self.experts(x, *self.route(x))
        if self.tp.world_size > 1:
            reduce_tp = reduce_scatter_async if reduce == "scatter" else all_reduce_async
            pending = reduce_tp(self.tp, y, async_op)
            yield
            y = pending()
        return y

    def route(self, x: torch.Tensor):
        return select_experts(self.gate(x), self.top_k, self.renormalize)

    def all_gather(self, x: torch.Tensor, async_op: bool):
        """Every rank routes the DP group's tokens and sums its experts' share of each."""
        pending = all_gather_async(self.dp, x, async_op)
        yield
        x = pending()
        pending = reduce_scatter_async(self.dp, self.experts(x, *self.route(x)), async_op)
        yield
        return pending()

    def all_to_all(self, x: torch.Tensor, async_op: bool):
        """EP: tokens routed on their own rank; peer d receives [T, hidden] rows (static: every
        token) with ids of only the experts it holds (-1 elsewhere); its partial sums add up here."""
        weights, ids = self.route(x)
        k, dp, tp = ids.shape[1], self.dp.world_size, self.tp.world_size
        holder = ids // self.num_local  # MoE-group rank of each pair's expert
        meta = [torch.cat([torch.where(holder == d * tp + self.tp.rank_in_group, ids, -1).float(),
                           weights], 1) for d in range(dp)]  # ids are exact in float32
        pending = (all_to_all_async(self.dp, x.expand(dp, *x.shape), async_op),
                   all_to_all_async(self.dp, torch.stack(meta), async_op))
        yield
        xs, meta = (p().flatten(0, 1) for p in pending)
        y = self.experts(xs, meta[:, k:], meta[:, :k].long())
        pending = all_to_all_async(self.dp, y.view(dp, -1, y.shape[1]), async_op)
        yield
        return pending().sum(0, dtype=torch.float32).to(x.dtype)

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of sum_k weight_k * expert_k(x) for every row of x: each (token, k) pair
        of this rank's experts gets its own row of [T * k, hidden], summed per token in float32 (no
        atomics, no wait for the device, shapes set by T alone: CUDA graphs)."""
        if use_triton(x):  # the fused kernel finds this rank's pairs itself
            from longserve.models.fused_moe_kernel import fused_experts
            return fused_experts(x, self.w13, self.w2, ids, weights, self.first)
        return self.torch_experts(x, weights, ids)

    def torch_experts(self, x, weights, ids) -> torch.Tensor:
        """The same in torch ops: the CPU's path (docs/architecture.md, 'Experts on the GPU')."""
        num_tokens, k = ids.shape
        local = local_experts(ids, self.first, self.num_local)
        pairs = self.grouped_experts(x, local, weights.flatten(), k)
        return pairs.view(num_tokens, k, -1).sum(1, dtype=torch.float32).to(x.dtype)

    def compile_kernels(self, dtype: torch.dtype) -> None:
        """The fused path (routing, align, GEMMs, combine) once at each block config: compiled
        before serving, not by the first prefill chunks. No collective."""
        k, dev = self.top_k, self.w13.device
        if not use_triton(self.w13):
            return
        for num_pairs in (k, 2048, 8192, 8192 + k):  # one per BLOCK_CONFIGS row
            x = torch.zeros(num_pairs // k, self.w2.shape[1], dtype=dtype, device=dev)
            ids = torch.arange(num_pairs, device=dev).view(-1, k) % self.num_local + self.first
            self.experts(x, torch.ones(ids.shape, device=dev), ids)
            self.route(x)

    def grouped_experts(self, x, local, weights, k) -> torch.Tensor:
        """The same through grouped GEMMs over the pairs sorted by local expert: [T * k, hidden]."""
        order = torch.argsort(local, stable=True)
        local = local[order]
        ends = torch.searchsorted(local, torch.arange(1, self.num_local + 1, device=x.device))
        h = grouped_linear(x[order // k], self.w13, ends)
        h = grouped_linear(silu_and_mul(h), self.w2, ends)
        h = torch.where((local < self.num_local)[:, None], h.float() * weights[order, None], 0.0)
        return torch.empty_like(h, dtype=x.dtype).index_copy_(0, order, h.to(x.dtype))


def local_experts(ids: torch.Tensor, first: int, num_local: int) -> torch.Tensor:
    """Expert ids [T, k] -> [T * k] index among this rank's, num_local for another's (or id -1)."""
    local = ids.flatten() - first
    return torch.where((local >= 0) & (local < num_local), local, num_local)


class ReplicatedLinear(nn.Module):
    """A full weight on every rank (the router: its logits are needed for every expert)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = _param(out_features, in_features, loader=_copy_checked)

    def forward(self, x):
        return linear(x, self.weight)


def grouped_linear(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows of x sorted by group, group g in rows [ends[g-1], ends[g]), times w[g]^T:
    [N, in] -> [N, out]; rows past ends[-1] are left undefined. One grouped GEMM when the
    strides allow it, else one matmul per non-empty group."""
    if _grouped_mm_ok(x, w):
        return torch._grouped_mm(x, w.transpose(1, 2), offs=ends.to(torch.int32))
    out = x.new_empty(x.shape[0], w.shape[1])
    start = 0
    for g, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = F.linear(x[start:end], w[g])
        start = end
    return out


def _grouped_mm_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """torch._grouped_mm wants 16-byte aligned rows (and bf16 on CUDA)."""
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0 or (x.is_cuda and x.dtype != torch.bfloat16):
        return False
    return all(d * x.element_size() % 16 == 0 for d in (w.shape[1], w.shape[2]))


def drain(stages):
    """Run a stage generator to its end; its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value
