"""Build one step's model inputs (token ids, positions, slot mapping, attention metadata): the one
place the step's tokens are laid out, so PCP partitions them here and CP's slots are set here."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from longserve.attention.metadata import AttentionMetadata, PagedPart, SuffixSegment, VarlenLayout
from longserve.cp_slot_mapping import compute_slot_mapping, get_dcp_local_seq_lens
from longserve.distributed.parallel_state import ParallelState
from longserve.host_to_device import to_device, to_device_all
from longserve.step_plan import PLACEHOLDER, ScheduledRequest, SchedulerOutput
from longserve.worker.block_table import map_to_kernel_blocks
from longserve.worker.cp_utils import PCPManager


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T_local]
    positions: torch.Tensor  # [T_local]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the (restored) hidden states to take logits of
    num_local_tokens: int
    is_pure_decode: bool
    prompt_logprob_rows: np.ndarray | None = None  # hidden rows scoring prompt tokens (None: none)
    placeholder_rows: np.ndarray | None = None  # input_ids rows holding PLACEHOLDER (None: none)
    placeholder_reqs: np.ndarray | None = None  # and each one's request index


@dataclass
class CPLayout:
    block_size: int  # per-rank tokens per block
    cp_world_size: int
    cp_rank: int
    interleave_size: int
    kernel_blocks_per_block: int = 1


def build_block_table(block_ids: list[list[int]]) -> np.ndarray:
    table = np.zeros((len(block_ids), max([len(b) for b in block_ids] + [1])), dtype=np.int32)
    for i, ids in enumerate(block_ids):
        table[i, :len(ids)] = ids
    return table


@dataclass
class StepRows:
    """A step's requests as arrays, in plan order: the plain decodes, then `requests`."""
    req_ids: list[str]
    n: np.ndarray  # int64 [R]: tokens each request runs
    computed: np.ndarray  # int64 [R]: tokens computed before the step
    token_ids: np.ndarray  # int64 [sum(n)]: request after request (PLACEHOLDER: on the device)
    sample: np.ndarray  # bool [R]
    requests: list[ScheduledRequest]  # the rows after the plain decodes (prompt logprobs)

    def part(self, a: int, b: int) -> StepRows:
        """Requests [a, b) (a micro-batch); their prompt logprobs are not part of it."""
        starts = np.concatenate(([0], np.cumsum(self.n)))
        return StepRows(self.req_ids[a:b], self.n[a:b], self.computed[a:b],
                        self.token_ids[starts[a]:starts[b]], self.sample[a:b], [])


def step_rows(out: SchedulerOutput) -> StepRows:
    d, reqs = out.decodes, out.requests
    nd = len(d.req_ids)
    if not reqs:  # a decode step: the columns as they came
        return StepRows(d.req_ids, np.ones(nd, np.int64), np.array(d.num_computed, np.int64),
                        np.array(d.token_ids, np.int64), np.ones(nd, bool), [])
    return StepRows(d.req_ids + [r.req_id for r in reqs],
                    np.array([1] * nd + [len(r.token_ids) for r in reqs], np.int64),
                    np.array(d.num_computed + [r.num_computed_tokens for r in reqs], np.int64),
                    np.array(d.token_ids + [t for r in reqs for t in r.token_ids], np.int64),
                    np.array([True] * nd + [r.sample for r in reqs], bool), reqs)


def prepare_step(rows: StepRows, table: np.ndarray, layout: CPLayout,
                 ps: ParallelState, pcp: PCPManager | None, device, backend) -> StepInputs:
    """table: int32 [R, width], each request's block ids (build_block_table)."""
    n, computed, token_ids = rows.n, rows.computed, rows.token_ids
    num_reqs = len(n)
    num_decodes = int(np.sum((n == 1) & (computed > 0)))
    starts = np.concatenate(([0], np.cumsum(n)))
    req_idx = np.repeat(np.arange(num_reqs), n)
    positions = computed[req_idx] + np.arange(starts[-1]) - starts[req_idx]
    slots = compute_slot_mapping(table, req_idx, positions, layout.block_size,
                                 layout.cp_world_size, layout.cp_rank, layout.interleave_size)
    pcp_kv_index, local_n = None, n
    if pcp is not None and pcp.pcp_world_size > 1:
        room = len(positions) + 2 * pcp.pcp_world_size * num_reqs  # pads included
        local_total, positions, req_idx = pcp.partition_inputs(
            np.resize(positions, room), np.resize(req_idx, room), n, computed, np.arange(room),
            reorder_batch_threshold=1)
        token_ids = token_ids[pcp.local_token_indices[:local_total]]
        if num_decodes < num_reqs:  # a pure decode step already has every K/V row locally
            pcp_kv_index = pcp.restore_unpad_idx
        local_n = pcp.local_num_tokens_per_req.astype(np.int64)
    seq_lens = torch.from_numpy(computed + n)
    decode_qsl = np.arange(num_decodes + 1, dtype=np.int32)
    decode_kv_lens = cp_local(seq_lens[:num_decodes], layout).to(torch.int32)
    kernel_table, slot_mapping, input_ids, positions_dev, logits_indices, qsl, kv_lens = \
        to_device_all([map_to_kernel_blocks(table, layout.kernel_blocks_per_block), slots,
                       token_ids, positions, starts[1:][rows.sample] - 1, decode_qsl,
                       decode_kv_lens], device)
    meta = AttentionMetadata(num_decode_tokens=num_decodes, num_tokens=len(positions),
                             slot_mapping=slot_mapping, decode=None, ps=ps, backend=backend,
                             pcp_kv_index=pcp_kv_index)
    if num_decodes:
        meta.decode = PagedPart(qsl, kv_lens, kernel_table[:num_decodes], 1, decode_qsl.tolist(),
                                decode_kv_lens.tolist())
    local_starts = np.concatenate(([0], np.cumsum(local_n)))
    add_prefill_parts(meta, n, computed, starts, local_starts, num_decodes, kernel_table, layout, ps, device)
    placeholder_rows = np.flatnonzero(token_ids == PLACEHOLDER)
    first = num_reqs - len(rows.requests)
    return StepInputs(
        input_ids=input_ids, positions=positions_dev,
        meta=meta, logits_indices=logits_indices, num_local_tokens=meta.num_tokens,
        is_pure_decode=num_decodes == num_reqs,
        prompt_logprob_rows=prompt_logprob_rows(rows.requests, starts[first:]),
        placeholder_rows=placeholder_rows if placeholder_rows.size else None,
        placeholder_reqs=req_idx[placeholder_rows] if placeholder_rows.size else None)


