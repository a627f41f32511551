"""The CUDA backend's fast paths equal the reference: folded GQA, gathered prefix attention,
and the varlen call over many prefill chunks (the last needs CUDA)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longserve.attention.backends import (_folded_gqa, batched_decode_attention,
                                          gathered_paged_attention, reference_attention,
                                          varlen_causal)
from longserve.attention.cp_attention import unpack_partial
from longserve.attention.metadata import PagedPart, VarlenLayout
from tests.test_triton_kernels import ref_paged_attention

HAS_CUDA = torch.cuda.is_available()


def _paged(seed, device, dtype, page=16, hkv=2, g=4, d=32, rows=(130, 0, 7), lens=(300, 50, 0)):
    gen = torch.Generator().manual_seed(seed)
    n_pages = sum(-(-n // page) for n in lens) + 3
    k_cache = torch.randn(n_pages, page, hkv, d, generator=gen).to(device, dtype)
    v_cache = torch.randn(n_pages, page, hkv, d, generator=gen).to(device, dtype)
    perm = torch.randperm(n_pages, generator=gen)
    width = max(-(-n // page) for n in lens)
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for r, n in enumerate(lens):
        m = -(-n // page)
        table[r, :m] = perm[used:used + m].int()
        used += m
    qsl = [0]
    for n in rows:
        qsl.append(qsl[-1] + n)
    q = torch.randn(qsl[-1], hkv * g, d, generator=gen).to(device, dtype)
    part = PagedPart(torch.tensor(qsl, dtype=torch.int32, device=device),
                     torch.tensor(lens, dtype=torch.int32, device=device), table.to(device),
                     max(rows), qsl, list(lens))
    return q, k_cache, v_cache, part


def _reference_paged(q, kc, vc, part, scale):
    """The float64 loop of tests/test_triton_kernels.py, in q's dtype."""
    out, lse = ref_paged_attention(q, kc, vc, part.block_table, part.query_start_loc,
                                   part.kv_lens, scale)
    return out.to(q.dtype), lse.float()


