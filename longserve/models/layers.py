"""Tensor-parallel building blocks: linears, vocab-parallel embedding and LM head, RMSNorm, RoPE.
Every checkpoint parameter carries a `weight_loader(param, tensor, shard=None)` that copies in
this rank's slice, so each rank keeps only its part."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from longserve.distributed.parallel_state import GroupCoordinator
from longserve.kv_transfer.topology import kv_heads_of_rank
from longserve.models.fused_ops import GEMV_MAX_ROWS, linear, rms_norm, rotary


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor, shard=None) -> None:
    """The whole tensor (a weight_loader of an unsplit parameter)."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not fit parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _param(*shape: int, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape), requires_grad=False)
    p.weight_loader = loader
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output rows split over TP ranks; the output stays split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: GroupCoordinator):
        super().__init__()
        assert out_features % tp.world_size == 0, (out_features, tp.world_size)
        self.tp = tp
        self.out_local = out_features // tp.world_size
        self.weight = _param(self.out_local, in_features, loader=self.load_rows)
        self.bias = _param(self.out_local, loader=self.load_rows) if bias else None

    def load_rows(self, param, loaded, shard=None):
        _copy_checked(param, loaded.narrow(0, self.tp.rank_in_group * param.shape[0], param.shape[0]))

    def forward(self, x):
        return linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matrix (gate and up): shard i goes to slot i."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: GroupCoordinator):
        super().__init__(in_features, sum(out_sizes), bias, tp)
        self.local_sizes = [s // tp.world_size for s in out_sizes]
        self.weight.weight_loader = self.load_shard

    def load_shard(self, param, loaded, shard: int):
        size = self.local_sizes[shard]
        offset = sum(self.local_sizes[:shard])
        piece = loaded.narrow(0, self.tp.rank_in_group * size, size)
        _copy_checked(param.data.narrow(0, offset, size), piece)


class QKVParallelLinear(nn.Module):
    """Fused q, k, v projection; q heads split over TP, KV heads per `kv_heads_of_rank`."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: GroupCoordinator, dcp_size: int = 1):
        super().__init__()
        assert num_heads % tp.world_size == 0, (num_heads, tp.world_size)
        self.tp, self.head_dim = tp, head_dim
        self.num_heads = num_heads // tp.world_size
        self.kv_start, self.num_kv_heads = kv_heads_of_rank(num_kv_heads, tp.world_size,
                                                            tp.rank_in_group, dcp_size)
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        rows = self.q_size + 2 * self.kv_size
        self.weight = _param(rows, hidden, loader=self.load_shard)
        self.bias = _param(rows, loader=self.load_shard) if bias else None

    def load_shard(self, param, loaded, shard: str):
        d = self.head_dim
        if shard == "q":
            offset, size, start = 0, self.q_size, self.tp.rank_in_group * self.q_size
        else:
            offset = self.q_size + (0 if shard == "k" else self.kv_size)
            size, start = self.kv_size, self.kv_start * d
        _copy_checked(param.data.narrow(0, offset, size), loaded.narrow(0, start, size))

    def forward(self, x):
        qkv = linear(x, self.weight, self.bias)
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over TP; partial sums are all-reduced, or
    reduce-scattered over tokens with reduce="scatter" (sequence parallelism)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: GroupCoordinator):
        super().__init__()
        assert in_features % tp.world_size == 0, (in_features, tp.world_size)
        self.tp = tp
        self.in_local = in_features // tp.world_size
        self.weight = _param(out_features, self.in_local, loader=self.load_cols)
        self.bias = _param(out_features, loader=_copy_checked) if bias else None

    def load_cols(self, param, loaded, shard=None):
        _copy_checked(param, loaded.narrow(1, self.tp.rank_in_group * self.in_local, self.in_local))

    def forward(self, x, reduce: str = "all"):
        y = linear(x, self.weight)
        y = self.tp.reduce_scatter(y, 0) if reduce == "scatter" else self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows split over TP ranks (vocab padded to a multiple of tp)."""

    def __init__(self, vocab_size: int, hidden: int, tp: GroupCoordinator):
        super().__init__()
        self.tp, self.vocab_size = tp, vocab_size
        self.rows = -(-vocab_size // tp.world_size)
        self.start = tp.rank_in_group * self.rows
        self.weight = _param(self.rows, hidden, loader=self.load_rows)

    def load_rows(self, param, loaded, shard=None):
        if loaded.shape[0] < self.vocab_size:
            raise ValueError(f"shape {tuple(loaded.shape)} has fewer rows than vocab_size {self.vocab_size}")
        piece = loaded[self.start:self.start + self.rows]
        param.data.zero_()
        _copy_checked(param.data[:piece.shape[0]], piece)

    def forward(self, ids):
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight) * inside.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocab slice, gathered to the first TP rank."""

    def forward(self, hidden):
        logits = linear(hidden, self.weight, max_rows=GEMV_MAX_ROWS)
        logits = self.tp.gather(logits, dim=-1)
        return None if logits is None else logits[..., :self.vocab_size]

    def greedy(self, hidden):
        """[N, hidden] -> argmax [N] int64 on every TP rank, no logits gathered; ties: lower id."""
        logits = linear(hidden, self.weight, max_rows=GEMV_MAX_ROWS)
        real = max(self.vocab_size - self.start, 0)  # the last slice's padding rows are no tokens
        if real < self.rows:
            logits[:, real:] = float("-inf")
        if self.tp.world_size == 1:
            return logits.argmax(dim=-1)
        best, ids = logits.max(dim=-1)  # (the first maximum, as argmax)
        assert self.vocab_size < 1 << 24  # float32 holds a bf16 / fp16 logit and an id exactly
        pairs = self.tp.all_gather(torch.stack([best.float(), ids.add_(self.start).float()]))
        pairs = pairs.view(self.tp.world_size, 2, -1)  # [rank, (logit, id), row]
        rank = pairs[:, 0].argmax(dim=0, keepdim=True)  # the first rank on ties: the lower ids
        return pairs[:, 1].gather(0, rank)[0].long()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, loader=_copy_checked)

    def forward(self, x, residual=None):
        """With `residual`: returns (norm(x + residual), x + residual), the fused pre-norm step."""
        return rms_norm(x, self.weight, self.eps, residual)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    return _llama3_inv_freq(inv_freq, scaling)  # (ModelConfig.check refuses any other kind)


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths slowed by `factor`, short kept."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate halves), cos/sin computed from positions each step."""

    def __init__(self, head_dim: int, theta: float, scaling: dict | None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def cos_sin(self, positions):
        """positions [T] -> cos, sin [T, D/2] float32; one per step, shared by every layer."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    def forward(self, cos_sin, q, k, q_norm=None, k_norm=None, out=None, store=None):
        """q [T, Hq, D], k [T, Hk, D]; q_norm, k_norm: per-head norms first; out: (q_out, k_out);
        store: see fused_ops.rotary."""
        norm = None if q_norm is None else (q_norm.weight, k_norm.weight, q_norm.eps)
        return rotary(q, k, *cos_sin, norm, out, store)
