import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dist_utils import run_distributed
from longserve.attention.cp_attention import (correct_attn_out, cp_lse_ag_out_ar,
                                              cp_lse_ag_out_rs, merge_attn_states)
from longserve.config import ParallelConfig
from longserve.distributed.parallel_state import build_parallel_state


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


@settings(max_examples=150, deadline=None)
@given(shardings, st.booleans())
def test_lse_merge_equals_attention_over_the_union(sharding, base_e):
    T, H, D, N, owners, empty_lse, seed = sharding
    q, k, v = random_qkv(T, H, D, len(owners), seed)
    owner = torch.tensor(owners, dtype=torch.int64) % N
    parts = [shard_attention(q, k, v, owner, r, empty_lse) for r in range(N)]
    lses = torch.stack([lse for _, lse in parts])  # [N, T, H]
    if not base_e:
        lses = torch.where(torch.isfinite(lses), lses / math.log(2), lses)
    merged = torch.zeros(T, H, D)
    for r, (out, _) in enumerate(parts):
        corrected, lse = correct_attn_out(out, lses, r, is_lse_base_on_e=base_e)
        assert corrected.dtype == out.dtype and not corrected.isnan().any()
        merged += corrected
    ref_out, ref_lse = attention(q, k, v)
    if len(owners) == 0:  # no keys anywhere: zeros and -inf, never NaN
        assert torch.equal(merged, torch.zeros_like(merged))
        assert bool(torch.isneginf(lse).all())
        return
    expected_lse = ref_lse if base_e else ref_lse / math.log(2)
    torch.testing.assert_close(merged.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), expected_lse, atol=1e-5, rtol=1e-5)


def test_correct_attn_out_half_precision():
    q, k, v = random_qkv(3, 2, 4, 6)
    owner = torch.tensor([0, 1, 0, 1, 1, 1])
    parts = [shard_attention(q, k, v, owner, r) for r in range(2)]
    lses = torch.stack([lse for _, lse in parts])
    merged = sum(correct_attn_out(out.bfloat16(), lses, r)[0].float()
                 for r, (out, _) in enumerate(parts))
    torch.testing.assert_close(merged.double(), attention(q, k, v)[0], atol=2e-2, rtol=2e-2)


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


def _merge_on_ranks(rank, world_size, pcp, dcp):
    cfg = ParallelConfig(tensor_parallel_size=dcp, prefill_context_parallel_size=pcp,
                         decode_context_parallel_size=dcp)
    state = build_parallel_state(cfg, rank)
    group = state.cp if pcp > 1 else state.dcp
    N, r = group.world_size, group.rank_in_group
    q, k, v = random_qkv(T, H, D, S, seed=7)
    owner = torch.arange(S) % N
    owner[owner == N - 1] = 0  # leave the last rank's shard empty
    out, lse = shard_attention(q, k, v, owner, r)
    ref_out, ref_lse = attention(q, k, v)
    errors = {}
    got, got_lse = cp_lse_ag_out_ar(out, lse, group, return_lse=True)
    errors["ar"] = (got.double() - ref_out).abs().max().item()
    errors["ar_lse"] = (got_lse.double() - ref_lse).abs().max().item()
    heads = slice(r * H // N, (r + 1) * H // N)
    got, got_lse = cp_lse_ag_out_rs(out, lse, group, return_lse=True)  # over heads
    errors["rs_heads"] = (got.double() - ref_out[:, heads]).abs().max().item()
    errors["rs_heads_lse"] = (got_lse.double() - ref_lse[:, heads]).abs().max().item()
    tokens = slice(r * T // N, (r + 1) * T // N)
    got = cp_lse_ag_out_rs(out, lse, group, scatter_dim=0)  # over tokens (PCP)
    errors["rs_tokens"] = (got.double() - ref_out[tokens]).abs().max().item()
    base2 = cp_lse_ag_out_ar(out, lse / math.log(2), group, is_lse_base_on_e=False)
    errors["ar_base2"] = (base2.double() - ref_out).abs().max().item()
    return errors


@pytest.mark.parametrize("pcp,dcp", [(1, 2), (2, 2)])
def test_cp_lse_collectives_over_gloo(pcp, dcp):
    world_size = pcp * dcp
    for errors in run_distributed(_merge_on_ranks, world_size, pcp, dcp):
        assert max(errors.values()) < 1e-5, errors


def test_size_one_group_is_the_identity():
    class One:
        world_size, rank_in_group = 1, 0
    out, lse = torch.randn(2, 2, 3), torch.randn(2, 2)
    assert cp_lse_ag_out_rs(out, lse, One()) is out
    got_out, got_lse = cp_lse_ag_out_ar(out, lse, One(), return_lse=True)
    assert got_out is out and got_lse is lse