def test_folded_gqa_equals_reference():
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(9, 8, 16, generator=gen), torch.randn(11, 2, 16, generator=gen), \
        torch.randn(11, 2, 16, generator=gen)
    out, lse = _folded_gqa(q, k, v, 0.25)
    ref_out, ref_lse = reference_attention(q, k, v, False, 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(sq=st.integers(1, 20), sk=st.integers(1, 20), hkv=st.sampled_from([1, 2, 3]),
       g=st.sampled_from([1, 2, 4]), seed=st.integers(0, 1000))
def test_folded_gqa_any_shape(sq, sk, hkv, g, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(sq, hkv * g, 8, generator=gen)
    k, v = torch.randn(sk, hkv, 8, generator=gen), torch.randn(sk, hkv, 8, generator=gen)
    ref_out, ref_lse = reference_attention(q, k, v, False, 0.3)
    packed = torch.full((sq, hkv * g, 9), float("nan"))  # the exchange's layout: the output unfolds into it
    for dest in (None, unpack_partial(packed)[0]):
        out, lse = _folded_gqa(q, k, v, 0.3, dest)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(packed[..., :8], ref_out, atol=1e-5, rtol=1e-5)


@settings(max_examples=25, deadline=None)
@given(rows=st.lists(st.integers(0, 40), min_size=1, max_size=4),
       lens=st.lists(st.integers(0, 90), min_size=4, max_size=4), page=st.sampled_from([4, 16]),
       seed=st.integers(0, 1000))
def test_gathered_paged_attention_any_batch(rows, lens, page, seed):
    """Any rows per request, any cached lengths (empty included), any page size."""
    lens = lens[:len(rows)]
    if max(lens) == 0:
        lens[0] = 1
    q, kc, vc, part = _paged(seed, "cpu", torch.float32, page=page, rows=tuple(rows),
                             lens=tuple(lens))
    out, lse = gathered_paged_attention(q, kc, vc, part, 0.2)
    ref_out, ref_lse = _reference_paged(q, kc, vc, part, 0.2)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    for dtype in (torch.float32, torch.bfloat16):  # written in place into the exchange's layout
        packed = torch.full((*q.shape[:2], q.shape[2] + 4 // dtype.itemsize), float("nan"), dtype=dtype)
        gathered_paged_attention(q.to(dtype), kc.to(dtype), vc.to(dtype), part, 0.2, None,
                                 *unpack_partial(packed))
        got_out, got_lse = unpack_partial(packed)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got_out.float(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(got_lse, ref_lse, atol=tol, rtol=tol)


@settings(max_examples=25, deadline=None)
@given(lens=st.lists(st.integers(0, 70), min_size=1, max_size=5), page=st.sampled_from([4, 16]),
       g=st.sampled_from([1, 4]), seed=st.integers(0, 1000))
def test_batched_decode_attention_any_batch(lens, page, g, seed):
    """One row a request, any cached lengths (empty included): the reference's result; the
    slots built by the first call serve the next (a step's later layers)."""
    q, kc, vc, part = _paged(seed, "cpu", torch.float32, page=page, g=g, rows=(1,) * len(lens),
                             lens=tuple(lens))
    ref_out, ref_lse = _reference_paged(q, kc, vc, part, 0.2)
    for _ in range(2):
        out, lse = batched_decode_attention(q, kc, vc, part, 0.2)
        torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert part.packed is not None


def test_gathered_paged_attention_equals_reference():
    q, kc, vc, part = _paged(1, "cpu", torch.float32)
    out, lse = gathered_paged_attention(q, kc, vc, part, 0.2)
    ref_out, ref_lse = _reference_paged(q, kc, vc, part, 0.2)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    assert torch.isneginf(lse[130:137]).all() and (out[130:137] == 0).all()  # empty context


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_gathered_matches_triton_kernel():
    from longserve.attention.triton_kernels import paged_attention_lse
    q, kc, vc, part = _paged(2, "cuda", torch.bfloat16, rows=(300, 200, 1), lens=(3000, 517, 40))
    out, lse = gathered_paged_attention(q, kc, vc, part, 0.17)
    t_out, t_lse = paged_attention_lse(q, kc, vc, part.block_table, part.query_start_loc,
                                       part.kv_lens, 0.17, part.max_query_len)
    torch.testing.assert_close(out.float(), t_out.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, t_lse, atol=1e-2, rtol=1e-3)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("rows, lens", [((130, 0, 7, 64), (300, 50, 0, 1000)),  # flash, packed
                                        ((64, 9000), (17, 8200))])  # cuDNN for the long one
def test_gpu_prefix_attention_paths_equal_reference(rows, lens):
    q, kc, vc, part = _paged(3, "cuda", torch.bfloat16, rows=rows, lens=lens)
    for _ in range(2):  # the second call reuses the packed layout built by the first
        out, lse = gathered_paged_attention(q, kc, vc, part, 0.2)
        ref_out, ref_lse = _reference_paged(q, kc, vc, part, 0.2)
        torch.testing.assert_close(out.float().cpu(), ref_out.float().cpu(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.cpu(), ref_lse.cpu(), atol=1e-2, rtol=1e-3)
        packed = torch.full((*q.shape[:2], q.shape[2] + 2), float("nan"), dtype=q.dtype, device="cuda")
        gathered_paged_attention(q, kc, vc, part, 0.2, None, *unpack_partial(packed))  # in place
        assert torch.equal(unpack_partial(packed)[0], out) and torch.equal(unpack_partial(packed)[1], lse)
    empty = [i for i, (n, k) in enumerate(zip(rows, lens)) if k == 0]
    for i in empty:
        a, b = part.query_start_loc_cpu[i], part.query_start_loc_cpu[i + 1]
        assert torch.isneginf(lse[a:b]).all() and (out[a:b] == 0).all()


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_varlen_causal_equals_per_segment_reference():
    gen = torch.Generator().manual_seed(3)
    lens = [5, 130, 1, 64, 300]
    total = sum(lens)
    q = torch.randn(total, 8, 64, generator=gen).cuda().bfloat16()
    k = torch.randn(total, 2, 64, generator=gen).cuda().bfloat16()
    v = torch.randn(total, 2, 64, generator=gen).cuda().bfloat16()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32).cuda()
    out, lse = varlen_causal(q, k, v, VarlenLayout(cu, max(lens), 0, total), 0.125)
    assert out.shape == q.shape and lse.shape == (total, 8)
    start = 0
    for n in lens:
        rows = slice(start, start + n)
        ref_out, ref_lse = reference_attention(q[rows], k[rows], v[rows], True, 0.125)
        torch.testing.assert_close(out[rows].float(), ref_out, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[rows], ref_lse, atol=1e-2, rtol=1e-3)
        start += n


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("d", [32, 128])
def test_gpu_sdpa_with_lse_equals_reference(causal, dtype, d):
    from longserve.attention.backends import sdpa_with_lse
    gen = torch.Generator().manual_seed(4)
    for sq, sk, hq, hkv in ((300, 300, 8, 2), (77, 77, 4, 4), (50, 190, 8, 2), (190, 50, 4, 2)):
        if causal and sq < sk:
            continue
        q = torch.randn(sq, hq, d, generator=gen).cuda().to(dtype)
        k = torch.randn(sk, hkv, d, generator=gen).cuda().to(dtype)
        v = torch.randn(sk, hkv, d, generator=gen).cuda().to(dtype)
        out, lse = sdpa_with_lse(q, k, v, causal, 0.09)
        ref_out, ref_lse = reference_attention(q, k, v, causal, 0.09)
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
        torch.testing.assert_close(out.float(), ref_out, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=1e-3)
