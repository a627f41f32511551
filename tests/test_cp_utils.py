import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_utils import run_distributed
from longserve.config import ParallelConfig
from longserve.distributed.parallel_state import build_parallel_state
from longserve.worker.cp_utils import PCPManager, check_attention_cp_compatibility

MAX_TOKENS = 512


def global_batch(num_scheduled, num_computed):
    """The global per-token arrays of a step (request order), in buffers with spare room."""
    n = np.asarray(num_scheduled, dtype=np.int64)
    computed = np.asarray(num_computed, dtype=np.int64)
    req = np.repeat(np.arange(len(n)), n)
    offsets = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
    positions = np.zeros(MAX_TOKENS, dtype=np.int64)
    req_indices = np.zeros(MAX_TOKENS, dtype=np.int32)
    positions[:len(req)] = computed[req] + offsets
    req_indices[:len(req)] = req
    return positions, req_indices


def partition(W, rank, num_scheduled, num_computed, threshold=1, group=None):
    manager = PCPManager(W, rank, max_num_reqs=16, max_padded_num_tokens=MAX_TOKENS,
                         device="cpu", pcp_group=group)
    positions, req_indices = global_batch(num_scheduled, num_computed)
    total, pos, req = manager.partition_inputs(
        positions, req_indices, np.asarray(num_scheduled), np.asarray(num_computed),
        np.arange(MAX_TOKENS), threshold)
    return manager, total, pos.copy(), req.copy()


# ---- worked examples -------------------------------------------------------------------

def test_contract_example_one_prefill_of_7_on_2_ranks():
    m0, total0, pos0, _ = partition(2, 0, [7], [0])
    m1, total1, pos1, _ = partition(2, 1, [7], [0])
    assert (total0, total1) == (4, 4)
    assert pos0.tolist() == [0, 1, 6, 7]  # 7 is a pad
    assert pos1.tolist() == [2, 3, 4, 5]
    for m in (m0, m1):
        assert m.restore_idx.tolist() == [0, 1, 4, 5, 6, 7, 2, 3]
        assert m.unpad_mask.tolist() == [True] * 7 + [False]
        assert m.num_pcp_pads[:1].tolist() == [1]
        assert m.local_num_tokens_per_req.tolist() == [4]
    slots = torch.arange(100, 107)
    assert m0.pad_slot_mapping(slots).tolist() == list(range(100, 107)) + [-1]
    # the gather holds padded offsets [0,1,6,7,2,3,4,5]; restoring sorts them
    gathered = torch.tensor(np.concatenate([pos0, pos1]))
    assert gathered[m0.restore_idx].tolist() == list(range(8))


def test_decode_is_duplicated_and_only_rank0_copy_is_kept():
    # request 0: decode of 1 token at position 10; request 1: fresh prefill of 4 tokens
    m0, total, pos0, req0 = partition(2, 0, [1, 4], [10, 0])
    _, _, pos1, req1 = partition(2, 1, [1, 4], [10, 0])
    assert total == 3
    assert pos0.tolist() == [10, 0, 3] and pos1.tolist() == [10, 1, 2]
    assert req0.tolist() == [0, 1, 1] and req1.tolist() == [0, 1, 1]
    # padded order: [decode r0, decode r1, prefill 0..3]; gathered: [10,0,3, 10,1,2]
    assert m0.restore_idx.tolist() == [0, 3, 1, 4, 5, 2]
    assert m0.unpad_mask.tolist() == [True, False, True, True, True, True]
    assert m0.num_pcp_pads[:2].tolist() == [1, 0]
    assert m0.pad_slot_mapping(torch.tensor([7, 8, -1, 9, -1])).tolist() == [7, -1, 8, -1, 9, -1]


def test_pads_point_at_the_last_real_token():
    m, total, pos, req = partition(2, 0, [2, 5], [0, 3])
    # request 0: 2 tokens -> padded 4, rank 0 takes offsets [0, 3]; 3 is a pad
    # request 1: 5 tokens at positions 3..7 -> padded 8, rank 0 takes offsets [0, 1, 6, 7]
    assert pos.tolist() == [0, 3, 3, 4, 9, 10]
    assert m.local_token_indices[:total].tolist() == [0, 1, 2, 3, 6, 6]


