"""Per-request block tables and the CP-aware slot mapping.

With context parallelism the KV cache of a request is sharded over W = pcp * dcp CP
ranks. One block-table entry is a "virtual block" of V = B * W consecutive positions, of
which each rank stores B (B = the per-rank block size). Within a virtual block, runs of
I = cp_kv_cache_interleave_size positions go to the ranks round-robin:

    off = p % V                      owner = (off // I) % W
    local offset = (off // (W * I)) * I + off % I      (in [0, B), a bijection per owner)
    slot = block_table[req, p // V] * B + local offset  on the owner, -1 on the others

A rank's stored tokens are thus in position order, so its t-th stored token of a request
sits at block_table[req, t // B] * B + t % B: kernels read a shard like an ordinary
sequence of length get_dcp_local_seq_lens(...).
"""
from __future__ import annotations

import numpy as np
import torch

from longserve.worker.cpu_gpu_buffer import CpuGpuBuffer

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
    """How many of each sequence's tokens a CP rank stores ([B] for one rank, [B, W] for
    all ranks when dcp_rank is None). `dcp_size` / `dcp_rank` are the CP world size and
    rank (pcp * dcp shards in all). The W counts of a sequence add up to its length."""
    W, I = dcp_size, cp_kv_cache_interleave_size
    # no host-to-device copy, so this can run inside a CUDA graph
    ranks = torch.arange(W, device=seq_lens.device) if dcp_rank is None else dcp_rank
    lens = seq_lens.to(torch.int64)[:, None]  # [B, 1]
    full_rounds = lens // (W * I)  # every rank got I tokens per round
    rest = lens % (W * I)  # the last round: ranks 0, 1, ... take up to I each
    extra = (rest - ranks * I).clamp(0, I)  # [B, W], or [B, 1] for one rank
    counts = (full_rounds * I + extra).to(seq_lens.dtype)
    return counts if dcp_rank is None else counts[:, 0]


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
