"""Triton kernels of longserve.attention.triton_kernels against float64 torch references.

On CPU the kernels run under the Triton interpreter. TRITON_INTERPRET must be set before a
kernel module is imported (triton.jit reads it at decoration time), and another test module
may already have imported things in this process, so unless this process was started with
TRITON_INTERPRET=1 the CPU checks run once in a child process (this file as a script, with
the variable set) and each test reports its own entry of that run. With CUDA the same checks
also run here, directly on the GPU, in float32 and bfloat16 at larger sizes. (Triton 3.6's
interpreter cannot loop over run-time bounds; there the interpreter checks report skipped.)
"""
from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import traceback

import pytest
import torch
import triton
from hypothesis import given, settings, strategies as st

from interpreter_utils import speed_up_interpreter

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
speed_up_interpreter()
HAS_CUDA = torch.cuda.is_available() and not INTERPRET
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _kernels():
    from longserve.attention import triton_kernels
    return triton_kernels


# ----------------------------------------------------------------------------------------
# float64 references, written as loops
# ----------------------------------------------------------------------------------------

def ref_store_kv(key, value, k_cache, v_cache, slot_mapping):
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_flat[slot] = key[t]
            v_flat[slot] = value[t]


def ref_paged_attention(q, k_cache, v_cache, block_table, query_start_loc, kv_lens, scale):
    """Every query row of request r attends (no mask) to its first kv_lens[r] cached tokens."""
    T, Hq, D = q.shape
    B, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    lse = torch.full((T, Hq), -math.inf, dtype=torch.float64)
    qsl = query_start_loc.tolist()
    for r, kv_len in enumerate(kv_lens.tolist()):
        if kv_len == 0 or qsl[r] == qsl[r + 1]:
            continue
        slots = [int(block_table[r, j // B]) * B + j % B for j in range(kv_len)]
        k = k_cache.reshape(-1, Hkv, D)[slots].double().cpu().repeat_interleave(G, dim=1)  # [L, Hq, D]
        v = v_cache.reshape(-1, Hkv, D)[slots].double().cpu().repeat_interleave(G, dim=1)
        qr = q[qsl[r]:qsl[r + 1]].double().cpu()  # [rows, Hq, D]
        s = torch.einsum("thd,lhd->thl", qr, k) * scale
        lse[qsl[r]:qsl[r + 1]] = torch.logsumexp(s, dim=-1)
        out[qsl[r]:qsl[r + 1]] = torch.einsum("thl,lhd->thd", torch.softmax(s, dim=-1), v)
    return out, lse


def ref_merge(prefix_out, prefix_lse, suffix_out, suffix_lse):
    T, H, D = prefix_out.shape
    out = torch.zeros(T, H, D, dtype=torch.float64)
    lse = torch.full((T, H), -math.inf, dtype=torch.float64)
    for t in range(T):
        for h in range(H):
            lses = [float(prefix_lse[t, h]), float(suffix_lse[t, h])]
            lses = [-math.inf if (math.isnan(x) or x == math.inf) else x for x in lses]
            m = max(lses)
            if m == -math.inf:
                continue
            w = [math.exp(x - m) for x in lses]
            for wi, o in zip(w, (prefix_out[t, h], suffix_out[t, h])):
                if wi > 0:  # an empty state's output may be anything, NaN too
                    out[t, h] += wi * o.double().cpu() / sum(w)
            lse[t, h] = m + math.log(sum(w))
    return out, lse


# ----------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------

def _randn(*shape, dtype, device, gen):
    """Random data that is never exactly zero."""
    x = torch.randn(*shape, generator=gen, dtype=torch.float32)
    x = torch.where(x.abs() < 1e-2, torch.full_like(x, 0.5), x)
    return x.to(dtype=dtype, device=device)


def make_attention_case(kv_lens, q_lens, Hkv, G, D, B, dtype, device, seed=0, pad_rows=0):
    """A paged cache with shuffled block ids, and q as a strided slice of a wider tensor."""
    gen = torch.Generator().manual_seed(seed)
    R = len(kv_lens)
    max_blocks = max(1, max(-(-n // B) for n in kv_lens)) + 1  # one spare column
    num_blocks = R * max_blocks + 3
    kv_cache = _randn(2, num_blocks, B, Hkv, D, dtype=dtype, device=device, gen=gen)
    perm = torch.randperm(num_blocks, generator=gen)[: R * max_blocks]
    block_table = perm.view(R, max_blocks).to(torch.int32).to(device)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32, device=device)
    T = sum(q_lens) + pad_rows  # pad_rows: CUDA-graph padding rows beyond query_start_loc[-1]
    Hq = Hkv * G
    wide = _randn(T, Hq + 3, D, dtype=dtype, device=device, gen=gen)
    q = wide[:, 1:1 + Hq]  # strided on dims 0 and 1
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    return dict(q=q, k_cache=kv_cache[0], v_cache=kv_cache[1], block_table=block_table,
                query_start_loc=qsl, kv_lens=lens, scale=D ** -0.5, max_query_len=max(q_lens))


def fp8_case(case, seed=0):
    """The case with its cache in float8 e4m3 (per-head scales near amax / 448, some heads'
    values past 448 saturating): the kernel reads the FP8 cache and `kv_scale`, the
    reference the same values dequantized."""
    from longserve.attention.kv_quant import dequantize_kv, quantize_kv
    gen = torch.Generator().manual_seed(seed)
    k, v = case["k_cache"], case["v_cache"]
    amax = torch.stack([k.abs().amax((0, 1, 3)), v.abs().amax((0, 1, 3))]).float().cpu()
    kv_scale = (amax / 448 * (0.8 + 0.4 * torch.rand(amax.shape, generator=gen))).to(k.device)
    quant = [quantize_kv(c.flatten(0, 1), s, torch.float8_e4m3fn).view(c.shape) for c, s in zip((k, v), kv_scale)]
    deq = [dequantize_kv(c.flatten(0, 1), s, torch.float32).view(c.shape) for c, s in zip(quant, kv_scale)]
    return dict(case, k_cache=quant[0], v_cache=quant[1], kv_scale=kv_scale), dict(case, k_cache=deq[0], v_cache=deq[1])


def _tol(dtype):
    return {torch.float32: 2e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


def _check_attention(case, num_kv_splits=None, dtype=torch.float32, ref_case=None):
    """ref_case: what the reference reads instead (an FP8 case's dequantized cache)."""
    tk = _kernels()
    out, lse = tk.paged_attention_lse(**case, num_kv_splits=num_kv_splits)
    assert out.dtype == case["q"].dtype and out.shape == case["q"].shape
    assert lse.dtype == torch.float32 and lse.shape == case["q"].shape[:2]
    args = {k: v for k, v in (ref_case or case).items() if k != "max_query_len"}
    ref_out, ref_lse = ref_paged_attention(**args)
    n = int(case["query_start_loc"][-1])  # rows past it (padding) are not written
    out, lse, ref_out, ref_lse = out[:n].double().cpu(), lse[:n].double().cpu(), ref_out[:n], ref_lse[:n]
    assert not out.isnan().any() and not lse.isnan().any()
    empty = ref_lse == -math.inf
    assert torch.equal(lse == -math.inf, empty), "lse must be -inf exactly for empty requests"
    assert (out[empty] == 0).all()
    tol = _tol(dtype)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse[~empty], ref_lse[~empty], atol=tol, rtol=tol)
    return out, lse


# ----------------------------------------------------------------------------------------
# checks (each raises on failure); run under the interpreter on CPU, or on the GPU
# ----------------------------------------------------------------------------------------

def check_store_kv(device="cpu", dtype=torch.float32, T=11, Hkv=2, D=16, B=4, N=6, fp8=False):
    """fp8: an FP8 cache, bit-equal to the torch reference's quantization (saturation too)."""
    from longserve.attention.kv_quant import quantize_kv
    tk = _kernels()
    gen = torch.Generator().manual_seed(1)
    Hq = 2 * Hkv
    qkv = _randn(T, (Hq + 2 * Hkv) * D, dtype=dtype, device=device, gen=gen)
    key = qkv[:, Hq * D:(Hq + Hkv) * D].view(T, Hkv, D)  # strided views of a fused qkv output
    value = qkv[:, (Hq + Hkv) * D:].view(T, Hkv, D)
    assert not key.is_contiguous()
    slots = torch.randperm(N * B, generator=gen)[:T]
    slots[[2, 5, T - 1]] = -1  # padding rows / tokens of another rank
    slots = slots.to(torch.int64).to(device)
    cache_dtype, kv_scale = dtype, None
    if fp8:  # head 0's scale is small enough that some values saturate
        cache_dtype = torch.float8_e4m3fn
        kv_scale = (torch.rand(2, Hkv, generator=gen) * 0.02 + 0.001).to(device)
        kv_scale[:, 0] = 0.002
    kv_cache = torch.full((2, N, B, Hkv, D), 96.0, dtype=dtype, device=device).to(cache_dtype)  # poison
    expected = kv_cache.clone()
    ref_store_kv(quantize_kv(key, None if kv_scale is None else kv_scale[0], cache_dtype),
                 quantize_kv(value, None if kv_scale is None else kv_scale[1], cache_dtype),
                 expected[0], expected[1], slots)
    tk.store_kv(key, value, kv_cache[0], kv_cache[1], slots, kv_scale)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    if fp8:
        assert (kv_cache.float().abs() == 448).any()
    untouched = torch.ones(N * B, dtype=torch.bool)
    untouched[slots[slots >= 0].cpu()] = False
    assert (kv_cache.view(2, N * B, Hkv, D)[:, untouched.to(device)].float() == 96.0).all()


def check_attention_decode(G, device="cpu", dtype=torch.float32, D=16, B=4, Hkv=2,
                           kv_lens=(5, 0, 13, 1, 8, 16)):
    case = make_attention_case(list(kv_lens), [1] * len(kv_lens), Hkv, G, D, B, dtype, device, seed=G)
    _check_attention(case, dtype=dtype)


def check_attention_multirow(G, device="cpu", dtype=torch.float32, D=16, B=4, Hkv=2,
                             kv_lens=(7, 0, 21, 4, 16), q_lens=(3, 2, 20, 0, 1)):
    case = make_attention_case(list(kv_lens), list(q_lens), Hkv, G, D, B, dtype, device,
                               seed=10 + G, pad_rows=3)
    _check_attention(case, dtype=dtype)


def check_attention_splits(device="cpu", dtype=torch.float32, G=2, D=16, B=4, Hkv=2,
                           kv_lens=(37, 0, 5, 64), q_lens=(1, 2, 5, 1), splits=(1, 2, 3, 7, None)):
    """Split and non-split paths agree (and with the reference), for multi-row (prefix) queries
    (more splits than tiles too) and one-row (decode) queries under several work-item budgets,
    shares of >= MIN_SHARE tokens (all requests whole) and of one tile (the long ones cut)."""
    tk = _kernels()
    ones = [1] * len(kv_lens)
    for kv, lens, min_split in ((kv_lens, q_lens, tk.MIN_SHARE), (kv_lens, ones, tk.MIN_SHARE),
                                (kv_lens, ones, 1), (kv_lens[-1:], [1], 1)):  # (one request: its merge)
        case = make_attention_case(list(kv), list(lens), Hkv, G, D, B, dtype, device, seed=3)
        base_out, base_lse = _check_attention(case, num_kv_splits=1, dtype=dtype)
        saved, tk.MIN_SHARE = tk.MIN_SHARE, min_split
        try:
            for s in splits[1:]:
                out, lse = _check_attention(case, num_kv_splits=s, dtype=dtype)
                tol = _tol(dtype)
                torch.testing.assert_close(out, base_out, atol=tol, rtol=tol)
                torch.testing.assert_close(lse, base_lse, atol=tol, rtol=tol)
        finally:
            tk.MIN_SHARE = saved


def check_attention_fp8(device="cpu", dtype=torch.float32, G=2, D=16, B=4, Hkv=2,
                        kv_lens=(37, 0, 5, 64, 3), q_lens=(1, 2, 5, 1, 1), splits=(1, 3, None)):
    """An FP8 cache dequantized in the kernel equals attention over the dequantized values,
    decode rows and multi-row (prefix) requests, with and without KV splits."""
    for lens in (q_lens, [1] * len(kv_lens)):
        case = make_attention_case(list(kv_lens), list(lens), Hkv, G, D, B, dtype, device, seed=4)
        fp8, ref = fp8_case(case, seed=4)
        for s in splits:
            _check_attention(fp8, num_kv_splits=s, dtype=dtype, ref_case=ref)


def check_attention_shapes(device="cpu", dtype=torch.float32):
    """Head dim not a power of two, block sizes 1 and 16, G = 3."""
    for D, B, G, Hkv in [(24, 1, 1, 2), (16, 16, 3, 1), (32, 16, 4, 1)]:
        case = make_attention_case([18, 3, 33], [2, 1, 4], Hkv, G, D, B, dtype, device, seed=D + B)
        _check_attention(case, dtype=dtype)


def check_merge(device="cpu", dtype=torch.float32, T=9, H=3, D=24):
    tk = _kernels()
    gen = torch.Generator().manual_seed(5)
    po = _randn(T, H + 1, D, dtype=dtype, device=device, gen=gen)[:, :H]  # strided
    so = _randn(T, H, D, dtype=dtype, device=device, gen=gen)
    pl = _randn(T, H, dtype=torch.float32, device=device, gen=gen) * 3
    sl = _randn(T, H, dtype=torch.float32, device=device, gen=gen) * 3
    pl[0, 0], sl[0, 0] = -math.inf, -math.inf  # both empty: out 0, lse -inf
    pl[1, 1] = -math.inf
    sl[2, 2] = math.nan
    pl[3, 0] = math.inf
    sl[4, 1], pl[4, 1] = math.nan, math.inf
    po[1, 1] = math.nan  # an empty state's output must not leak NaN
    out = torch.empty(T, H, D, dtype=dtype, device=device)
    out_lse = torch.empty(T, H, dtype=torch.float32, device=device)
    tk.merge_attn_states_triton(out, po, pl, so, sl, out_lse)
    ref_out, ref_lse = ref_merge(po.cpu(), pl.cpu(), so.cpu(), sl.cpu())
    tol = _tol(dtype)
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=tol, rtol=tol)
    assert torch.equal(out_lse.cpu() == -math.inf, ref_lse == -math.inf)
    fin = ref_lse != -math.inf
    torch.testing.assert_close(out_lse.double().cpu()[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)
    out2 = torch.empty_like(out)
    tk.merge_attn_states_triton(out2, po, pl, so, sl)  # without output_lse
    assert torch.equal(out2, out)


def check_merge_partials(device="cpu", dtype=torch.float32, S=4, T=9, H=3, D=24, packed_dtype=None):
    """The CP merge kernel against the torch reference: packed [S, T, H, D + 1] partials with
    empty (-inf), NaN and +inf LSEs, a NaN output under a weight-0 LSE, a row empty everywhere, a
    row whose later half of splits is empty (a short request's: never written, here NaN)."""
    from longserve.attention.cp_attention import merge_partials, pack_partial
    gen = torch.Generator().manual_seed(6)
    parts = _randn(S, T, H, D + 1, dtype=torch.float32, device=device, gen=gen)
    parts[..., -1] *= 3
    parts[:, 0, 0, -1] = -math.inf
    parts[1, 1, :, -1], parts[-1, 2, 1, -1], parts[0, 3, 2, -1] = -math.inf, math.nan, math.inf
    parts[1, 1, 0, 0] = math.nan
    parts[S // 2:, 4, :, -1], parts[S // 2:, 4, :, :-1] = -math.inf, math.nan
    if packed_dtype is not None:  # a prefix's exchange: out in half precision, the LSE's bytes
        parts = torch.stack([pack_partial(p[..., :-1], p[..., -1], packed_dtype) for p in parts])
    out, lse = _kernels().merge_partials_triton(parts, dtype)
    ref_out, ref_lse = merge_partials(parts.cpu(), torch.float64)
    tol = _tol(dtype)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=tol, rtol=tol)
    assert torch.equal(lse.cpu() == -math.inf, ref_lse == -math.inf)
    fin = ref_lse != -math.inf
    torch.testing.assert_close(lse.cpu()[fin], ref_lse[fin], atol=1e-5, rtol=1e-5)


def check_attention_packed(device="cpu", dtype=torch.bfloat16, G=8, D=16, B=4, Hkv=1):
    """out / lse given as views of one [T, Hq, D + 1] float32 tensor (the CP exchange's
    layout), whole and with a request cut into items (its merge writes there too): the same
    values as the kernel's own buffers."""
    tk = _kernels()
    case = make_attention_case([37, 0, 9], [1, 1, 1], Hkv, G, D, B, dtype, device, seed=8)
    saved = tk.MIN_SHARE
    try:
        for budget, tk.MIN_SHARE in ((1, saved), (3, 1)):  # (3, 1): 37 tokens in two shares
            out, lse = tk.paged_attention_lse(**case, num_kv_splits=budget)
            packed = torch.full((3, Hkv * G, D + 1), math.nan, device=device)
            got = tk.paged_attention_lse(**case, num_kv_splits=budget, out=packed[..., :-1], lse=packed[..., -1])
            assert got[0].data_ptr() == packed.data_ptr()
            torch.testing.assert_close(packed[..., :-1], out.float(), atol=_tol(dtype), rtol=_tol(dtype))
            assert torch.equal(packed[..., -1], lse)
    finally:
        tk.MIN_SHARE = saved


def check_bitmask(device="cpu", dtype=torch.float32, N=7, V=3000, covered=2500):
    """The grammar bitmask kernel refuses what the torch version refuses: the ids whose bit is
    clear, and every id past the mask's words; rows outside `rows` are untouched."""
    from longserve.worker.bitmask_kernel import apply_bitmask_triton
    from longserve.worker.sampler import apply_token_bitmask
    g = torch.Generator().manual_seed(V)
    rows = [0, 3, 5]
    words = torch.randint(-2 ** 31, 2 ** 31 - 1, (len(rows), -(-covered // 32)), generator=g,
                          dtype=torch.int64).to(torch.int32)
    logits = torch.randn(N, V, generator=g).to(dtype)
    want = logits.clone()
    apply_token_bitmask(want, words, rows)  # the torch version (CPU)
    got = logits.to(device)
    apply_bitmask_triton(got, words, rows)
    assert torch.equal(got.cpu(), want)
    assert bool(torch.isinf(want[rows, 32 * words.shape[1]:]).all()) and torch.equal(want[1], logits[1])


def check_compile_variants():
    """The warm-up of the paged kernel's tile variants runs each (query buckets, each with one
    KV split and with two) on a real cache layout and leaves the cache as it was."""
    from longserve.attention.triton_kernels import compile_attention_variants
    kv = torch.randn(2, 4, 16, 2, 32)
    before = kv.clone()
    assert compile_attention_variants(8, kv[0], kv[1], None, torch.float32, 64, 8) >= 3
    assert torch.equal(kv, before)


@settings(max_examples=200, deadline=None)
@given(T=st.integers(1, 8192), Hkv=st.integers(1, 16), block_q=st.sampled_from([2, 8, 64]),
       context=st.integers(1, 1 << 21))
def test_prefix_splits_are_few_and_fit_their_buffer(T, Hkv, block_q, context):
    """A power of two in [1, 256] of >= 256 tokens each; the partials within their budget unless one."""
    from longserve.attention import triton_kernels as tk
    s = tk._auto_splits(T, 4 * Hkv, Hkv, 128, block_q, context, torch.device("cpu"))
    assert 1 <= s <= 256 and s & (s - 1) == 0
    assert s == 1 or (s * T * 4 * Hkv * 129 * 4 <= tk.SPLIT_BUFFER_BYTES and s * 256 <= 2 * context)


def test_the_decode_budget_fills_the_gpu_and_its_buffer_at_most(monkeypatch):
    """On a 132-SM GPU: ~4 programs an SM for few requests, a request's worth an item for many
    (shares near the mean context); the partials within SPLIT_BUFFER_BYTES."""
    from longserve.attention import triton_kernels as tk
    monkeypatch.setattr(tk, "_num_sms", lambda device: 132)
    dev = torch.device("cuda")
    assert tk._decode_budget(1, 32, 8, 128, dev) == 66  # Llama-3-8B at batch 1: 66 x 8 programs
    assert tk._decode_budget(33, 8, 2, 128, dev) == 264  # a tp=4 rank
    assert tk._decode_budget(200, 32, 8, 128, dev) == 200
    assert tk._decode_budget(1000, 32, 8, 128, dev) == 1000
    for R, hq in ((2000, 64), (4000, 128), (64, 32)):
        budget = tk._decode_budget(R, hq, 8, 128, dev)
        assert budget == 1 or (R + budget) * hq * 129 * 4 <= tk.SPLIT_BUFFER_BYTES


def test_the_warm_up_runs_every_request_bucket_with_and_without_splits(monkeypatch):
    """The variants a step can pick differ in BLOCK_R (the request bucket: one request and a
    full batch past 256 share their tiles, not it) and, for prefixes, in the output's type (float32
    split partials): the warm-up runs each (it launches nothing here)."""
    from longserve.attention import triton_kernels as tk
    seen = set()

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kw):  # args[6]: where it writes (float32: a prefix's split partials)
                seen.add((kw["BLOCK_Q"] > 1, kw["BLOCK_R"], args[6].dtype, kw["ITEMS"]))
            return launch
    monkeypatch.setattr(tk, "_paged_attn_kernel", Kernel())
    monkeypatch.setattr(tk, "plan_decode", lambda kv_lens, *args: (1, None, None))
    monkeypatch.setattr(tk, "_merge_kv_splits", lambda *args, **kw: None)
    monkeypatch.setattr(tk, "merge_attn_states_triton", lambda *args, **kw: None)
    kv = torch.zeros(2, 4, 16, 2, 32, dtype=torch.bfloat16)
    tk.compile_attention_variants(8, kv[0], kv[1], None, torch.bfloat16, 8192, 300)
    for dtype in (torch.bfloat16, torch.float32):
        assert (True, 256, dtype, False) in seen
    assert {(False, 256, torch.bfloat16, True), (False, 512, torch.bfloat16, True)} <= seen


def test_kernel_first_launches_load_one_at_a_time(monkeypatch):
    """The warm-up compiles in threads; a kernel's first launch then loads its launcher and binary
    (CompiledKernel._init_handles), which Triton does not guard: those loads never overlap."""
    import threading
    import time

    from triton.compiler.compiler import CompiledKernel
    tk = _kernels()
    inside, most = [0], [0]

    def load(self):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        time.sleep(0.01)  # (a load takes a while: another thread would enter now)
        inside[0] -= 1
    monkeypatch.setattr(CompiledKernel, "_init_handles", load)
    tk._serialize_launcher_loads()
    tk._serialize_launcher_loads()  # (idempotent: one lock, not two wrappers)
    threads = [threading.Thread(target=CompiledKernel._init_handles, args=(None,)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1


def check_decode_items(device="cpu", examples=15):
    """Decode's work items (_plan_items_kernel), for all batches: each request's n >= 1 consecutive
    items have one share (whole tiles) and cover its KV; <= R + budget items in all; no share past
    two chunks and a tile, chunk = max(sum / budget, min_share): a long request beside short ones is
    cut; items [R, 2] holds each request's (first item, n). Several programs when BLOCK_I is small."""
    tk = _kernels()

    @settings(max_examples=examples, deadline=None, database=None)
    @given(kv=st.lists(st.integers(0, 40000), min_size=1, max_size=12), budget=st.integers(1, 64),
           min_share=st.integers(1, 512), block_i=st.sampled_from([4, 32]))
    def rule(kv, budget, min_share, block_i):
        R, tile = len(kv), 16
        plan = torch.full((R + budget, 4), -7, dtype=torch.int32, device=device)
        heads = torch.full((R, 2), -7, dtype=torch.int32, device=device)
        tk._plan_items_kernel[(triton.cdiv(R + budget, block_i),)](
            torch.tensor(kv, dtype=torch.int32, device=device), plan, heads, R, budget, min_share,
            ALIGN=tile, BLOCK_R=16, BLOCK_I=block_i)
        items = {}
        for pid, (req, split, n, share) in enumerate(plan.cpu().tolist()):
            if req < R:  # (else a spare program: it returns)
                assert 0 <= split < n
                items.setdefault(req, set()).add((pid, pid - split, n, share))
        assert sorted(items) == list(range(R)) and sum(len(v) for v in items.values()) <= R + budget
        chunk = max(-(-sum(kv) // budget), min_share)
        for req, mine in items.items():
            first, n, share = min(mine)[1:]
            assert len(mine) == n and {m[1:] for m in mine} == {(first, n, share)}
            assert share % tile == 0 and n * share >= kv[req] and share < 2 * chunk + tile
            assert heads[req].tolist() == [first, n]
        if max(kv) >= 4 * chunk:
            assert len(items[kv.index(max(kv))]) >= 4
    rule()


INTERPRETER_CHECKS = {
    "store_kv_fp32": lambda: check_store_kv(),
    "store_kv_bf16": lambda: check_store_kv(dtype=torch.bfloat16),
    "store_kv_fp8": lambda: check_store_kv(fp8=True),
    "store_kv_fp8_from_bf16": lambda: check_store_kv(dtype=torch.bfloat16, fp8=True),
    "attention_fp8": lambda: check_attention_fp8(),
    "attention_fp8_bf16_g4": lambda: check_attention_fp8(dtype=torch.bfloat16, G=4, B=16),
    "decode_g1": lambda: check_attention_decode(1),
    "decode_g2": lambda: check_attention_decode(2),
    "decode_g4": lambda: check_attention_decode(4),
    "decode_bf16": lambda: check_attention_decode(2, dtype=torch.bfloat16, B=16),
    "multirow_g1": lambda: check_attention_multirow(1),
    "multirow_g2": lambda: check_attention_multirow(2),
    "multirow_g4": lambda: check_attention_multirow(4),
    "multirow_fp16": lambda: check_attention_multirow(4, dtype=torch.float16, B=16),
    "splits": lambda: check_attention_splits(),
    "decode_items": lambda: check_decode_items(),
    "shapes": lambda: check_attention_shapes(),
    "merge_fp32": lambda: check_merge(),
    "merge_bf16": lambda: check_merge(dtype=torch.bfloat16),
    "merge_partials": lambda: check_merge_partials(),
    "merge_partials_bf16_s2": lambda: check_merge_partials(dtype=torch.bfloat16, S=2),
    "merge_partials_packed_bf16": lambda: check_merge_partials(dtype=torch.bfloat16, D=24,
                                                               packed_dtype=torch.bfloat16),
    "merge_partials_d72_s70": lambda: check_merge_partials(S=70, D=72),  # D slices, S chunks
    "attention_packed": lambda: check_attention_packed(),
    "bitmask": lambda: check_bitmask(),
    "compile_variants": lambda: check_compile_variants(),
    "bitmask_bf16": lambda: check_bitmask(dtype=torch.bfloat16, V=1000, covered=1000),
}


def _interpreter_can_loop():
    """Triton 3.6's interpreter cannot range() over run-time scalars (its scalars are
    1-element arrays, not 0-d); the KV loop needs that. 3.9's can."""
    import triton
    import triton.language as tl

    @triton.jit
    def _loop(x_ptr, n):
        for i in range(0, n, 2):
            tl.store(x_ptr + i, i)

    try:
        _loop[(1,)](torch.zeros(4, dtype=torch.int32), 4)
        return True
    except Exception as e:  # TypeError('only 0-dimensional arrays can be converted ...'), wrapped
        if "0-dimensional" not in str(e):
            raise
        return False


def _run_all(checks):
    if not _interpreter_can_loop():
        return {name: "skip: this Triton's interpreter cannot loop over run-time bounds" for name in checks}
    results = {}
    for name, check in checks.items():
        try:
            check()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    return results


@functools.lru_cache(maxsize=None)
def _interpreter_results():
    """Run every interpreter check once, in a child process started with TRITON_INTERPRET=1."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULTS "):
            return json.loads(line[len("RESULTS "):])
    raise RuntimeError(f"interpreter child failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")


@pytest.mark.parametrize("name", list(INTERPRETER_CHECKS))
def test_interpreter(name):
    if INTERPRET:  # this process already interprets: run here
        if not _interpreter_can_loop():
            pytest.skip("this Triton's interpreter cannot loop over run-time bounds")
        INTERPRETER_CHECKS[name]()
        return
    result = _interpreter_results()[name]
    if result.startswith("skip: "):
        pytest.skip(result[len("skip: "):])
    assert result == "ok", result


# ----------------------------------------------------------------------------------------
# GPU: the compiled kernels, larger shapes, bf16 and fp32
# ----------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
DTYPES = [torch.float32, torch.bfloat16]


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_store_kv(dtype):
    check_store_kv("cuda", dtype, T=300, Hkv=8, D=128, B=16, N=40)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("B", [16, 64])
def test_gpu_decode(dtype, G, B):
    kv_lens = (1000, 0, 1, 4097, 300, 17, 2048, 64)
    check_attention_decode(G, "cuda", dtype, D=128, B=B, Hkv=4, kv_lens=kv_lens)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [1, 4, 7])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_multirow(dtype, G, D):
    check_attention_multirow(G, "cuda", dtype, D=D, B=16, Hkv=2,
                             kv_lens=(700, 0, 2100, 33, 64), q_lens=(100, 3, 257, 0, 1))


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_splits(dtype):
    check_attention_splits("cuda", dtype, G=4, D=128, B=16, Hkv=2,
                           kv_lens=(20000, 0, 129, 5000), q_lens=(1, 3, 16, 1), splits=(1, 4, 17, 64, 300, None))


@gpu
def test_gpu_decode_items():
    check_decode_items("cuda", examples=40)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_store_kv_fp8(dtype):
    check_store_kv("cuda", dtype, T=300, Hkv=8, D=128, B=16, N=40, fp8=True)


@gpu
@pytest.mark.parametrize("G", [1, 4, 8])
def test_gpu_attention_fp8(G):
    check_attention_fp8("cuda", torch.bfloat16, G=G, D=128, B=16, Hkv=2,
                        kv_lens=(20000, 0, 129, 5000, 1), q_lens=(1, 3, 160, 1, 1), splits=(1, 7, None))


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_shapes(dtype):
    for D, B, G, Hkv in [(80, 16, 2, 2), (96, 32, 4, 2), (256, 16, 2, 1), (32, 1, 1, 2), (128, 128, 8, 1)]:
        case = make_attention_case([300, 0, 1030], [1, 5, 40], Hkv, G, D, B, dtype, "cuda", seed=D + B)
        _check_attention(case, dtype=dtype)


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_merge(dtype):
    check_merge("cuda", dtype, T=64, H=8, D=128)
    for S in (2, 4, 8):
        check_merge_partials("cuda", dtype, S=S, T=64, H=8, D=128)
        check_merge_partials("cuda", dtype, S=S, T=64, H=8, D=128, packed_dtype=dtype)


@gpu
def test_gpu_cuda_graph():
    """Captured once, replayed with new kv_lens / block tables / q: no host reads of values."""
    tk = _kernels()
    dtype = torch.bfloat16
    case = make_attention_case([900, 5, 0, 3000], [1, 1, 1, 1], 2, 4, 128, 16, dtype, "cuda", seed=7)
    static = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in case.items()}
    static["q"] = case["q"].contiguous()
    tk.paged_attention_lse(**static)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = tk.paged_attention_lse(**static)
    for lens in ([900, 5, 0, 3000], [17, 0, 2999, 1]):
        static["kv_lens"].copy_(torch.tensor(lens, dtype=torch.int32))
        static["q"].normal_()
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = ref_paged_attention(**{k: v for k, v in static.items() if k != "max_query_len"})
        torch.testing.assert_close(out.double().cpu(), ref_out, atol=2e-2, rtol=2e-2)
        fin = ref_lse != -math.inf
        torch.testing.assert_close(lse.double().cpu()[fin], ref_lse[fin], atol=2e-2, rtol=2e-2)
        assert (lse.cpu()[~fin] == -math.inf).all()


@gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_bitmask(dtype):
    check_bitmask("cuda", dtype, N=64, V=151936, covered=485)


if __name__ == "__main__":  # the interpreter child of _interpreter_results
    assert INTERPRET, "run with TRITON_INTERPRET=1"
    print("RESULTS " + json.dumps(_run_all(INTERPRETER_CHECKS)), flush=True)
