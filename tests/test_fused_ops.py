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
        strided = heads[:, 1:4]  # a view of some heads, as q/k are views of the fused qkv
        torch.testing.assert_close(ops.rotary(strided, cos, sin), ops.rotary_torch(strided, cos, sin),
                                   atol=tol or 1e-2, rtol=tol or 1e-2)
        hw = (1 + 0.1 * torch.randn(64, generator=g)).to(device, dtype)
        normed = ops.rotary_torch(ops.rms_norm_torch(strided, hw, 1e-6), cos, sin)
        torch.testing.assert_close(ops.rotary(strided, cos, sin, hw, 1e-6), normed, atol=atol, rtol=tol)
        static = torch.zeros(40, 3, 64, device=device, dtype=dtype)  # rows of a bigger buffer
        got = ops.rotary(strided, cos, sin, hw, 1e-6, out=static[:37])
        assert got.data_ptr() == static.data_ptr() and not static[37:].any()
        assert torch.equal(static[:37], ops.rotary(strided, cos, sin, hw, 1e-6))

        gu = torch.randn(37, 2 * 80, generator=g).to(device, dtype)
        torch.testing.assert_close(ops.silu_and_mul(gu), ops.silu_and_mul_torch(gu),
                                   atol=tol or 1e-2, rtol=tol or 1e-2)
    empty = torch.empty(0, 96, device=device)
    assert ops.rms_norm(empty, torch.ones(96, device=device), 1e-6).shape == (0, 96)


def test_fused_ops_under_interpreter():
    if os.environ.get("TRITON_INTERPRET") == "1":
        check_all("cpu")
        return
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", "import tests.test_fused_ops as t; t.check_all('cpu')"],
                          env=env, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_fused_ops_gpu():
    check_all("cuda")
