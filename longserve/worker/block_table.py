"""Manager blocks -> kernel blocks.

Slots follow the CP sharding rule of longserve/cp_slot_mapping.py (its two functions stay
importable from here, their seed home).
"""
from __future__ import annotations

import numpy as np
import torch

from longserve.cp_slot_mapping import Array, compute_slot_mapping, get_dcp_local_seq_lens  # noqa: F401


def map_to_kernel_blocks(block_ids: Array, k: int) -> Array:
    """Manager block b -> kernel blocks b*k .. b*k+k-1 (kernel block = manager block / k)."""
    if k == 1:
        return block_ids
    if isinstance(block_ids, torch.Tensor):
        return (block_ids[..., None] * k + torch.arange(k, device=block_ids.device)).flatten(-2)
    ids = np.asarray(block_ids)
    return (ids[..., None] * k + np.arange(k)).reshape(*ids.shape[:-1], -1)

