import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_utils import run_distributed
from longserve.attention.cp_attention import (exchange_partials, merge_attn_states, merge_partials,
                                              pack_partial, unpack_partial)
from longserve.config import ParallelConfig
from longserve.distributed.parallel_state import GroupCoordinator, build_parallel_state


def attention(q, k, v):
    """float64 reference: q [T, H, D], k/v [S, H, D] -> out [T, H, D], lse [T, H].
    No keys: out is NaN and lse is -inf, as an empty shard may report."""
    if k.shape[0] == 0:
        T, H, D = q.shape
        return torch.full((T, H, D), float("nan"), dtype=q.dtype), \
            torch.full((T, H), float("-inf"), dtype=q.dtype)
    scores = torch.einsum("thd,shd->ths", q, k) / math.sqrt(q.shape[-1])
    lse = torch.logsumexp(scores, dim=-1)
    return torch.einsum("ths,shd->thd", torch.softmax(scores, dim=-1), v), lse


def random_qkv(T, H, D, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64)
            for shape in ((T, H, D), (S, H, D), (S, H, D))]


def shard_attention(q, k, v, owner, rank, empty_lse=float("-inf")):
    """This rank's partial attention over its keys; an empty shard reports `empty_lse`."""
    out, lse = attention(q, k[owner == rank], v[owner == rank])
    if not bool((owner == rank).any()):
        lse = torch.full_like(lse, empty_lse)
    return out.float(), lse.float()


shardings = st.tuples(
    st.integers(1, 5), st.integers(1, 4), st.integers(1, 8),  # T, H, D
    st.integers(1, 5),  # N ranks
    st.lists(st.integers(0, 4), min_size=0, max_size=12),  # owner of each key (mod N)
    st.sampled_from([float("-inf"), float("nan"), float("inf")]),  # how empty shards report
    st.integers(0, 2**16),
)


class Recorder:
    """A CP group of one rank that keeps what it would send to each rank (the collective is
    done by hand): [W, ...], piece j for rank j."""
    def __init__(self, world_size):
        self.world_size = world_size

    def all_to_all(self, x, async_op=False):
        self.sent = x
        return (lambda: x) if async_op else x

    def all_gather(self, x, dim):
        self.sent = x.expand(self.world_size, *x.shape)
        return torch.cat([x] * self.world_size, dim)


def exchange_by_hand(parts, pcp, dcp, row_split):
    """Every rank's exchange_partials input, then what each rank receives: [W, ...] by rank."""
    sent = []
    for out, lse in parts:
        group = Recorder(pcp * dcp)
        exchange_partials(pack_partial(out, lse), group, dcp, row_split)
        sent.append(group.sent)
    return [torch.stack([sent[src][dst] for src in range(pcp * dcp)]) for dst in range(pcp * dcp)]


