"""Where a position's KV lives when the cache is sharded over W = pcp * dcp CP ranks (the rule, and
why a rank's shard reads as an ordinary sequence: docs/architecture.md, 'Rank layout')."""
from __future__ import annotations

import numpy as np
import torch

Array = np.ndarray | torch.Tensor


def compute_slot_mapping(block_table: Array, req_indices: Array, positions: Array,
                         block_size: int, cp_world_size: int = 1, cp_rank: int = 0,
                         interleave_size: int = 1) -> Array:
    """[N] int64 slot of each token (req_indices[i], positions[i]) on this CP rank, -1 where
    another rank stores it. numpy in -> numpy out; any torch tensor in -> torch out.
    block_table: [num_reqs, max_blocks] in units of `block_size` (per rank)."""
    W, I, B = cp_world_size, interleave_size, block_size
    if B % I != 0:
        raise ValueError(f"cp_kv_cache_interleave_size={I} must divide the block size {B}")
    if any(isinstance(a, torch.Tensor) for a in (block_table, req_indices, positions)):
        xp, as_i64 = torch, (lambda a: torch.as_tensor(a).to(torch.int64))
    else:
        xp, as_i64 = np, (lambda a: np.asarray(a, dtype=np.int64))
    table, req, pos = xp.asarray(block_table), as_i64(req_indices), as_i64(positions)
    virtual = B * W
    block = as_i64(table[req, pos // virtual])
    off = pos % virtual
    local_offset = (off // (W * I)) * I + off % I
    owner = (off // I) % W
    return xp.where(owner == cp_rank, block * B + local_offset, -1)


def get_dcp_local_seq_lens(seq_lens: torch.Tensor, dcp_size: int,
                           dcp_rank: int | None = None,
                           cp_kv_cache_interleave_size: int = 1) -> torch.Tensor:
    """How many of each sequence's tokens a CP rank stores ([B] for one rank, [B, W] for all when
    dcp_rank is None); dcp_size / dcp_rank: the CP world size and rank (pcp * dcp shards)."""
    W, I = dcp_size, cp_kv_cache_interleave_size
    # no host-to-device copy, so this can run inside a CUDA graph
    ranks = torch.arange(W, device=seq_lens.device) if dcp_rank is None else dcp_rank
    lens = seq_lens.to(torch.int64)[:, None]  # [B, 1]
    full_rounds = lens // (W * I)  # every rank got I tokens per round
    rest = lens % (W * I)  # the last round: ranks 0, 1, ... take up to I each
    extra = (rest - ranks * I).clamp(0, I)  # [B, W], or [B, 1] for one rank
    counts = (full_rounds * I + extra).to(seq_lens.dtype)
    return counts if dcp_rank is None else counts[:, 0]
