"""The fused Triton elementwise kernels equal the torch code they replace (HF's rounding).

On CPU they run under the Triton interpreter in a child process (TRITON_INTERPRET must be
set before triton.jit runs); with CUDA also directly on the GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from interpreter_utils import speed_up_interpreter

speed_up_interpreter()
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def check_all(device: str) -> None:
    from longserve.models import fused_ops as ops
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        # bf16: the same roundings, so within one unit in the last place (float32 sums in
        # another order can tip a rounding); the CPU interpreter converts float32 to bf16 by
        # its own rule, which can add up to two units over a chain of roundings
        tol = 1e-6 if dtype == torch.float32 else (8e-3 if device == "cuda" else 1.6e-2)
        atol = tol if device == "cuda" or dtype == torch.float32 else 8e-2
        x = torch.randn(37, 96, generator=g).to(device, dtype)
        res = torch.randn(37, 96, generator=g).to(device, dtype)
        w = (1 + 0.1 * torch.randn(96, generator=g)).to(device, dtype)
        torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ops.rms_norm_torch(x, w, 1e-6),
                                   atol=tol, rtol=tol)
        out, new_res = ops.rms_norm(x, w, 1e-6, res)
        ref_out, ref_res = ops.rms_norm_torch(x, w, 1e-6, res)
        torch.testing.assert_close(new_res, ref_res, atol=tol, rtol=tol)
        torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)

        heads = torch.randn(37, 5, 64, generator=g).to(device, dtype)
        pos = torch.randint(0, 5000, (37,), generator=g).float()[:, None]
        freqs = pos * (1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64))[None, :]
        cos, sin = freqs.cos().to(device), freqs.sin().to(device)
        q, k = heads[:, :3], heads[:, 3:4]  # views of some heads, as q/k are views of the fused qkv
        got = ops.rotary(q, k, cos, sin)
        for x, y in zip(got, (q, k)):
            assert x.is_contiguous()
            torch.testing.assert_close(x, ops.rotary_torch(y, cos, sin), atol=tol or 1e-2, rtol=tol or 1e-2)
        qw, kw = ((1 + 0.1 * torch.randn(64, generator=g)).to(device, dtype) for _ in range(2))
        got = ops.rotary(q, k, cos, sin, (qw, kw, 1e-6))
        for x, y, w in zip(got, (q, k), (qw, kw)):  # each its own norm weight
            torch.testing.assert_close(x, ops.rotary_torch(ops.rms_norm_torch(y, w, 1e-6), cos, sin),
                                       atol=atol, rtol=tol)
        static = [torch.zeros(40, h, 64, device=device, dtype=dtype) for h in (3, 1)]  # bigger buffers
        outs = ops.rotary(q, k, cos, sin, (qw, kw, 1e-6), out=(static[0][:37], static[1][:37]))
        assert outs[0].data_ptr() == static[0].data_ptr() and not static[0][37:].any()
        assert all(torch.equal(a, b) for a, b in zip(outs, got))
        # the K/V store fused in: a token's rotated k and its v in its slot, bit-equal to what the
        # kernel returns; slot -1 (padding, another CP rank's token) and other slots untouched
        v = heads[:, 4:5]
        cache = torch.full((2, 8, 16, 1, 64), 7.0, device=device, dtype=dtype)  # [2, N, B, Hk, D]
        slots = torch.randperm(128, generator=g)[:37].to(device)
        slots[::5] = -1
        outs = ops.rotary(q, k, cos, sin, (qw, kw, 1e-6), store=(v, cache[0], cache[1], slots))
        assert all(torch.equal(a, b) for a, b in zip(outs, got))
        flat, kept = cache.view(2, 128, 64), slots >= 0
        assert torch.equal(flat[0, slots[kept]], got[1][kept, 0]) and torch.equal(flat[1, slots[kept]], v[kept, 0])
        untouched = torch.ones(128, dtype=torch.bool, device=device)
        untouched[slots[kept]] = False
        assert (flat[:, untouched] == 7.0).all()

        gu = torch.randn(37, 2 * 80, generator=g).to(device, dtype)
        torch.testing.assert_close(ops.silu_and_mul(gu), ops.silu_and_mul_torch(gu),
                                   atol=tol or 1e-2, rtol=tol or 1e-2)
    empty = torch.empty(0, 96, device=device)
    assert ops.rms_norm(empty, torch.ones(96, device=device), 1e-6).shape == (0, 96)
    # the linears' routing (one bf16 row of width 256: the GEMV on CUDA) gives F.linear's values
    x1 = torch.randn(1, 256, generator=g).to(device, torch.bfloat16)
    w1 = torch.randn(96, 256, generator=g).to(device, torch.bfloat16)
    torch.testing.assert_close(ops.linear(x1, w1), F.linear(x1, w1), atol=0.25, rtol=8e-3)
    torch.testing.assert_close(ops.linear_silu_and_mul(x1, w1), ops.silu_and_mul(F.linear(x1, w1)),
                               atol=0.5, rtol=1.6e-2)
    check_gemv()


@settings(max_examples=12 if os.environ.get("TRITON_INTERPRET") == "1" else 60, deadline=None)
@given(rows=st.integers(0, 16), n=st.integers(1, 150), k_tiles=st.integers(1, 4),
       block=st.sampled_from([(16, 64, 4, 2), (32, 128, 4, 4), (4, 1024, 8, 4), None]), bias=st.booleans(),
       bf16=st.booleans(), seed=st.integers(0, 2**31))
@example(rows=1, n=97, k_tiles=3, block=(16, 64, 4, 2), bias=True, bf16=True, seed=0)
@example(rows=5, n=33, k_tiles=2, block=None, bias=False, bf16=False, seed=1)
@example(rows=1, n=10, k_tiles=2, block=(4, 1024, 8, 4), bias=False, bf16=True, seed=2)
def check_gemv(rows, n, k_tiles, block, bias, bf16, seed):
    """The decode GEMV equals x W^T + b summed in float32 (one row: elementwise; 2-16 rows: the
    dot), for output sizes that are no multiple of the tile, 0-16 rows of a strided x; one row
    with SiLU-and-mul fused equals the two steps."""
    from longserve.models.gemv_kernel import gemv_triton
    device = "cuda" if HAS_CUDA else "cpu"
    g = torch.Generator().manual_seed(seed)
    block = None if block and rows > 1 and block[0] < 16 else block  # the dot: 16+ columns
    k = 64 * k_tiles if block is None else block[1] * k_tiles
    bf16 = bf16 and (device == "cuda" or rows <= 1)  # the interpreter's bf16 dot is wrong (3.9)
    dtype = torch.bfloat16 if bf16 else torch.float32
    x = torch.randn(rows, 2 * k, generator=g).to(device, dtype)[:, :k]  # rows apart in memory
    w = torch.randn(n, k, generator=g).to(device, dtype)
    b = torch.randn(n, generator=g).to(device, dtype) if bias else None
    y = gemv_triton(x, w, b, block)
    ref = x.double() @ w.double().T + (b.double() if bias else 0)
    assert y.shape == (rows, n) and y.dtype == dtype
    tol = 1e-2 if bf16 else 1e-4  # bf16: the output's rounding; float32: the sums' order
    torch.testing.assert_close(y.double(), ref, atol=tol * k ** 0.5, rtol=tol)
    if rows == 1:  # the MLP's gate-up with SiLU-and-mul in the kernel, rounded as silu_and_mul
        from longserve.models.fused_ops import silu_and_mul_torch
        gate_up = torch.cat([w, torch.randn(n, k, generator=g).to(device, dtype)])
        fused = gemv_triton(x, gate_up, config=block, silu_and_mul=True)
        two = 8e-3 if device == "cuda" else 2e-2  # the interpreter rounds to bf16 its own way
        torch.testing.assert_close(fused, silu_and_mul_torch(gemv_triton(x, gate_up, config=block)),
                                   atol=two if bf16 else tol, rtol=two if bf16 else tol)


@pytest.mark.parametrize("rows", [0, 1, 3, 17])
def test_linears_off_cuda_stay_on_torch(rows):
    """The GEMV takes only CUDA bf16 / fp16: the CPU's linears (a vocabulary-wide LM head
    included, in any dtype) are F.linear's exactly."""
    from longserve.models import fused_ops as ops
    g = torch.Generator().manual_seed(rows)
    for dtype in (torch.float32, torch.bfloat16):
        x, w = torch.randn(rows, 256, generator=g).to(dtype), torch.randn(32768, 256, generator=g).to(dtype)
        assert torch.equal(ops.linear(x, w), F.linear(x, w))
        assert torch.equal(ops.linear_silu_and_mul(x, w), ops.silu_and_mul_torch(F.linear(x, w)))


def test_fused_ops_under_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        check_all("cpu")
        return
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "tests"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", "import test_fused_ops as t; t.check_all('cpu')"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fused_ops_gpu():
    check_all("cuda")
