"""Agreeing on a step's shape across DP ranks: micro-batching, the padded token count and the
CUDA-graph mode (0 NONE, 1 PIECEWISE, 2 FULL), in one all-reduce over the DP group's gloo group."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from longserve.config import ParallelConfig

# rows of the exchanged [5, dp_size] tensor; column i is filled by DP rank i
UNPADDED, PADDED, WANTS_UBATCH, ALLOWS_DP_PADDING, CUDAGRAPH_MODE = range(5)


def can_split_into_ubatches(num_tokens: int,
                            num_scheduled_tokens_per_request: np.ndarray | None = None) -> bool:
    """Whether two non-empty micro-batches exist locally: two token halves, and with per-request
    counts two requests with tokens (a split keeps requests whole)."""
    per_request = num_scheduled_tokens_per_request
    return num_tokens >= 2 and (per_request is None or int(np.count_nonzero(per_request)) >= 2)


def _post_process_ubatch(table: torch.Tensor) -> bool:
    """Micro-batch only if every rank wants to and every rank's second micro-batch (its tokens
    [half, 2 * half) once all are padded to the common size) keeps a real token."""
    half = (int(table[PADDED].max()) + 1) // 2
    return bool(table[WANTS_UBATCH].all()) and int(table[UNPADDED].min()) > half


def _post_process_dp_padding(table: torch.Tensor, should_ubatch: bool) -> torch.Tensor | None:
    """Tokens each rank runs (both micro-batches): 2 * ceil(max padded / 2) when
    micro-batching, max padded when every rank allows DP padding, else None."""
    max_padded, dp_size = int(table[PADDED].max()), table.shape[1]
    if should_ubatch:
        return torch.full((dp_size,), 2 * ((max_padded + 1) // 2), dtype=torch.int32)
    if bool(table[ALLOWS_DP_PADDING].all()):
        return torch.full((dp_size,), max_padded, dtype=torch.int32)
    return None


def _post_process_cudagraph_mode(table: torch.Tensor) -> int:
    """The minimum mode over ranks: one rank without graphs (0) means none for all."""
    return int(table[CUDAGRAPH_MODE].min())


def _synchronize_dp_ranks(num_tokens_unpadded: int, num_tokens_padded: int,
                          should_attempt_ubatching: bool, should_attempt_dp_padding: bool,
                          cudagraph_mode: int, parallel_config: ParallelConfig,
                          dp_group=None) -> tuple[bool, torch.Tensor | None, int]:
    """One all-reduce of every rank's one-hot column into a [5, dp_size] int64 table, then the
    same decision on every rank from everyone's column."""
    dp_size = parallel_config.data_parallel_size
    dp_rank = dp_group.rank_in_group if dp_size > 1 else 0
    table = torch.zeros(5, dp_size, dtype=torch.int64)
    table[:, dp_rank] = torch.tensor([num_tokens_unpadded, num_tokens_padded,
                                      int(should_attempt_ubatching),
                                      int(should_attempt_dp_padding), int(cudagraph_mode)])
    if dp_size > 1:
        dist.all_reduce(table, group=dp_group.cpu_group)
    should_ubatch = _post_process_ubatch(table)
    return (should_ubatch, _post_process_dp_padding(table, should_ubatch),
            _post_process_cudagraph_mode(table))


def coordinate_batch_across_dp(num_tokens_unpadded: int, allow_microbatching: bool,
                               allow_dp_padding: bool, parallel_config: ParallelConfig,
                               num_tokens_padded: int | None = None,
                               uniform_decode: bool | None = None,
                               num_scheduled_tokens_per_request: np.ndarray | None = None,
                               cudagraph_mode: int = 0, dp_group=None,
                               ) -> tuple[bool, torch.Tensor | None, int]:
    """Agree with the other DP ranks on micro-batching, padding and CUDA-graph mode.

    num_tokens_padded: this rank's count after its own padding (default: unpadded); uniform_decode:
    vLLM's, unused. Returns (should_ubatch: every rank can split with a real token in each half,
    num_tokens_after_padding: CPU int32 [dp_size] equal on all ranks, or None without DP padding,
    synced_cudagraph_mode: the minimum over ranks)."""
    num_tokens_padded = num_tokens_unpadded if num_tokens_padded is None else num_tokens_padded
    dp_size = parallel_config.data_parallel_size
    if dp_size > 1 and (dp_group is None or dp_group.world_size != dp_size):
        raise ValueError(f"data_parallel_size={dp_size} needs the DP group of that size")
    wants_ubatch = allow_microbatching and can_split_into_ubatches(
        num_tokens_unpadded, num_scheduled_tokens_per_request)
    return _synchronize_dp_ranks(num_tokens_unpadded, num_tokens_padded, wants_ubatch,
                                 allow_dp_padding, cudagraph_mode, parallel_config, dp_group)
