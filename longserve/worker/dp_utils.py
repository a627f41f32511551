"""Agreeing on a step's shape across data-parallel (DP) ranks.

Every DP rank runs its own batch, but some choices must match on all ranks: whether to
split the batch into two micro-batches, how many tokens to pad to, and the CUDA-graph mode
(0 NONE, 1 PIECEWISE, 2 FULL). One all-reduce of a small int tensor over the DP group's
CPU (gloo) group settles all three; with one DP rank nothing is exchanged.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from longserve.config import ParallelConfig

# rows of the exchanged [5, dp_size] tensor; column i is filled by DP rank i
UNPADDED, PADDED, WANTS_UBATCH, ALLOWS_DP_PADDING, CUDAGRAPH_MODE = range(5)


def can_split_into_ubatches(num_tokens: int,
                            num_scheduled_tokens_per_request: np.ndarray | None = None) -> bool:
    """Whether two non-empty micro-batches exist locally: two token halves, and with
    per-request counts, a split at a request boundary (requests stay whole), which needs
    two requests that have tokens."""
    if num_tokens < 2:
        return False
    if num_scheduled_tokens_per_request is None:
        return True
    return int(np.count_nonzero(num_scheduled_tokens_per_request)) >= 2


def _exchange(column: list[int], dp_size: int, dp_rank: int, dp_group) -> torch.Tensor:
    """[5, dp_size] int64 with every rank's column; one all-reduce (sum of one-hot columns)."""
    table = torch.zeros(len(column), dp_size, dtype=torch.int64)
    table[:, dp_rank] = torch.tensor(column, dtype=torch.int64)
    if dp_size > 1:
        dist.all_reduce(table, group=dp_group.cpu_group)
    return table


def _decide(table: torch.Tensor) -> tuple[bool, torch.Tensor | None, int]:
    """The same decision on every rank, from everyone's column."""
    unpadded, padded = table[UNPADDED], table[PADDED]
    max_padded = int(padded.max())
    half = (max_padded + 1) // 2  # tokens per micro-batch once padded to the max
    # rank i's second micro-batch holds its tokens [half, 2 * half): real ones only if
    # it has more than `half`
    should_ubatch = bool(table[WANTS_UBATCH].all()) and int(unpadded.min()) > half
    dp_size = table.shape[1]
    if should_ubatch:
        num_tokens_after_padding = torch.full((dp_size,), 2 * half, dtype=torch.int32)
    elif bool(table[ALLOWS_DP_PADDING].all()):
        num_tokens_after_padding = torch.full((dp_size,), max_padded, dtype=torch.int32)
    else:
        num_tokens_after_padding = None
    return should_ubatch, num_tokens_after_padding, int(table[CUDAGRAPH_MODE].min())


def coordinate_batch_across_dp(num_tokens_unpadded: int, allow_microbatching: bool,
                               allow_dp_padding: bool, parallel_config: ParallelConfig,
                               num_tokens_padded: int | None = None,
                               uniform_decode: bool | None = None,
                               num_scheduled_tokens_per_request: np.ndarray | None = None,
                               cudagraph_mode: int = 0, dp_group=None,
                               ) -> tuple[bool, torch.Tensor | None, int]:
    """Agree with the other DP ranks on micro-batching, padding and CUDA-graph mode.

    num_tokens_padded: this rank's count after its own padding (CUDA-graph sizes, TP);
    defaults to num_tokens_unpadded. uniform_decode is accepted for vLLM compatibility:
    a batch of one-token decodes splits by request as well as by token, so the checks here
    do not need it. dp_group: the DP GroupCoordinator (its gloo `cpu_group` carries the
    exchange); not needed with one DP rank.

    Returns (should_ubatch, num_tokens_after_padding, synced_cudagraph_mode):
    - should_ubatch: every rank asked for it (allow_microbatching and a local split into
      two non-empty halves exists) and every rank's second micro-batch holds a real token
      after padding to the common size;
    - num_tokens_after_padding: CPU int32 [dp_size], the total tokens (both micro-batches)
      each rank runs, equal on all ranks: 2 * ceil(max padded / 2) when micro-batching,
      else max padded when every rank allows DP padding, else None (no DP padding: each
      rank runs its own num_tokens_padded);
    - synced_cudagraph_mode: the minimum mode over ranks.
    """
    if num_tokens_padded is None:
        num_tokens_padded = num_tokens_unpadded
    dp_size = parallel_config.data_parallel_size
    if dp_size > 1 and (dp_group is None or dp_group.world_size != dp_size):
        raise ValueError(f"data_parallel_size={dp_size} needs the DP group of that size")
    dp_rank = dp_group.rank_in_group if dp_size > 1 else 0
    wants_ubatch = allow_microbatching and can_split_into_ubatches(
        num_tokens_unpadded, num_scheduled_tokens_per_request)
    column = [num_tokens_unpadded, num_tokens_padded, int(wants_ubatch), int(allow_dp_padding),
              int(cudagraph_mode)]
    return _decide(_exchange(column, dp_size, dp_rank, dp_group))
