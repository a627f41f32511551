"""What attention needs to know about one step, built once by the model runner. Rows of q are
this rank's tokens, decodes first (with PCP the prefill rows are the DualChunkSwap head/tail
chunks); K/V rows, like `slot_mapping`, are all the step's real tokens in request order."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from longserve.distributed.parallel_state import ParallelState, single_rank_state


@dataclass
class SuffixSegment:
    """Query rows [q0, q1) see keys [k0, ka) fully and keys [ka, kb) causally (top-left); keys index
    the step's new K/V rows (request order), [k0, ka) the request's earlier PCP chunks."""
    q0: int
    q1: int
    k0: int
    ka: int
    kb: int


@dataclass
class VarlenLayout:
    """Prefill segments that tile the step's new tokens in order, each causal over itself (no PCP), for
    one varlen kernel call; cu_seqlens counts rows from the first segment's; keys: K/V rows [k_begin, k_end)."""
    cu_seqlens: torch.Tensor  # [S+1] int32, device
    max_len: int
    k_begin: int
    k_end: int


@dataclass
class PagedPart:
    """Query rows grouped by request; request r's rows see its first kv_lens[r] cached tokens
    of this rank's shard (through its block-table row). Host copies drive the torch path."""
    query_start_loc: torch.Tensor  # [R+1] int32, device
    kv_lens: torch.Tensor  # [R] int32, device
    block_table: torch.Tensor  # [R, max_blocks] int32, device (kernel blocks)
    max_query_len: int
    query_start_loc_cpu: list[int]
    kv_lens_cpu: list[int]
    # index work the first layer builds and the others reuse: prefix varlen batch, decode slots
    # (torch) or decode's work items (Triton, plan_decode)
    packed: object | None = None


@dataclass
class AttentionMetadata:
    num_decode_tokens: int  # first rows of q
    num_tokens: int  # rows of q (local)
    slot_mapping: torch.Tensor  # [T_kv] int64, -1: not stored by this rank
    decode: PagedPart | None
    prefill_segments: list[SuffixSegment] = field(default_factory=list)
    prefill_varlen: VarlenLayout | None = None  # the segments as one varlen batch (no PCP)
    prefix: PagedPart | None = None  # cached context of the prefill rows (PCP: gathered queries)
    pcp_kv_index: torch.Tensor | None = None  # PCP: each real token's row in the gathered K/V
    ps: ParallelState = field(default_factory=single_rank_state)
    backend: object = None  # the AttentionBackend instance
    step_kv: dict = field(default_factory=dict)  # layer -> its step's (K, V), for KV-sharing layers