def test_errors():
    with pytest.raises(ValueError, match="reorder_batch_threshold"):
        partition(2, 0, [4], [0], threshold=None)
    m = PCPManager(2, 0, max_num_reqs=4, max_padded_num_tokens=8, device="cpu")
    positions, req_indices = global_batch([9], [0])
    with pytest.raises(ValueError, match="max_padded_num_tokens"):
        m.partition_inputs(positions, req_indices, np.array([9]), np.array([0]),
                           np.arange(16), 1)
    with pytest.raises(ValueError, match="PCP share needs"):
        # one fresh token is padded to 2W = 4, 2 per rank: more than the arrays hold
        m.partition_inputs(positions[:1], req_indices[:1], np.array([1]), np.array([0]),
                           np.arange(16), 1)


# ---- properties over random batches ----------------------------------------------------

batches = st.integers(1, 6).flatmap(lambda num_reqs: st.tuples(
    st.integers(1, 4),  # W
    st.lists(st.integers(1, 24), min_size=num_reqs, max_size=num_reqs),  # scheduled
    st.lists(st.integers(0, 40), min_size=num_reqs, max_size=num_reqs),  # computed
    st.sampled_from([1, 2, 4]),  # reorder_batch_threshold
))


@settings(max_examples=150, deadline=None)
@given(batches)
def test_restore_index_undoes_the_gather(batch):
    W, scheduled, computed, threshold = batch
    expected_pos, expected_req = global_batch(scheduled, computed)
    num_real = sum(scheduled)
    ranks = [partition(W, r, scheduled, computed, threshold) for r in range(W)]
    m0, local_total = ranks[0][0], ranks[0][1]
    # every rank gets the same number of tokens of every request
    for m, total, _, req in ranks:
        assert total == local_total
        counts = np.bincount(req, minlength=len(scheduled))
        assert counts.tolist() == m0.local_num_tokens_per_req.tolist()
        assert np.array_equal(m.restore_idx, m0.restore_idx)
    gathered_pos = torch.tensor(np.concatenate([r[2] for r in ranks]))
    gathered_req = torch.tensor(np.concatenate([r[3] for r in ranks]))
    assert sorted(m0.restore_idx.tolist()) == list(range(W * local_total))  # a permutation
    restored = gathered_pos[m0.restore_idx][m0.unpad_mask]
    assert restored.tolist() == expected_pos[:num_real].tolist()
    assert gathered_req[m0.restore_idx][m0.unpad_mask].tolist() == expected_req[:num_real].tolist()
    assert gathered_pos[m0.restore_unpad_idx].tolist() == expected_pos[:num_real].tolist()
    # pads continue their request's positions, so they sort after its real tokens
    pad_req = gathered_req[m0.restore_idx][~m0.unpad_mask]
    pad_pos = gathered_pos[m0.restore_idx][~m0.unpad_mask]
    last_pos = np.asarray(computed) + np.asarray(scheduled) - 1
    is_decode = (np.asarray(scheduled) <= threshold) & (np.asarray(computed) > 0)
    for p, r in zip(pad_pos.tolist(), pad_req.tolist()):
        assert p > last_pos[r] or is_decode[r]


@settings(max_examples=100, deadline=None)
@given(batches, st.randoms(use_true_random=False))
def test_padded_slot_mapping_keeps_every_real_slot(batch, rnd):
    W, scheduled, computed, threshold = batch
    m, *_ = partition(W, rnd.randrange(W), scheduled, computed, threshold)
    num_real = sum(scheduled)
    slots = torch.tensor([rnd.choice([-1, rnd.randrange(10_000)]) for _ in range(num_real)])
    padded = m.pad_slot_mapping(slots)
    assert padded.shape[0] == m.padded_total
    assert torch.equal(padded[m.unpad_mask], slots)
    assert bool((padded[~m.unpad_mask] == -1).all())


def test_restore_hidden_states_single_rank_drops_pads_and_cuda_graph_rows():
    m, total, pos, _ = partition(1, 0, [3, 1], [0, 5], threshold=1)
    hidden = torch.cat([torch.tensor(pos, dtype=torch.float32)[:, None],
                        torch.full((5, 1), float("nan"))])  # 5 CUDA-graph padding rows
    out = m.restore_hidden_states(hidden, total)
    assert out[:, 0].tolist() == [0, 1, 2, 5]
    with pytest.raises(ValueError, match="local tokens"):
        m.restore_hidden_states(hidden, total + 1)


# ---- with real process groups ----------------------------------------------------------

