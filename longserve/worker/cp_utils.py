"""PCP's DualChunkSwap (docs/architecture.md, 'One prefill step with PCP'): a prefill of n tokens is
padded to P (a multiple of 2W); a decode runs whole on every rank. Two orders, per step:
  gathered order : rank 0's local tokens, then rank 1's, ... (what an all-gather yields)
  padded order   : request by request, a prefill's P tokens by offset (pads last), a decode's
                   W copies back to back; real tokens: `offset_in_request < n` (pcp_unpad_mask)."""
from __future__ import annotations

import numpy as np
import torch

from longserve.config import ParallelConfig
from longserve.worker.cpu_gpu_buffer import CpuGpuBuffer


def segment_arange(counts: np.ndarray, arange_np: np.ndarray | None = None) -> np.ndarray:
    """[0..c0-1, 0..c1-1, ...] for counts [c0, c1, ...], using a preallocated arange."""
    total = int(counts.sum())
    ar = arange_np[:total] if arange_np is not None and len(arange_np) >= total else np.arange(total)
    starts = np.cumsum(counts) - counts
    return ar - np.repeat(starts, counts)


class PCPManager:
    """Reusable buffers and the per-step token split for one PCP rank."""

    def __init__(self, pcp_world_size: int, pcp_rank: int, max_num_reqs: int,
                 max_padded_num_tokens: int, device: torch.device | str,
                 pin_memory: bool = False, pcp_group=None):
        self.pcp_world_size = pcp_world_size
        self.pcp_rank = pcp_rank
        self.max_num_reqs = max_num_reqs
        self.max_padded_num_tokens = max_padded_num_tokens
        self.pcp_group = pcp_group  # GroupCoordinator; only needed when pcp_world_size > 1

        def buffer(dtype: torch.dtype) -> CpuGpuBuffer:
            return CpuGpuBuffer(max_padded_num_tokens, dtype=dtype, device=device, pin_memory=pin_memory)

        # [padded_total] padded order -> index into the gathered order
        self.pcp_allgather_restore_idx = buffer(torch.int64)
        # [padded_total] padded order: True at real tokens
        self.pcp_unpad_mask = buffer(torch.bool)
        # [num_real] request order -> index into the gathered order (restore idx at real tokens)
        self.pcp_restore_unpad_idx = buffer(torch.int64)
        # [num_real] request order -> index into the padded order (where the mask is True)
        self.pcp_real_to_padded_idx = buffer(torch.int64)
        # [padded_total] output of pad_slot_mapping
        self.pcp_padded_slot_mapping = torch.full((max_padded_num_tokens,), -1,
                                                  dtype=torch.int64, device=device)
        # per request, all ranks together: padded count P and pads P - n
        self.num_padded_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_pcp_pads = np.zeros(max_num_reqs, dtype=np.int64)
        # [local_total] index into the step's global token arrays of each local token;
        # a pad points at its request's last real token (use it to gather input ids)
        self.local_token_indices = np.zeros(max_padded_num_tokens, dtype=np.int64)
        # sizes of the last partitioned step
        self.num_reqs = 0
        self.num_real_tokens = 0  # sum of n
        self.local_total = 0  # tokens on this rank (sum of P / W)
        self.padded_total = 0  # tokens on all ranks (sum of P) = W * local_total

    def partition_inputs(self, positions_np: np.ndarray, req_indices: np.ndarray,
                         num_scheduled_tokens: np.ndarray, num_computed_tokens: np.ndarray,
                         arange_np: np.ndarray, reorder_batch_threshold: int | None,
                         ) -> tuple[int, np.ndarray, np.ndarray]:
        """Overwrite positions_np / req_indices (global, request order) with this rank's tokens; returns
        (local_total, positions_np[:local_total], req_indices[:local_total]). local_total may exceed
        the real token count (pads): pass the persistent buffers, not slices of length sum(n)."""
        if reorder_batch_threshold is None:
            raise ValueError("PCP needs reorder_batch_threshold (decodes first, then prefills) "
                             "to tell decodes from prefills; got None")
        W = self.pcp_world_size
        n = np.asarray(num_scheduled_tokens, dtype=np.int64)
        computed = np.asarray(num_computed_tokens, dtype=np.int64)[:len(n)]
        is_decode = (n <= reorder_batch_threshold) & (computed > 0)
        padded = np.where(is_decode, n * W, -(-n // (2 * W)) * 2 * W)
        local = padded // W
        self._set_step_sizes(n, padded, len(positions_np), len(req_indices))

        # every rank's local tokens at once: axis 0 = rank, axis 1 = local token
        local_req = np.repeat(np.arange(len(n)), local)  # [L]
        k = segment_arange(local, arange_np)  # [L] index within the request's local share
        ranks = np.arange(W)[:, None]  # [W, 1]
        offset, dest = self._offsets(ranks, k, n[local_req], padded[local_req],
                                     is_decode[local_req])  # [W, L] each
        padded_starts = np.cumsum(padded) - padded
        self._build_restore(padded_starts[local_req] + dest, n, padded, arange_np)
        self._gather_local_inputs(positions_np, req_indices, offset[self.pcp_rank], local_req, n)
        self.pcp_allgather_restore_idx.copy_to_gpu(self.padded_total)
        self.pcp_unpad_mask.copy_to_gpu(self.padded_total)
        self.pcp_restore_unpad_idx.copy_to_gpu(self.num_real_tokens)
        self.pcp_real_to_padded_idx.copy_to_gpu(self.num_real_tokens)
        L = self.local_total
        return L, positions_np[:L], req_indices[:L]

    def _set_step_sizes(self, n: np.ndarray, padded: np.ndarray, positions_room: int, req_room: int) -> None:
        num_reqs, padded_total = len(n), int(padded.sum())
        if num_reqs > self.max_num_reqs or padded_total > self.max_padded_num_tokens:
            raise ValueError(f"PCP step of {num_reqs} requests and {padded_total} padded "
                             f"tokens exceeds max_num_reqs={self.max_num_reqs} / "
                             f"max_padded_num_tokens={self.max_padded_num_tokens}")
        local_total = padded_total // self.pcp_world_size
        if min(positions_room, req_room) < local_total:
            raise ValueError(f"positions / req_indices hold {min(positions_room, req_room)} "
                             f"entries; this rank's PCP share needs {local_total}")
        self.num_reqs, self.num_real_tokens = num_reqs, int(n.sum())
        self.local_total, self.padded_total = local_total, padded_total
        self.num_padded_tokens[:num_reqs] = padded
        self.num_pcp_pads[:num_reqs] = padded - n

    def _offsets(self, rank, k, n, padded, is_decode) -> tuple[np.ndarray, np.ndarray]:
        """Offset in the request (>= n for pads) and in its padded order, for `rank`'s tokens."""
        W = self.pcp_world_size
        c = padded // (2 * W)  # chunk size of a prefill
        head = k < c
        prefill_offset = np.where(head, rank * c + k, (2 * W - 1 - rank) * c + (k - c))
        offset = np.where(is_decode, k, prefill_offset)
        dest = np.where(is_decode, rank * n + k, prefill_offset)  # decode copies back to back
        return offset, dest

    def _build_restore(self, dest: np.ndarray, n: np.ndarray, padded: np.ndarray,
                       arange_np: np.ndarray) -> None:
        """dest[s, j] = padded-order index of rank s's local token j (gathered index s*L + j)."""
        P = self.padded_total
        restore = self.pcp_allgather_restore_idx.np
        restore[dest.ravel()] = np.arange(P)  # rank-major ravel == gathered order
        mask = self.pcp_unpad_mask.np
        mask[:P] = segment_arange(padded, arange_np) < np.repeat(n, padded)
        real_to_padded = np.flatnonzero(mask[:P])
        self.pcp_real_to_padded_idx.np[:self.num_real_tokens] = real_to_padded
        self.pcp_restore_unpad_idx.np[:self.num_real_tokens] = restore[real_to_padded]

    def _gather_local_inputs(self, positions_np, req_indices, offset, local_req, n) -> None:
        """Pick this rank's tokens from the global arrays; a pad copies its request's last real
        token and continues its position (p_last + 1, ...): pads sort last under a causal mask."""
        real_starts = np.cumsum(n) - n
        last = n[local_req] - 1
        src = real_starts[local_req] + np.minimum(offset, last)
        past_end = np.maximum(offset - last, 0)
        global_positions = positions_np[:self.num_real_tokens].copy()
        global_reqs = req_indices[:self.num_real_tokens].copy()
        L = self.local_total
        self.local_token_indices[:L] = src
        positions_np[:L] = global_positions[src] + past_end
        req_indices[:L] = global_reqs[src]

    @property
    def restore_idx(self) -> torch.Tensor:
        """[padded_total] int64: gathered[restore_idx] is the padded order."""
        return self.pcp_allgather_restore_idx.gpu[:self.padded_total]

    @property
    def unpad_mask(self) -> torch.Tensor:
        """[padded_total] bool: padded_order[unpad_mask] is the real tokens in request order."""
        return self.pcp_unpad_mask.gpu[:self.padded_total]

    @property
    def restore_unpad_idx(self) -> torch.Tensor:
        """[num_real] int64 = restore_idx[unpad_mask]: gathered[idx] is request order, no pads.
        An index_select with it needs no host sync (a boolean mask would)."""
        return self.pcp_restore_unpad_idx.gpu[:self.num_real_tokens]

    @property
    def local_num_tokens_per_req(self) -> np.ndarray:
        """[num_reqs] tokens of each request on this (and every) rank, pads included: P / W."""
        return self.num_padded_tokens[:self.num_reqs] // self.pcp_world_size

    def pad_slot_mapping(self, slot_mapping: torch.Tensor) -> torch.Tensor:
        """[num_real] slots in request order -> [padded_total] slots in padded order, -1 at pads
        (and at a decode's copies from ranks > 0), for writing restored all-gathered K/V."""
        if slot_mapping.shape[0] != self.num_real_tokens:
            raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries; the step has "
                             f"{self.num_real_tokens} real tokens")
        out = self.pcp_padded_slot_mapping[:self.padded_total]
        out.fill_(-1)
        idx = self.pcp_real_to_padded_idx.gpu[:self.num_real_tokens]
        out[idx] = slot_mapping.to(device=out.device, dtype=out.dtype)
        return out

    def restore_hidden_states(self, hidden_states: torch.Tensor, num_tokens_unpadded: int) -> torch.Tensor:
        """[>= local_total, ...] local rows -> [num_real, ...] every real token, request order; rows past
        `num_tokens_unpadded` (before CUDA-graph padding) never enter the gather."""
        if num_tokens_unpadded != self.local_total:
            raise ValueError(f"restore_hidden_states got {num_tokens_unpadded} local tokens; "
                             f"partition_inputs gave this rank {self.local_total}")
        local = hidden_states[:num_tokens_unpadded]
        if self.pcp_world_size > 1:
            local = self.pcp_group.all_gather(local, 0)
        return local.index_select(0, self.restore_unpad_idx.to(local.device))


def check_attention_cp_compatibility(parallel_config: ParallelConfig, backends: list[type],
                                     num_speculative_tokens: int = 0) -> None:
    """Fail at start-up when an attention backend cannot run the asked CP layout: it declares
    `name`, `supports_pcp`, `can_return_lse_for_decode` and `supports_mtp_with_cp_non_trivial_interleave_size`
    (missing: False); with pcp * dcp > 1 decode attention must return its LSE for the cross-rank merge."""
    pcp = parallel_config.prefill_context_parallel_size
    dcp = parallel_config.decode_context_parallel_size
    interleave = parallel_config.cp_kv_cache_interleave_size
    if pcp * dcp == 1:
        return
    needs = [  # (attribute, needed, why not): each problem reads "attention backend {name!r} {why}"
        ("can_return_lse_for_decode", True,
         f"cannot return the LSE of decode attention, which a KV cache sharded over {pcp * dcp} "
         f"CP ranks (pcp={pcp}, dcp={dcp}) needs; pick a backend that returns LSE or set "
         f"prefill_context_parallel_size=1 and decode_context_parallel_size=1"),
        ("supports_pcp", pcp > 1,
         "does not support prefill context parallelism; pick a backend with PCP support or set "
         "prefill_context_parallel_size=1"),
        ("supports_mtp_with_cp_non_trivial_interleave_size",
         num_speculative_tokens > 0 and interleave > 1,
         f"does not support speculative decoding ({num_speculative_tokens} tokens) with "
         f"cp_kv_cache_interleave_size={interleave}; set cp_kv_cache_interleave_size=1 or "
         f"disable speculative decoding"),
    ]
    problems = [f"attention backend {getattr(backend, 'name', backend.__name__)!r} {why}"
                for backend in dict.fromkeys(backends)  # dedupe, keep order
                for attr, needed, why in needs if needed and not getattr(backend, attr, False)]
    if problems:
        raise ValueError("unsupported context-parallel configuration:\n  " + "\n  ".join(problems))
