"""KV-transfer helpers with the names of vLLM's kv_connector/utils.py (see the seed contract).
A layer's cache is [2, num_blocks, block_size, num_kv_heads, head_dim] (NHD blocks); the
receive-side fix-ups work on one of K or V, [num_blocks, ...] with the bytes as they arrived."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Iterator, Literal

import torch

NHD, HND = "NHD", "HND"


@dataclass
class KVConnectorOutput:
    """What one worker reports after a step (vLLM's KVConnectorOutput)."""
    finished_sending: set[str] = field(default_factory=set)  # its reads of these requests are over
    finished_recving: set[str] = field(default_factory=set)  # its loads of these requests are over
    invalid_block_ids: set[int] = field(default_factory=set)  # blocks whose load failed


class KVOutputAggregator:
    """Unites the workers' connector outputs into the one the scheduler reads: a request is finished
    sending (receiving) once all `expected_finished_count` workers holding part of its KV (TP x PCP
    ranks) have said so, counted across steps; invalid block ids are united."""

    def __init__(self, expected_finished_count: int):
        if expected_finished_count < 1:
            raise ValueError(f"expected_finished_count must be >= 1, got {expected_finished_count}")
        self._expected_finished_count = expected_finished_count
        self._send_remaining_count: dict[str, int] = {}
        self._recv_remaining_count: dict[str, int] = {}

    @classmethod
    def from_connector(cls, connector, world_size: int) -> "KVOutputAggregator":
        """A connector may say how many workers report each request (default: all of them)."""
        return cls(getattr(connector, "get_finished_count", lambda: None)() or world_size)

    def _count_down(self, ids: set[str], remaining: dict[str, int], done: set[str]) -> None:
        for req_id in ids:
            left = remaining.get(req_id, self._expected_finished_count) - 1
            if left == 0:
                remaining.pop(req_id, None)
                done.add(req_id)
            else:
                remaining[req_id] = left

    def aggregate(self, outputs: list, output_rank: int = 0):
        """outputs: each worker's ModelRunnerOutput (or None: a worker that reported nothing).
        Returns outputs[output_rank] with the united KVConnectorOutput in `kv_connector_output`."""
        sending, recving, invalid = set(), set(), set()
        for kv in [getattr(out, "kv_connector_output", None) for out in outputs]:
            if kv is not None:
                self._count_down(kv.finished_sending, self._send_remaining_count, sending)
                self._count_down(kv.finished_recving, self._recv_remaining_count, recving)
                invalid |= kv.invalid_block_ids
        result = outputs[output_rank]
        return None if result is None else replace(
            result, kv_connector_output=KVConnectorOutput(sending, recving, invalid))


def get_kv_connector_cache_layout(kv_transfer_config=None) -> str:
    """The block layout the connector moves: "NHD" ([block_size, heads, dim], our caches)
    unless the transfer config asks for "HND" ([heads, block_size, dim]) on the wire."""
    layout = getattr(kv_transfer_config, "kv_buffer_layout", None) or NHD
    if layout not in (NHD, HND):
        raise ValueError(f"kv_buffer_layout must be 'NHD' or 'HND', got {layout!r}")
    return layout


# ---- receive-side fix-ups (in place, on the blocks at `indices`) ------------------------
def kv_postprocess_layout_on_receive(cache: torch.Tensor, indices: torch.Tensor) -> None:
    """cache [num_blocks, block_size, H, D] (NHD) whose blocks at `indices` hold HND bytes
    ([H, block_size, D]): view them with the sender's layout and transpose into place."""
    n, block_size, heads, dim = cache.shape
    x = cache.index_select(0, indices).reshape(len(indices), heads, block_size, dim)
    cache.index_copy_(0, indices, x.permute(0, 2, 1, 3).contiguous())


def kv_postprocess_blksize_on_receive(cache: torch.Tensor, indices: torch.Tensor,
                                      block_size_ratio: int) -> None:
    """cache [num_blocks, H, local_N, D] (HND) whose blocks at `indices` each hold `block_size_ratio`
    remote HND blocks back to back (|h0-b0|h1-b0|..|h0-b1|..) -> regrouped |h0-b0 b1 ..|h1-b0 b1 ..|."""
    n, heads, local_n, dim = cache.shape
    if local_n % block_size_ratio:
        raise ValueError(f"block_size_ratio {block_size_ratio} does not divide block size {local_n}")
    remote_n = local_n // block_size_ratio
    x = cache.index_select(0, indices).reshape(len(indices), block_size_ratio, heads, remote_n, dim)
    x = x.permute(0, 2, 1, 3, 4).reshape(len(indices), heads, local_n, dim)
    cache.index_copy_(0, indices, x)


def kv_postprocess_blksize_and_layout_on_receive(cache: torch.Tensor, indices: torch.Tensor,
                                                 block_size_ratio: int) -> None:
    """cache [num_blocks, local_N, H, D] (NHD) whose blocks at `indices` hold
    `block_size_ratio` smaller remote HND blocks: regroup the blocks (as HND), then transpose."""
    n, local_n, heads, dim = cache.shape
    kv_postprocess_blksize_on_receive(cache.view(n, heads, local_n, dim), indices, block_size_ratio)
    kv_postprocess_layout_on_receive(cache, indices)


def yield_req_data(scheduler_output) -> Iterator[tuple[str, tuple[list[int], ...], bool]]:
    """(req_id, new_block_id_groups, preempted) for every request of the step: its blocks since the
    workers last heard of it (one KV-cache group), and whether its block list starts over."""
    for r in scheduler_output.all_requests():
        yield r.req_id, (list(r.block_ids),), bool(r.new and r.resumed_from_preemption)


# ---- block copies between two caches (device <-> host) -----------------------------------
def _make_src_and_dst_indices(src_block_ids: list[int], dst_block_ids: list[int],
                              src_device: torch.device | str,
                              dst_device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"{len(src_block_ids)} source blocks for {len(dst_block_ids)} destinations")
    return (torch.tensor(src_block_ids, dtype=torch.long, device=src_device),
            torch.tensor(dst_block_ids, dtype=torch.long, device=dst_device))


def _contiguous_run(ids: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(ids, ids[1:]))


def copy_kv_blocks(src_kv_caches: dict[str, torch.Tensor], dst_kv_caches: dict[str, torch.Tensor],
                   src_block_ids: list[int], dst_block_ids: list[int],
                   direction: Literal["h2d", "d2h"]) -> None:
    """Copy blocks src_block_ids[i] -> dst_block_ids[i] of every layer (dim 1 is the block): per layer
    and K/V one gather (a slice when contiguous), one copy (non-blocking with pinned memory; the
    caller orders it with its stream) and one scatter."""
    if direction not in ("h2d", "d2h"):
        raise ValueError(f"direction must be 'h2d' or 'd2h', got {direction!r}")
    if not src_block_ids:
        return
    first_src = next(iter(src_kv_caches.values()))
    first_dst = next(iter(dst_kv_caches.values()))
    src_idx, dst_idx = _make_src_and_dst_indices(src_block_ids, dst_block_ids,
                                                 first_src.device, first_dst.device)
    src_run, dst_run = _contiguous_run(src_block_ids), _contiguous_run(dst_block_ids)
    s0, d0, n = src_block_ids[0], dst_block_ids[0], len(src_block_ids)
    to_device = first_dst.device.type != "cpu"  # h2d may be asynchronous; d2h is read at once
    for name, src in src_kv_caches.items():
        dst = dst_kv_caches[name]
        for i in range(src.shape[0]):  # K and V: each one contiguous copy
            part = src[i, s0:s0 + n] if src_run else src[i].index_select(0, src_idx)
            if dst_run:
                dst[i, d0:d0 + n].copy_(part, non_blocking=True)
            else:
                dst[i].index_copy_(0, dst_idx, part.to(dst.device, non_blocking=to_device))
