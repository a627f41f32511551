import time

import numpy as np
import torch
import pytest

from dist_utils import run_distributed
from longserve.config import ParallelConfig
from longserve.distributed.parallel_state import build_parallel_state
from longserve.worker.dp_utils import can_split_into_ubatches, coordinate_batch_across_dp

ONE = ParallelConfig()


def test_can_split_into_ubatches():
    assert not can_split_into_ubatches(1)
    assert can_split_into_ubatches(2)
    assert not can_split_into_ubatches(100, np.array([100]))  # one request cannot be split
    assert not can_split_into_ubatches(100, np.array([0, 100, 0]))
    assert can_split_into_ubatches(100, np.array([99, 1]))


def test_single_dp_rank_needs_no_group():
    ubatch, padding, mode = coordinate_batch_across_dp(10, False, False, ONE, 16,
                                                       cudagraph_mode=2)
    assert (ubatch, padding, mode) == (False, None, 2)
    ubatch, padding, mode = coordinate_batch_across_dp(10, False, True, ONE, 16)
    assert not ubatch and padding.tolist() == [16] and mode == 0
    # micro-batching: 8 tokens padded to 8 -> two halves of 4
    ubatch, padding, _ = coordinate_batch_across_dp(
        8, True, False, ONE, num_scheduled_tokens_per_request=np.array([4, 4]))
    assert ubatch and padding.tolist() == [8]
    # one request: no by-request split
    ubatch, padding, _ = coordinate_batch_across_dp(
        8, True, False, ONE, num_scheduled_tokens_per_request=np.array([8]))
    assert not ubatch and padding is None
    # 3 real tokens padded to 8: the second half (tokens 4..7) would be all padding
    ubatch, _, _ = coordinate_batch_across_dp(3, True, False, ONE, 8)
    assert not ubatch


def test_dp_size_needs_a_group():
    with pytest.raises(ValueError, match="data_parallel_size=2"):
        coordinate_batch_across_dp(4, False, False, ParallelConfig(data_parallel_size=2))


# ---- with real process groups ----------------------------------------------------------

# per scenario, each rank's arguments:
# (unpadded, allow_ubatch, allow_pad, padded, per-request counts, cudagraph mode)
SCENARIOS = {
    "pad_to_max_and_min_mode": [(5, False, True, 8, None, 2), (13, False, True, 16, None, 1)],
    "no_padding_unless_all_allow": [(5, False, True, 8, None, 2), (13, False, False, 16, None, 2)],
    "ubatch_when_all_want": [(10, True, False, 10, [5, 5], 2), (7, True, False, 8, [3, 4], 2)],
    "no_ubatch_if_one_refuses": [(10, True, True, 10, [5, 5], 2), (7, False, True, 8, [3, 4], 0)],
    "no_ubatch_if_a_half_is_empty": [(30, True, True, 32, [15, 15], 2), (9, True, True, 16, [4, 5], 2)],
    "no_ubatch_single_request": [(10, True, True, 10, [5, 5], 1), (8, True, True, 8, [8], 1)],
}

EXPECTED = {  # (should_ubatch, num_tokens_after_padding, synced mode), the same on every rank
    "pad_to_max_and_min_mode": (False, [16, 16], 1),
    "no_padding_unless_all_allow": (False, None, 2),
    "ubatch_when_all_want": (True, [10, 10], 2),  # halves of 5; rank 1 has 7 > 5 real tokens
    "no_ubatch_if_one_refuses": (False, [10, 10], 0),
    "no_ubatch_if_a_half_is_empty": (False, [32, 32], 2),  # rank 1: 9 <= 16
    "no_ubatch_single_request": (False, [10, 10], 1),
}


