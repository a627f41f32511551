"""Packing a `KVPiece` out of the sender's caches and into the receiver's. Payloads: "blocks" wire
(same CP sharding, receiver block a multiple of the sender's): the sender's whole blocks in its
`cache_layout`, [L, 2, m, B, h, D] NHD or [L, 2, m, h, B, D] HND, fixed on receipt; "tokens" wire
(any other pair): the rows of the piece's positions, [L, 2, n, h, D]."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from longserve.cp_slot_mapping import compute_slot_mapping
from longserve.kv_transfer.topology import KVLayout, KVPiece
from longserve.kv_transfer.utils import (HND, kv_postprocess_blksize_and_layout_on_receive,
                                         kv_postprocess_layout_on_receive)


@dataclass(frozen=True)
class PieceRange:
    """The positions [start, end) of one request that move, and each side's block ids."""
    start: int
    end: int
    sender_blocks: tuple[int, ...]
    receiver_blocks: tuple[int, ...]


def slots_of(layout: KVLayout, cp_rank: int, block_ids, positions: np.ndarray) -> np.ndarray:
    table = np.asarray(block_ids, dtype=np.int64)[None, :]
    return compute_slot_mapping(table, np.zeros(len(positions), dtype=np.int64), positions,
                                layout.block_size, layout.cp_size, cp_rank, layout.interleave)


def uses_block_wire(receiver: KVLayout, sender: KVLayout, rng: PieceRange) -> bool:
    return (receiver.cp_size == sender.cp_size and receiver.interleave == sender.interleave
            and receiver.block_size % sender.block_size == 0
            and rng.start % receiver.tokens_per_block == 0)


def _block_spans(receiver: KVLayout, sender: KVLayout, rng: PieceRange):
    """(sender block indices incl. padding as -1, receiver block indices) of a block-wire piece."""
    k = receiver.block_size // sender.block_size
    first = rng.start // receiver.tokens_per_block
    last = -(-rng.end // receiver.tokens_per_block)
    sender_idx = [i if i < len(rng.sender_blocks) else -1 for i in range(first * k, last * k)]
    return sender_idx, list(range(first, last))


def _block_view(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    return cache.view(2, -1, block_size, *cache.shape[-2:])


def pack_piece(kv_caches: list[torch.Tensor], piece: KVPiece, sender: KVLayout,
               receiver: KVLayout, rng: PieceRange) -> torch.Tensor:
    """The payload the sender (remote_rank of the piece) sends for it."""
    heads = slice(piece.remote_head, piece.remote_head + piece.num_heads)
    dev = kv_caches[0].device
    if uses_block_wire(receiver, sender, rng):
        idx, _ = _block_spans(receiver, sender, rng)
        ids = torch.tensor([rng.sender_blocks[i] if i >= 0 else 0 for i in idx], dtype=torch.long, device=dev)
        views = [_block_view(c, sender.block_size)[:, :, :, heads] for c in kv_caches]
        out = _gather(views, ids)  # [L, 2, m, B, h, D]
        if min(idx) < 0:  # padding blocks past the sender's last one
            out[:, :, torch.tensor([i < 0 for i in idx], device=dev)] = 0
        return out.transpose(3, 4).contiguous() if sender.cache_layout == HND else out
    pos = piece.positions(receiver, sender, rng.start, rng.end)
    slots = torch.from_numpy(slots_of(sender, piece.remote_cp_rank, rng.sender_blocks, pos)).to(dev)
    return _gather([c.view(2, -1, *c.shape[-2:])[:, :, heads] for c in kv_caches], slots)  # [L, 2, n, h, D]


def _gather(views: list[torch.Tensor], idx: torch.Tensor) -> torch.Tensor:
    """Stack views[l].index_select(1, idx) over layers, each gathered straight into place."""
    first = views[0]
    out = torch.empty((len(views), first.shape[0], len(idx), *first.shape[2:]), dtype=first.dtype,
                      device=first.device)
    for layer, v in enumerate(views):
        torch.index_select(v, 1, idx, out=out[layer])
    return out


def payload_shape(piece: KVPiece, sender: KVLayout, receiver: KVLayout, rng: PieceRange,
                  num_layers: int, head_dim: int) -> tuple[int, ...]:
    """What the receiver allocates to receive the piece."""
    h = piece.num_heads
    if uses_block_wire(receiver, sender, rng):
        m = len(_block_spans(receiver, sender, rng)[0])
        block = (h, sender.block_size) if sender.cache_layout == HND else (sender.block_size, h)
        return (num_layers, 2, m, *block, head_dim)
    n = len(piece.positions(receiver, sender, rng.start, rng.end))
    return (num_layers, 2, n, h, head_dim)


def unpack_piece(kv_caches: list[torch.Tensor], piece: KVPiece, sender: KVLayout,
                 receiver: KVLayout, rng: PieceRange, payload: torch.Tensor) -> None:
    """Write a received payload into the receiver's caches (local_rank of the piece)."""
    heads, dev = slice(piece.local_head, piece.local_head + piece.num_heads), kv_caches[0].device
    payload = payload.to(dev)
    if uses_block_wire(receiver, sender, rng):
        _, local_idx = _block_spans(receiver, sender, rng)
        ids = torch.tensor([rng.receiver_blocks[i] for i in local_idx], dtype=torch.long, device=dev)
        staged = _land_blocks(payload, receiver.block_size, sender)  # [L, 2, n, B_local, h, D]
        for layer, c in enumerate(kv_caches):
            _block_view(c, receiver.block_size)[:, :, :, heads].index_copy_(1, ids, staged[layer])
        return
    pos = piece.positions(receiver, sender, rng.start, rng.end)
    slots = torch.from_numpy(slots_of(receiver, piece.local_cp_rank, rng.receiver_blocks, pos)).to(dev)
    for layer, c in enumerate(kv_caches):
        c.view(2, -1, *c.shape[-2:])[:, :, heads].index_copy_(1, slots, payload[layer])


def _land_blocks(payload: torch.Tensor, local_block_size: int, sender: KVLayout) -> torch.Tensor:
    """Reinterpret the sender's block bytes as local NHD blocks ([L, 2, n, B_local, h, D]) and
    fix them in place, as if they had been written straight into local blocks."""
    L, two, m = payload.shape[:3]
    h, d = (payload.shape[3], payload.shape[5]) if sender.cache_layout == HND else payload.shape[4:]
    ratio = local_block_size // sender.block_size
    blocks = payload.contiguous().view(L * 2, m // ratio, local_block_size, h, d)
    if sender.cache_layout == HND:
        for kv in blocks:  # each is one layer's K or V: [n, B_local, h, D]
            idx = torch.arange(kv.shape[0], device=kv.device)
            if ratio == 1:
                kv_postprocess_layout_on_receive(kv, idx)
            else:
                kv_postprocess_blksize_and_layout_on_receive(kv, idx, ratio)
    return blocks.view(L, 2, m // ratio, local_block_size, h, d)
