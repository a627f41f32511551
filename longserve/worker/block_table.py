"""Per-request block tables, in kernel blocks, on the host and the device.

Slots follow the CP sharding rule of longserve/cp_slot_mapping.py (its two functions stay
importable from here, their seed home).
"""
from __future__ import annotations

import numpy as np
import torch

from longserve.cp_slot_mapping import Array, compute_slot_mapping, get_dcp_local_seq_lens  # noqa: F401
from longserve.worker.cpu_gpu_buffer import CpuGpuBuffer


def map_to_kernel_blocks(block_ids: Array, k: int) -> Array:
    """Manager block b -> kernel blocks b*k .. b*k+k-1 (kernel block = manager block / k)."""
    if k == 1:
        return block_ids
    if isinstance(block_ids, torch.Tensor):
        return (block_ids[..., None] * k + torch.arange(k, device=block_ids.device)).flatten(-2)
    ids = np.asarray(block_ids)
    return (ids[..., None] * k + np.arange(k)).reshape(*ids.shape[:-1], -1)


class BlockTable:
    """The block ids of every running request, in kernel blocks, on the host and the device.

    Rows are request slots of the persistent batch. Block ids come in manager blocks
    (block_size tokens per CP rank); the table stores kernel blocks
    (kernel_block_size = block_size / k) because that is what kernels index."""

    def __init__(self, block_size: int, max_num_reqs: int, max_num_blocks_per_req: int,
                 device: torch.device | str = "cpu", pin_memory: bool = False,
                 kernel_block_size: int | None = None, cp_world_size: int = 1,
                 cp_rank: int = 0, cp_kv_cache_interleave_size: int = 1):
        kernel_block_size = kernel_block_size or block_size
        if block_size % kernel_block_size != 0:
            raise ValueError(f"kernel block size {kernel_block_size} must divide the "
                             f"manager block size {block_size}")
        if kernel_block_size % cp_kv_cache_interleave_size != 0:
            raise ValueError(f"cp_kv_cache_interleave_size={cp_kv_cache_interleave_size} must "
                             f"divide the kernel block size {kernel_block_size}")
        self.block_size = block_size
        self.kernel_block_size = kernel_block_size
        self.blocks_per_kv_block = block_size // kernel_block_size  # k
        self.max_num_reqs = max_num_reqs
        self.max_num_blocks_per_req = max_num_blocks_per_req * self.blocks_per_kv_block
        self.cp_world_size = cp_world_size
        self.cp_rank = cp_rank
        self.cp_kv_cache_interleave_size = cp_kv_cache_interleave_size
        self.block_table = CpuGpuBuffer(max_num_reqs, self.max_num_blocks_per_req,
                                        dtype=torch.int32, device=device, pin_memory=pin_memory)
        self.num_blocks_per_row = np.zeros(max_num_reqs, dtype=np.int32)  # kernel blocks

    def add_row(self, row: int, block_ids: list[int]) -> None:
        """Give request slot `row` these manager blocks (replacing what it had)."""
        self.num_blocks_per_row[row] = 0
        self.append_row(row, block_ids)

    def append_row(self, row: int, block_ids: list[int]) -> None:
        """Append newly allocated manager blocks to request slot `row`."""
        if len(block_ids) == 0:
            return
        kernel_ids = map_to_kernel_blocks(np.asarray(block_ids, dtype=np.int64),
                                          self.blocks_per_kv_block)
        start = int(self.num_blocks_per_row[row])
        end = start + len(kernel_ids)
        if end > self.max_num_blocks_per_req:
            raise ValueError(f"request slot {row} needs {end} kernel blocks; the table holds "
                             f"{self.max_num_blocks_per_req}")
        self.block_table.np[row, start:end] = kernel_ids
        self.num_blocks_per_row[row] = end

    def clear_row(self, row: int) -> None:
        self.num_blocks_per_row[row] = 0

    def move_row(self, src: int, tgt: int) -> None:
        n = self.num_blocks_per_row[src]
        self.block_table.np[tgt, :n] = self.block_table.np[src, :n]
        self.num_blocks_per_row[tgt] = n

    def swap_rows(self, a: int, b: int) -> None:
        self.block_table.np[[a, b]] = self.block_table.np[[b, a]]
        self.num_blocks_per_row[[a, b]] = self.num_blocks_per_row[[b, a]]

    def compute_slot_mapping(self, req_indices: Array, positions: Array) -> Array:
        """Slots of the step's tokens on this CP rank (-1 where another rank stores them)."""
        return compute_slot_mapping(self.block_table.np, req_indices, positions,
                                    self.kernel_block_size, self.cp_world_size, self.cp_rank,
                                    self.cp_kv_cache_interleave_size)

    def commit(self, num_reqs: int) -> torch.Tensor:
        """Copy the first `num_reqs` rows to the device; return [num_reqs, max_blocks] int32."""
        return self.block_table.copy_to_gpu(num_reqs)

    def get_device_tensor(self, num_reqs: int) -> torch.Tensor:
        return self.block_table.gpu[:num_reqs]

    def get_numpy_array(self) -> np.ndarray:
        return self.block_table.np