def _coordinate_on_ranks(rank, world_size, pcp):
    cfg = ParallelConfig(data_parallel_size=world_size // pcp, prefill_context_parallel_size=pcp)
    state = build_parallel_state(cfg, rank)
    results = {}
    for name, per_rank in SCENARIOS.items():
        unpadded, allow_ubatch, allow_pad, padded, per_req, mode = per_rank[state.layout.dp_rank]
        ubatch, padding, synced = coordinate_batch_across_dp(
            unpadded, allow_ubatch, allow_pad, cfg, padded, None,
            None if per_req is None else np.array(per_req), mode, dp_group=state.dp)
        results[name] = (ubatch, None if padding is None else padding.tolist(), synced)
    return results


@pytest.mark.parametrize("pcp", [1, 2])  # 2 DP ranks; with pcp=2 two DP groups of 2
def test_coordinate_batch_across_two_dp_ranks(pcp):
    for results in run_distributed(_coordinate_on_ranks, 2 * pcp, pcp):
        assert results == EXPECTED


# ---- the spawn helper itself -----------------------------------------------------------

def _fail_on_rank_1(rank, world_size):
    if rank == 1:
        raise KeyError("boom from rank 1")
    return rank


def _hang_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(60)
    return rank


def test_run_distributed_propagates_errors_and_timeouts():
    assert run_distributed(_fail_on_rank_1, 1) == [0]
    with pytest.raises(RuntimeError, match="(?s)rank 1 of 2 failed.*KeyError.*boom"):
        run_distributed(_fail_on_rank_1, 2)
    start = time.monotonic()
    with pytest.raises(TimeoutError):
        run_distributed(_hang_on_rank_0, 2, timeout=2)
    assert time.monotonic() - start < 10


# ---- three DP ranks, hand-worked ------------------------------------------------------

SCENARIOS_3 = {
    # half = ceil(24 / 2) = 12 >= rank 0's 6 tokens: no micro-batching; pad all to 24
    "small_rank_blocks_ubatch": [(6, True, True, 8, [3, 3], 2), (20, True, True, 24, [10, 10], 1),
                                 (13, True, True, 16, [6, 7], 2)],
    # half = 10 < min unpadded 14: all micro-batch, 2 x 10 tokens each
    "all_ubatch": [(14, True, False, 16, [7, 7], 2), (20, True, False, 20, [10, 10], 2),
                   (15, True, True, 16, [5, 10], 2)],
    # an idle rank's dummy step (1 token, no graphs) refuses micro-batching, lowers the mode
    "idle_rank": [(1, False, True, 1, [1], 0), (30, True, True, 32, [15, 15], 2),
                  (4, True, True, 4, [2, 2], 2)],
    "one_rank_refuses_padding": [(5, False, True, 5, None, 2), (7, False, True, 8, None, 2),
                                 (9, False, False, 9, None, 2)],
}
EXPECTED_3 = {
    "small_rank_blocks_ubatch": (False, [24, 24, 24], 1),
    "all_ubatch": (True, [20, 20, 20], 2),
    "idle_rank": (False, [32, 32, 32], 0),
    "one_rank_refuses_padding": (False, None, 2),
}


def _coordinate_three(rank, world_size):
    cfg = ParallelConfig(data_parallel_size=3)
    state = build_parallel_state(cfg, rank)
    results = {}
    for name, per_rank in SCENARIOS_3.items():
        unpadded, allow_ubatch, allow_pad, padded, per_req, mode = per_rank[rank]
        ubatch, padding, synced = coordinate_batch_across_dp(
            unpadded, allow_ubatch, allow_pad, cfg, padded, None,
            None if per_req is None else np.array(per_req), mode, dp_group=state.dp)
        results[name] = (ubatch, None if padding is None else padding.tolist(), synced)
    return results


@pytest.mark.timeout(60)
def test_coordinate_batch_across_three_dp_ranks():
    for results in run_distributed(_coordinate_three, 3):
        assert results == EXPECTED_3


def test_post_processing_steps_by_name():
    from longserve.worker.dp_utils import (_post_process_cudagraph_mode, _post_process_dp_padding,
                                           _post_process_ubatch)
    # rows: unpadded, padded, wants ubatch, allows padding, graph mode; one column per rank
    table = torch.tensor([[14, 20], [16, 20], [1, 1], [1, 0], [2, 1]])
    assert _post_process_ubatch(table)
    assert _post_process_dp_padding(table, True).tolist() == [20, 20]
    assert _post_process_dp_padding(table, False) is None  # rank 1 does not allow padding
    assert _post_process_cudagraph_mode(table) == 1
