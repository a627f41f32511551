"""Mixture-of-experts layer (Qwen3-MoE, Mixtral): router, top-k, experts over the DP x TP ranks.

The experts of one layer are spread over the "MoE group": every DP x TP rank at this rank's
PCP position (vLLM's flattening of DP into TP for expert layers). Two ways to split them:
- expert parallelism (EP): each rank holds num_experts / (dp * tp) whole experts;
- otherwise tensor parallelism: each rank holds every expert, a 1 / (dp * tp) slice of its width.
Either way the step's communication is the same, all-gather + reduce-scatter:
  1. dispatch: all-gather the tokens of every DP rank (padded to the count the DP ranks
     agreed on in `coordinate_batch_across_dp`; TP ranks of one DP rank hold the same tokens);
  2. every rank routes all gathered tokens (the router is replicated) and runs its own
     experts (or expert slices) on the tokens routed to them: a partial sum per token;
  3. combine: reduce-scatter over DP gives each DP rank its own tokens' sums over the DP
     ranks, then an all-reduce over TP (or a reduce-scatter, with sequence parallelism) adds
     the TP ranks' parts.
Why not all-to-all: all-gather + reduce-scatter needs no per-step exchange of counts, gives
a fixed summation order (the same tokens on every run), exists on gloo, and moves
dp x tokens x hidden per rank, which at the decode batch sizes DP serves is latency-, not
bandwidth-bound; an all-to-all only pays once top-k x tokens is far below dp x tokens.

`stages()` is a generator that yields while a collective is in flight (started with
async_op=True): dual-batch overlap (models/dbo.py) runs two micro-batches' generators in
turn, so one micro-batch's dispatch/combine overlaps the other's compute. `forward()`
simply runs it to the end.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from longserve.config import ModelConfig
from longserve.distributed.parallel_state import GroupCoordinator, ParallelState
from longserve.models.fused_ops import silu_and_mul
from longserve.models.layers import _copy_checked, _param


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """transformers' routing: softmax over every expert (float32), top-k, then (Mixtral,
    Qwen3-MoE with norm_topk_prob) divide by the sum of the k kept weights.
    Returns weights [T, k] float32 and expert ids [T, k] int64."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_group_rank(ps: ParallelState) -> tuple[int, int]:
    """(rank, size) of this rank among the DP x TP ranks that share an expert layer."""
    size = ps.dp.world_size * ps.tp.world_size
    return ps.dp.rank_in_group * ps.tp.world_size + ps.tp.rank_in_group, size