def prompt_logprob_rows(reqs: list[ScheduledRequest], starts: np.ndarray) -> np.ndarray | None:
    rows = [starts[i] + r.prompt_logprob_row + np.arange(len(r.prompt_logprob_targets))
            for i, r in enumerate(reqs) if r.prompt_logprob_targets]
    return np.concatenate(rows) if rows else None


def cp_local(lens: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """Tokens of each sequence that this rank's KV shard holds."""
    if layout.cp_world_size == 1:
        return lens
    return get_dcp_local_seq_lens(lens, layout.cp_world_size, layout.cp_rank, layout.interleave_size)


def paged_part(qsl: np.ndarray, kv_lens: torch.Tensor, table: torch.Tensor, max_q: int, device) -> PagedPart:
    kv_lens = kv_lens.to(torch.int32)
    return PagedPart(query_start_loc=to_device(qsl.astype(np.int32), device),
                     kv_lens=to_device(kv_lens, device), block_table=table, max_query_len=int(max_q),
                     query_start_loc_cpu=qsl.tolist(), kv_lens_cpu=kv_lens.tolist())


def add_prefill_parts(meta, n, computed, starts, local_starts, num_decodes, kernel_table, layout,
                      ps: ParallelState, device) -> None:
    """Suffix segments (new tokens, causal) and the prefix part (cached context) of prefills."""
    pcp_size, pcp_rank = ps.pcp.world_size, ps.pcp.rank_in_group
    for i in range(num_decodes, len(n)):
        meta.prefill_segments += suffix_segments(int(starts[i]), int(n[i]), int(local_starts[i]),
                                                 int(local_starts[i + 1]), pcp_size, pcp_rank)
    if pcp_size == 1 and meta.prefill_segments:
        meta.prefill_varlen = varlen_layout(meta.prefill_segments, device)
    if not np.any(computed[num_decodes:] > 0):
        return
    local_n = np.diff(local_starts)[num_decodes:]
    ctx = cp_local(torch.from_numpy(computed[num_decodes:]), layout)
    # with PCP over every PCP rank's prefill rows (rank-major, equal counts): a row group per
    # (rank, request), or one for a lone prefill (one page gather and kernel call a layer)
    reps = 1 if len(local_n) == 1 else pcp_size
    rows = np.tile(local_n, pcp_size) if reps > 1 else local_n * pcp_size
    qsl = np.concatenate(([0], np.cumsum(rows)))
    table = kernel_table[num_decodes:].repeat(reps, 1)
    meta.prefix = paged_part(qsl, ctx.repeat(reps), table, rows.max(initial=1), device)


def varlen_layout(segs: list[SuffixSegment], device) -> VarlenLayout:
    lens = [s.kb - s.ka for s in segs]
    assert all(s.k0 == s.ka and s.q1 - s.q0 == n for s, n in zip(segs, lens))
    assert all(a.kb == b.ka and a.q1 == b.q0 for a, b in zip(segs, segs[1:]))
    cu = to_device(np.concatenate(([0], np.cumsum(lens))).astype(np.int32), device)
    return VarlenLayout(cu, max(lens), segs[0].ka, segs[-1].kb)


def suffix_segments(k_start: int, n: int, q_start: int, q_end: int, pcp_size: int,
                    pcp_rank: int) -> list[SuffixSegment]:
    """One prefill's query rows against its new keys [k_start, k_start + n): the whole chunk without
    PCP; with PCP chunks r (head) and 2W-1-r (tail) of the padded chunk, `c` rows each, each seeing
    the keys before it fully and its own causally (pad rows past n see every key)."""
    if pcp_size == 1:
        return [SuffixSegment(q_start, q_end, k_start, k_start, k_start + n)]
    c = (q_end - q_start) // 2
    segs = []
    for j, chunk in enumerate((pcp_rank, 2 * pcp_size - 1 - pcp_rank)):
        a, b = min(chunk * c, n), min((chunk + 1) * c, n)
        q0 = q_start + j * c
        segs.append(SuffixSegment(q0, q0 + c, k_start, k_start + a, k_start + b))
    return segs