@settings(max_examples=150, deadline=None)
@given(shardings, st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1)]), st.booleans())
def test_exchange_and_merge_equal_attention_over_the_union(sharding, layout, rows_split):
    """Every (pcp, dcp) rank keeps its rows (PCP-split or all) and heads (its DCP share) of
    the attention over every rank's keys; empty shards (-inf / NaN / +inf LSE) weigh 0."""
    T, H, D, _, owners, empty_lse, seed = sharding
    pcp, dcp = layout
    row_split = pcp if rows_split else 1
    T, H = T * row_split, H * dcp
    q, k, v = random_qkv(T, H, D, len(owners), seed)
    owner = torch.tensor(owners, dtype=torch.int64) % (pcp * dcp)
    parts = [shard_attention(q, k, v, owner, r, empty_lse) for r in range(pcp * dcp)]
    ref_out, ref_lse = attention(q, k, v)
    for rank, received in enumerate(exchange_by_hand(parts, pcp, dcp, row_split)):
        rows = slice(None) if row_split == 1 else slice(rank // dcp * T // pcp, (rank // dcp + 1) * T // pcp)
        heads = slice(rank % dcp * H // dcp, (rank % dcp + 1) * H // dcp)
        out, lse = merge_partials(received, torch.float32)
        assert out.shape == ref_out[rows, heads].shape and not out.isnan().any()
        if len(owners) == 0:  # no keys anywhere: zeros and -inf, never NaN
            assert torch.equal(out, torch.zeros_like(out)) and bool(torch.isneginf(lse).all())
            continue
        torch.testing.assert_close(out.double(), ref_out[rows, heads], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse[rows, heads], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_merge_partials_half_precision(dtype):
    """Partials packed in half precision (a prefix's exchange): the LSE's float32 bytes ride in
    two columns exactly; the merge stays within half-precision rounding of exact attention."""
    q, k, v = random_qkv(3, 2, 4, 6)
    owner = torch.tensor([0, 1, 0, 1, 1, 1])
    parts = [shard_attention(q, k, v, owner, r) for r in range(2)]
    packed = torch.stack([pack_partial(o, l, dtype) for o, l in parts])
    assert packed.dtype == dtype and packed.shape[-1] == q.shape[-1] + 2
    for r, (o, l) in enumerate(parts):
        out_r, lse_r = unpack_partial(packed[r])
        assert torch.equal(lse_r, l.float()) and torch.equal(out_r, o.to(dtype))
    merged, lse = merge_partials(packed, dtype)
    assert merged.dtype == dtype
    ref_out, ref_lse = attention(q, k, v)
    torch.testing.assert_close(merged.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_exchange_refuses_rows_or_heads_that_do_not_divide():
    with pytest.raises(ValueError, match="divide"):
        exchange_partials(torch.zeros(3, 4, 3), Recorder(2), 1, 2)


@settings(max_examples=150, deadline=None)
@given(shardings)
def test_merge_attn_states_equals_attention_over_both(sharding):
    T, H, D, _, owners, empty_lse, seed = sharding
    q, k, v = random_qkv(T, H, D, len(owners), seed)
    owner = torch.tensor(owners, dtype=torch.int64) % 2  # 0: prefix keys, 1: suffix keys
    (p_out, p_lse), (s_out, s_lse) = [shard_attention(q, k, v, owner, r, empty_lse)
                                      for r in range(2)]
    output, output_lse = torch.empty(T, H, D), torch.empty(T, H)
    merge_attn_states(output, p_out, p_lse, s_out, s_lse, output_lse)
    assert not output.isnan().any() and not output_lse.isnan().any()
    if len(owners) == 0:
        assert torch.equal(output, torch.zeros_like(output))
        assert bool(torch.isneginf(output_lse).all())
        return
    ref_out, ref_lse = attention(q, k, v)
    torch.testing.assert_close(output.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(output_lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_attn_states_in_place_and_bfloat16():
    q, k, v = random_qkv(4, 2, 8, 10, seed=3)
    owner = torch.tensor([0] * 4 + [1] * 6)
    (p_out, p_lse), (s_out, s_lse) = [shard_attention(q, k, v, owner, r) for r in range(2)]
    prefix = p_out.bfloat16()
    merge_attn_states(prefix, prefix, p_lse, s_out.bfloat16(), s_lse)  # output aliases prefix
    assert prefix.dtype == torch.bfloat16
    torch.testing.assert_close(prefix.double(), attention(q, k, v)[0], atol=2e-2, rtol=2e-2)


# ---- with real process groups ----------------------------------------------------------

T, H, D, S = 4, 8, 16, 20


def _exchange_on_ranks(rank, world_size, pcp, dcp):
    """The real all-to-all over gloo: each rank's merged rows and heads against the reference."""
    cfg = ParallelConfig(tensor_parallel_size=dcp, prefill_context_parallel_size=pcp,
                         decode_context_parallel_size=dcp)
    state = build_parallel_state(cfg, rank)
    r, N = state.cp.rank_in_group, state.cp.world_size
    q, k, v = random_qkv(T, H, D, S, seed=7)
    owner = torch.arange(S) % N
    owner[owner == N - 1] = 0  # leave the last rank's shard empty
    out, lse = shard_attention(q, k, v, owner, r)
    ref_out, ref_lse = attention(q, k, v)
    heads = slice(r % dcp * H // dcp, (r % dcp + 1) * H // dcp)
    errors = {}
    for row_split in (1, pcp):
        p = r // dcp if row_split > 1 else 0
        rows = slice(p * T // row_split, (p + 1) * T // row_split)
        got, got_lse = merge_partials(exchange_partials(pack_partial(out, lse), state.cp, dcp, row_split),
                                      torch.float32)
        errors[f"out/{row_split}"] = (got.double() - ref_out[rows, heads]).abs().max().item()
        errors[f"lse/{row_split}"] = (got_lse.double() - ref_lse[rows, heads]).abs().max().item()
    return errors


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pcp,dcp", [(1, 2), (2, 1), (2, 2)])
def test_cp_exchange_over_gloo(pcp, dcp):
    for errors in run_distributed(_exchange_on_ranks, pcp * dcp, pcp, dcp):
        assert max(errors.values()) < 1e-5, errors


def test_size_one_group_is_the_identity():
    out, lse = torch.randn(2, 2, 3), torch.randn(2, 2)
    got = exchange_partials(pack_partial(out, lse), GroupCoordinator([0], 0), 1)
    assert torch.equal(got[0, ..., :-1], out) and torch.equal(got[0, ..., -1], lse)
