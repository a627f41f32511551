import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longserve.worker.block_table import (compute_slot_mapping, get_dcp_local_seq_lens,
                                          map_to_kernel_blocks)


def test_contract_example_dcp2_rank1():
    slots = compute_slot_mapping(np.array([[5, 6]]), np.zeros(8, dtype=np.int64),
                                 np.array([0, 1, 2, 3, 4, 5, 32, 33]), block_size=16,
                                 cp_world_size=2, cp_rank=1, interleave_size=1)
    assert slots.dtype == np.int64
    assert slots.tolist() == [-1, 80, -1, 81, -1, 82, -1, 96]


def test_torch_inputs_give_torch_and_same_slots():
    args = (np.array([[5, 6]]), np.zeros(8, dtype=np.int64), np.array([0, 1, 2, 3, 4, 5, 32, 33]))
    expected = compute_slot_mapping(*args, 16, 2, 1, 1)
    got = compute_slot_mapping(*(torch.as_tensor(a) for a in args), 16, 2, 1, 1)
    assert isinstance(got, torch.Tensor) and got.dtype == torch.int64
    assert got.tolist() == expected.tolist()


def test_interleave_must_divide_block_size():
    with pytest.raises(ValueError, match="must divide"):
        compute_slot_mapping(np.array([[0]]), [0], [0], 16, 2, 0, 3)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 8), st.integers(0, 200), st.lists(st.integers(0, 50), min_size=13,
                                                         max_size=13, unique=True))
def test_single_rank_is_the_usual_mapping(B, n, blocks):
    positions = np.arange(min(n, 13 * B))
    slots = compute_slot_mapping(np.array([blocks]), np.zeros_like(positions), positions, B)
    assert slots.tolist() == [blocks[p // B] * B + p % B for p in positions]


cp_layouts = st.tuples(st.integers(1, 6), st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4])
                       ).map(lambda t: (t[0], t[1], t[1] * t[2]))  # (W, I, B) with I | B


@settings(max_examples=150, deadline=None)
@given(cp_layouts, st.integers(1, 4))
def test_every_token_has_one_owner_and_local_offsets_biject(layout, num_blocks):
    W, I, B = layout
    table = np.array([np.arange(num_blocks) * 3 + 7])  # arbitrary distinct blocks
    positions = np.arange(num_blocks * B * W)  # whole virtual blocks
    req = np.zeros_like(positions)
    per_rank = np.stack([compute_slot_mapping(table, req, positions, B, W, r, I)
                         for r in range(W)])  # [W, N]
    assert ((per_rank >= 0).sum(0) == 1).all()  # exactly one owner per token
    for r in range(W):
        mine = positions[per_rank[r] >= 0]
        for v in range(num_blocks):  # per virtual block: offsets onto [0, B)
            slots = per_rank[r][mine[(mine // (B * W)) == v]]
            assert sorted(slots.tolist()) == list(range(table[0, v] * B, table[0, v] * B + B))
        # a rank's tokens, in position order, fill its shard like an ordinary sequence
        t = np.arange(len(mine))
        assert per_rank[r][mine].tolist() == (table[0, t // B] * B + t % B).tolist()


@settings(max_examples=150, deadline=None)
@given(cp_layouts, st.lists(st.integers(0, 300), min_size=1, max_size=8))
def test_local_seq_lens_sum_to_seq_len_and_count_owned_tokens(layout, lens):
    W, I, B = layout
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    all_ranks = get_dcp_local_seq_lens(seq_lens, W, None, I)
    assert all_ranks.shape == (len(lens), W) and all_ranks.dtype == torch.int32
    assert all_ranks.sum(1).tolist() == lens
    for r in range(W):
        assert torch.equal(get_dcp_local_seq_lens(seq_lens, W, r, I), all_ranks[:, r])
    # the count equals the tokens the slot mapping gives this rank
    table = np.arange(301)[None].repeat(len(lens), 0)  # enough blocks even for B = W = 1
    for i, n in enumerate(lens):
        owned = [(compute_slot_mapping(table, np.full(n, i), np.arange(n), B, W, r, I) >= 0).sum()
                 for r in range(W)]
        assert owned == all_ranks[i].tolist()


def test_local_seq_lens_example():
    # W=2, I=2: positions go 0,1 -> r0, 2,3 -> r1, 4,5 -> r0, ...
    got = get_dcp_local_seq_lens(torch.tensor([0, 1, 3, 5, 8]), 2, None, 2)
    assert got.tolist() == [[0, 0], [1, 0], [2, 1], [3, 2], [4, 4]]


def test_map_to_kernel_blocks():
    assert map_to_kernel_blocks(np.array([3, 5]), 4).tolist() == [12, 13, 14, 15, 20, 21, 22, 23]
    assert map_to_kernel_blocks(torch.tensor([[1, 2]]), 2).tolist() == [[2, 3, 4, 5]]
    assert map_to_kernel_blocks([7], 1) == [7]


@settings(max_examples=100, deadline=None)
@given(cp_layouts, st.sampled_from([1, 2, 4]), st.integers(0, 3),
       st.lists(st.integers(0, 40), min_size=1, max_size=5, unique=True))
def test_kernel_blocks_give_the_same_slots_as_manager_blocks(layout, k, rank_seed, blocks):
    W, I, kernel_B = layout
    manager_B = kernel_B * k
    rank = rank_seed % W
    kernel_table = map_to_kernel_blocks(np.array([blocks]), k)
    assert kernel_table.shape == (1, len(blocks) * k)
    positions = np.arange(len(blocks) * manager_B * W)
    req = np.zeros_like(positions)
    expected = compute_slot_mapping(np.array([blocks]), req, positions, manager_B, W, rank, I)
    got = compute_slot_mapping(kernel_table, req, positions, kernel_B, W, rank, I)
    assert got.tolist() == expected.tolist()


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 1 << 20), max_size=40), max_size=8))
def test_block_id_list_holds_what_was_appended(chunks):
    from longserve.worker.block_table import BlockIdList
    first, rest = (chunks[0], chunks[1:]) if chunks else ([], [])
    ids = BlockIdList(first)
    for c in rest:
        ids.extend(c)
    assert ids.view().tolist() == [b for c in chunks for b in c] and len(ids) == ids.view().size