class FusedMoE(nn.Module):
    def __init__(self, cfg: ModelConfig, ps: ParallelState, expert_parallel: bool):
        super().__init__()
        num_experts, width, hidden = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        rank, size = moe_group_rank(ps)
        self.dp, self.tp = ps.dp, ps.tp
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = num_experts
        if expert_parallel:  # whole experts [first, first + num_local)
            assert num_experts % size == 0, (num_experts, size)
            self.num_local = num_experts // size
            self.first, self.width, self.width_start = rank * self.num_local, width, 0
        else:  # every expert, columns [width_start, width_start + width) of its hidden layer
            assert width % size == 0, (width, size)
            self.num_local, self.first = num_experts, 0
            self.width = width // size
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

    def _local(self, expert: int) -> int | None:
        e = expert - self.first
        return e if 0 <= e < self.num_local else None

    def load_w13(self, param, loaded, shard):
        kind, expert = shard
        if expert is None:  # fused [E, 2 * width, hidden]: gate rows then up rows
            full = loaded.shape[1] // 2
            for e in range(self.num_experts):
                self.load_w13(param, loaded[e, :full], ("gate", e))
                self.load_w13(param, loaded[e, full:], ("up", e))
            return
        local = self._local(expert)
        if local is None:
            return
        offset = 0 if kind == "gate" else self.width
        piece = loaded.narrow(0, self.width_start, self.width)
        _copy_checked(param.data[local].narrow(0, offset, self.width), piece)

    def load_w2(self, param, loaded, shard):
        _, expert = shard
        if expert is None:  # fused [E, hidden, width]
            for e in range(self.num_experts):
                self.load_w2(param, loaded[e], ("down", e))
            return
        local = self._local(expert)
        if local is not None:
            _copy_checked(param.data[local], loaded.narrow(1, self.width_start, self.width))

    # ---- forward ---------------------------------------------------------------------
    def forward(self, x: torch.Tensor, reduce: str = "all", dp_pad: int | None = None):
        return drain(self.stages(x, reduce, dp_pad))

    def stages(self, x: torch.Tensor, reduce: str = "all", dp_pad: int | None = None):
        """x [T, hidden] (this DP rank's tokens, the same on its TP ranks) -> [T, hidden]
        (or this TP rank's T/tp rows with reduce="scatter"). dp_pad: the token count every
        DP rank pads to (needed when dp > 1). Yields while a collective is in flight."""
        num_tokens = x.shape[0]
        if self.dp.world_size > 1:
            if dp_pad is None or dp_pad < num_tokens:
                raise ValueError(f"expert layer with data_parallel_size={self.dp.world_size} "
                                 f"needs the DP-agreed token count (got {dp_pad} for {num_tokens})")
            x = F.pad(x, (0, 0, 0, dp_pad - num_tokens))
            pending = all_gather_async(self.dp, x)
            yield
            x = pending()
        weights, ids = select_experts(self.gate(x), self.top_k, self.renormalize)
        y = self.experts(x, weights, ids)
        if self.dp.world_size > 1:
            pending = reduce_scatter_async(self.dp, y)
            yield
            y = pending()[:num_tokens]
        if self.tp.world_size > 1:
            pending = (reduce_scatter_async if reduce == "scatter" else all_reduce_async)(self.tp, y)
            yield
            y = pending()
        return y

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's share of sum_k weight_k * expert_k(x) for every row of x.

        The (token, k) pairs are sorted by local expert (then token: HF's summation order);
        pairs routed to other ranks' experts sort last with weight 0. No step here waits
        for the device (group ends by searchsorted), so the host keeps queueing work."""
        num_tokens, k = ids.shape
        local = (ids - self.first).flatten()
        mine = (local >= 0) & (local < self.num_local)
        local = torch.where(mine, local, self.num_local)
        order = torch.argsort(local, stable=True)
        local = local[order]
        token = torch.div(order, k, rounding_mode="floor")
        w = torch.where(mine, weights.flatten(), 0.0)[order]
        ends = torch.searchsorted(local, torch.arange(1, self.num_local + 1, device=x.device))
        h = grouped_linear(x[token], self.w13, ends)
        h = grouped_linear(silu_and_mul(h), self.w2, ends)
        h = torch.where((local < self.num_local)[:, None], h.float() * w[:, None], 0.0)
        return torch.zeros_like(x).index_add_(0, token, h.to(x.dtype))


class ReplicatedLinear(nn.Module):
    """A full weight on every rank (the router: its logits are needed for every expert)."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = _param(out_features, in_features,
                             loader=lambda p, w, s=None: _copy_checked(p, w))

    def forward(self, x):
        return F.linear(x, self.weight)


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
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
        return False
    if x.is_cuda and x.dtype != torch.bfloat16:
        return False
    size = x.element_size()
    return all(d * size % 16 == 0 for d in (w.shape[1], w.shape[2]))


def drain(stages):
    """Run a stage generator to its end; its return value."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            return done.value


# ---- collectives that return at once; calling the result waits and gives the value -------

def _is_gloo(group: GroupCoordinator) -> bool:
    return dist.get_backend(group.device_group) == "gloo"


def all_gather_async(group: GroupCoordinator, x: torch.Tensor):
    x = x.contiguous()
    if _is_gloo(group):
        parts = [torch.empty_like(x) for _ in range(group.world_size)]
        work = dist.all_gather(parts, x, group=group.device_group, async_op=True)
        return lambda: (work.wait(), torch.cat(parts))[1]
    out = x.new_empty((group.world_size * x.shape[0],) + tuple(x.shape[1:]))
    work = dist.all_gather_into_tensor(out, x, group=group.device_group, async_op=True)
    return lambda: (work.wait(), out)[1]


def reduce_scatter_async(group: GroupCoordinator, x: torch.Tensor):
    """Sum over ranks; this rank keeps its 1/world_size of the rows."""
    x = x.contiguous()
    if _is_gloo(group):  # gloo has no reduce_scatter
        work = dist.all_reduce(x, group=group.device_group, async_op=True)
        return lambda: (work.wait(), x.chunk(group.world_size)[group.rank_in_group])[1]
    out = x.new_empty((x.shape[0] // group.world_size,) + tuple(x.shape[1:]))
    work = dist.reduce_scatter_tensor(out, x, group=group.device_group, async_op=True)
    return lambda: (work.wait(), out)[1]


def all_reduce_async(group: GroupCoordinator, x: torch.Tensor):
    work = dist.all_reduce(x, group=group.device_group, async_op=True)
    return lambda: (work.wait(), x)[1]