def _restore_on_ranks(rank, world_size):
    state = build_parallel_state(ParallelConfig(prefill_context_parallel_size=world_size), rank)
    scheduled, computed = [1, 2, 9, 4], [6, 3, 0, 0]  # two decodes (threshold 2), two prefills
    m, total, pos, req = partition(world_size, state.layout.pcp_rank, scheduled, computed,
                                   threshold=2, group=state.pcp)
    hidden = torch.stack([torch.tensor(pos), torch.tensor(req, dtype=torch.int64)], dim=1)
    hidden = torch.cat([hidden.float(), torch.full((3, 2), float("nan"))])  # graph padding
    out = m.restore_hidden_states(hidden, total)
    expected_pos, expected_req = global_batch(scheduled, computed)
    n = sum(scheduled)
    return (out[:, 0].tolist() == expected_pos[:n].tolist()
            and out[:, 1].tolist() == expected_req[:n].tolist())


@pytest.mark.parametrize("world_size", [2, 4])
def test_restore_hidden_states_over_gloo(world_size):
    assert run_distributed(_restore_on_ranks, world_size) == [True] * world_size


# ---- backend compatibility -------------------------------------------------------------

class FullBackend:
    name = "FULL"
    supports_pcp = True
    can_return_lse_for_decode = True
    supports_mtp_with_cp_non_trivial_interleave_size = True


class NoLseBackend:
    name = "NO_LSE"
    supports_pcp = True
    can_return_lse_for_decode = False
    supports_mtp_with_cp_non_trivial_interleave_size = True


class NoPcpBackend:
    name = "NO_PCP"
    supports_pcp = False
    can_return_lse_for_decode = True
    supports_mtp_with_cp_non_trivial_interleave_size = False


def test_check_attention_cp_compatibility():
    no_cp = ParallelConfig(tensor_parallel_size=2)
    check_attention_cp_compatibility(no_cp, [NoLseBackend, NoPcpBackend], 3)
    dcp = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2)
    check_attention_cp_compatibility(dcp, [FullBackend, NoPcpBackend])
    with pytest.raises(ValueError, match="NO_LSE.*decode_context_parallel_size=1"):
        check_attention_cp_compatibility(dcp, [FullBackend, NoLseBackend])
    pcp = ParallelConfig(prefill_context_parallel_size=2)
    with pytest.raises(ValueError, match="NO_PCP.*prefill_context_parallel_size=1"):
        check_attention_cp_compatibility(pcp, [NoPcpBackend])
    interleaved = ParallelConfig(tensor_parallel_size=2, decode_context_parallel_size=2,
                                 cp_kv_cache_interleave_size=4)
    check_attention_cp_compatibility(interleaved, [NoPcpBackend], num_speculative_tokens=0)
    with pytest.raises(ValueError, match="NO_PCP.*cp_kv_cache_interleave_size=1"):
        check_attention_cp_compatibility(interleaved, [NoPcpBackend], num_speculative_tokens=2)


@pytest.mark.parametrize("prefills", [1, 2])
def test_pcp_prefix_row_groups(prefills):
    """The prefix part over the PCP-gathered rows (rank-major): a lone prefill's rows of every
    rank are adjacent and make one row group (one page gather, one kernel call a layer); with
    several prefills a group per (rank, request), each against its request's table row."""
    from longserve.attention.metadata import AttentionMetadata
    from longserve.distributed.parallel_state import GroupCoordinator, ParallelState, RankLayout
    from longserve.worker.step_inputs import CPLayout, add_prefill_parts
    W, block = 2, 4
    pcp, one = GroupCoordinator([0, 1], 0), GroupCoordinator([0], 0)
    ps = ParallelState(RankLayout(1, W, 1, 1, 0), one, pcp, one, pcp, one, pcp)
    n = np.array([8, 12][:prefills])  # this step's tokens of each prefill
    computed = np.array([16, 24][:prefills])  # each has a cached prefix
    local_n = -(-n // (2 * W)) * 2  # P / W: a rank's padded share
    table = torch.arange(prefills * 8, dtype=torch.int32).view(prefills, 8)
    meta = AttentionMetadata(num_decode_tokens=0, num_tokens=int(local_n.sum()),
                             slot_mapping=torch.zeros(0, dtype=torch.int64), decode=None, ps=ps)
    add_prefill_parts(meta, n, computed, np.concatenate(([0], np.cumsum(n))),
                      np.concatenate(([0], np.cumsum(local_n))), 0, table,
                      CPLayout(block, W, 0, 1), ps, "cpu")
    part = meta.prefix
    rows = [W * local_n[0]] if prefills == 1 else list(local_n) * W
    assert np.diff(part.query_start_loc_cpu).tolist() == rows
    assert part.kv_lens_cpu == ([8] if prefills == 1 else [8, 12] * W)  # a rank's shard of the prefix
    assert part.block_table.tolist() == (table if prefills == 1 else table.repeat(W, 1)).tolist()
