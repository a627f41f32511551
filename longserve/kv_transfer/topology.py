"""Which producer ranks hold which parts of a consumer rank's KV: `TpKVTopology` (vLLM's names and
TP semantics, extended to CP) and `plan_kv_pieces`, from each side's `KVLayout` (placement rule:
docs/architecture.md, 'Rank layout', 'KV transfer')."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

EngineId = str


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, tp_rank: int, dcp_size: int) -> tuple[int, int]:
    """(first, count) of the KV heads a TP rank computes and stores: split over the tp/dcp head
    groups, replicated when fewer (docs/architecture.md, 'KV head placement' after 'Layers')."""
    groups, group = tp_size // dcp_size, tp_rank // dcp_size
    if num_kv_heads >= groups:
        per = num_kv_heads // groups
        return group * per, per
    return group * num_kv_heads // groups, 1


@dataclass(frozen=True)
class KVLayout:
    """How one instance spreads its KV cache over its ranks (plain data: it travels in the transfer
    params). `cache_layout`: its blocks' layout on the wire ("NHD"/"HND"); `kv_dtype` the cache's
    element type: KV moves as bytes, so two instances exchange it only if equal (check_kv_dtype)."""
    num_kv_heads: int
    block_size: int = 16
    tp: int = 1
    pcp: int = 1
    dcp: int = 1
    interleave: int = 1
    cache_layout: str = "NHD"
    kv_dtype: str = "auto"

    def __post_init__(self):
        if self.tp % self.dcp or self.block_size % self.interleave:
            raise ValueError(f"invalid KV layout {self}: dcp must divide tp, interleave the block size")

    @property
    def world_size(self) -> int:
        return self.pcp * self.tp

    @property
    def cp_size(self) -> int:
        return self.pcp * self.dcp

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.cp_size

    def cp_rank(self, rank: int) -> int:
        return (rank // self.tp) * self.dcp + (rank % self.tp) % self.dcp

    def heads(self, rank: int) -> tuple[int, int]:
        return kv_heads_of_rank(self.num_kv_heads, self.tp, rank % self.tp, self.dcp)

    def owner(self, positions: np.ndarray) -> np.ndarray:
        return (positions // self.interleave) % self.cp_size


@dataclass(frozen=True)
class KVPiece:
    """A run of heads that `local_rank` reads from `remote_rank`, for the positions both CP ranks own;
    head offsets are into each side's own cache."""
    local_rank: int
    remote_rank: int
    local_cp_rank: int
    remote_cp_rank: int
    local_head: int
    remote_head: int
    num_heads: int

    def positions(self, local: KVLayout, remote: KVLayout, start: int, end: int) -> np.ndarray:
        p = np.arange(start, end, dtype=np.int64)
        keep = (local.owner(p) == self.local_cp_rank) & (remote.owner(p) == self.remote_cp_rank)
        return p[keep]


def check_kv_dtype(local: KVLayout, remote: KVLayout) -> None:
    if local.kv_dtype != remote.kv_dtype:
        raise ValueError(f"the producer's KV cache holds {remote.kv_dtype} and this instance's "
                         f"{local.kv_dtype}: KV moves as bytes, so both need the same "
                         "kv_cache_dtype (and dtype)")


def plan_kv_pieces(local: KVLayout, remote: KVLayout, local_rank: int) -> list[KVPiece]:
    """Every piece local rank `local_rank` reads. A head that several remote ranks hold
    (replicated KV) is read from one of them, chosen by the local rank to spread the load."""
    if local.num_kv_heads != remote.num_kv_heads:
        raise ValueError(f"the instances have {local.num_kv_heads} and {remote.num_kv_heads} KV heads")
    check_kv_dtype(local, remote)
    first, count = local.heads(local_rank)
    local_cp = local.cp_rank(local_rank)
    # one period of both ownerships (they repeat with the lcm): the positions a CP pair can share
    period = np.arange(np.lcm(local.interleave * local.cp_size, remote.interleave * remote.cp_size))
    pieces: list[KVPiece] = []
    for remote_cp in range(remote.cp_size):
        if not ((local.owner(period) == local_cp) & (remote.owner(period) == remote_cp)).any():
            continue
        ranks = [r for r in range(remote.world_size) if remote.cp_rank(r) == remote_cp]
        for h in range(first, first + count):
            holders = [r for r in ranks if remote.heads(r)[0] <= h < sum(remote.heads(r))]
            r = holders[local_rank % len(holders)]
            rh = h - remote.heads(r)[0]
            last = pieces[-1] if pieces else None
            if (last and last.remote_rank == r and last.remote_cp_rank == remote_cp
                    and last.remote_head + last.num_heads == rh):
                pieces[-1] = replace(last, num_heads=last.num_heads + 1)
            else:
                pieces.append(KVPiece(local_rank, r, local_cp, remote_cp, h - first, rh, 1))
    return pieces


