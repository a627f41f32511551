"""Manager blocks -> kernel blocks. Slots follow the CP sharding rule of longserve/cp_slot_mapping.py
(its two functions stay importable from here, their seed home)."""
from __future__ import annotations

import numpy as np
import torch

from longserve.cp_slot_mapping import Array, compute_slot_mapping, get_dcp_local_seq_lens  # noqa: F401


class BlockIdList:
    """One request's block ids, appended a step at a time, held as int32 with room to grow, so
    a step's block table copies each row at memory speed (Python lists cost host time a step)."""

    def __init__(self, ids):
        self.buf = np.asarray(ids, dtype=np.int32).copy()
        self.n = len(self.buf)

    def extend(self, ids) -> None:
        if not len(ids):
            return
        if self.n + len(ids) > len(self.buf):
            grown = np.empty(max(2 * len(self.buf), self.n + len(ids), 16), dtype=np.int32)
            grown[:self.n] = self.buf[:self.n]
            self.buf = grown
        self.buf[self.n:self.n + len(ids)] = ids
        self.n += len(ids)

    def __len__(self) -> int:
        return self.n

    def view(self) -> np.ndarray:
        return self.buf[:self.n]


def map_to_kernel_blocks(block_ids: Array, k: int) -> Array:
    """Manager block b -> kernel blocks b*k .. b*k+k-1 (kernel block = manager block / k)."""
    if k == 1:
        return block_ids
    if isinstance(block_ids, torch.Tensor):
        return (block_ids[..., None] * k + torch.arange(k, device=block_ids.device)).flatten(-2)
    ids = np.asarray(block_ids)
    return (ids[..., None] * k + np.arange(k)).reshape(*ids.shape[:-1], -1)