@dataclass
class TpKVTopology:
    """vLLM's TP topology helper, with CP: every engine's `KVLayout` in `remote_layout`
    (filled from `remote_tp_size` / `remote_block_size` for engines without CP)."""
    tp_rank: int
    remote_tp_size: dict[EngineId, int]
    is_mla: bool
    total_num_kv_heads: int
    attn_backend: type | None
    engine_id: EngineId
    remote_block_size: dict[EngineId, int]
    pcp_rank: int = 0
    remote_layout: dict[EngineId, KVLayout] = field(default_factory=dict)

    def __post_init__(self):
        for eid, tp in self.remote_tp_size.items():
            if eid not in self.remote_layout:
                self.remote_layout[eid] = KVLayout(self.total_num_kv_heads, self.remote_block_size[eid], tp)
        for eid, lay in self.remote_layout.items():
            self.remote_tp_size[eid] = lay.tp
            self.remote_block_size[eid] = lay.block_size

    @property
    def layout(self) -> KVLayout:
        return self.remote_layout[self.engine_id]

    @property
    def tp_size(self) -> int:
        return self.layout.tp

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def rank(self) -> int:
        return self.pcp_rank * self.tp_size + self.tp_rank

    def tp_ratio(self, remote_tp_size: int) -> int:
        """Local TP workers per remote TP worker; negative (-remote/local) when the remote TP is larger."""
        if self.tp_size >= remote_tp_size:
            if self.tp_size % remote_tp_size:
                raise ValueError(f"local TP {self.tp_size} is not a multiple of remote TP {remote_tp_size}")
            return self.tp_size // remote_tp_size
        if remote_tp_size % self.tp_size:
            raise ValueError(f"remote TP {remote_tp_size} is not a multiple of local TP {self.tp_size}")
        return -(remote_tp_size // self.tp_size)

    def block_size_ratio(self, remote_block_size: int) -> int:
        """Remote blocks per local block (the local block is the larger one)."""
        if self.block_size % remote_block_size:
            raise ValueError(f"local block size {self.block_size} is not a multiple of the remote "
                             f"block size {remote_block_size}")
        return self.block_size // remote_block_size

    def is_kv_replicated(self, engine_id: EngineId) -> bool:
        """More TP head groups than KV heads: groups hold copies of a head."""
        lay = self.remote_layout[engine_id]
        return lay.tp // lay.dcp > self.total_num_kv_heads

    def replicates_kv_cache(self, remote_engine_id: EngineId) -> bool:
        return self.is_mla or self.is_kv_replicated(remote_engine_id)

    def get_target_remote_ranks(self, remote_tp_size: int, remote_engine_id: EngineId | None = None) -> list[int]:
        """The remote model ranks this rank reads from (TP only: tp_rank // tp_ratio when the
        local TP is larger, else |tp_ratio| consecutive ranks; one copy of a replicated head;
        with CP, every remote CP rank whose positions meet ours)."""
        remote = (KVLayout(self.total_num_kv_heads, self.block_size, remote_tp_size)
                  if remote_engine_id is None else self.remote_layout[remote_engine_id])
        return sorted({p.remote_rank for p in plan_kv_pieces(self.layout, remote, self.rank)})

    def tp_ratio_from_engine_id(self, remote_engine_id: EngineId) -> int:
        return self.tp_ratio(self.remote_tp_size[remote_engine_id])

    def block_size_ratio_from_engine_id(self, remote_engine_id: EngineId) -> int:
        return self.block_size_ratio(self.remote_block_size[remote_engine_id])

    def get_target_remote_ranks_from_engine_id(self, remote_engine_id: EngineId) -> list[int]:
        return self.get_target_remote_ranks(self.remote_tp_size[remote_engine_id], remote_engine_id)
