"""GGUF tensor dequantization in numpy: raw GGML blocks (layouts of ggml's `ggml-common.h`) ->
float32, in the `gguf` package's order of operations, so equal bit for bit (NaN payloads too)."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

QK_K = 256  # weights per k-quant super-block
F32 = np.float32


def _f16(b: np.ndarray) -> np.ndarray:
    """[n, 2k] bytes -> [n, k] float32 from little-endian float16."""
    return np.ascontiguousarray(b).view(np.float16).astype(F32)


def _nibbles(qs: np.ndarray, group: int) -> np.ndarray:
    """[n, m] packed bytes -> [n, m/group, 2, group]: low nibbles, then high nibbles, of each
    run of `group` bytes (ggml keeps element j in the low and j + group in the high half)."""
    qs = qs.reshape(qs.shape[0], -1, 1, group)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2)


def dequant_q8_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, :2])  # [n, 1]
    return np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(F32) * d


def dequant_q4_0(b: np.ndarray) -> np.ndarray:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], 32).astype(np.int8) - np.int8(8)
    return d * q.astype(F32)


def dequant_q4_1(b: np.ndarray) -> np.ndarray:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], 32).astype(F32)
    return d * q + m


def _q4_k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (the first four in bytes 0-7, the
    high two bits of the last four in the top bits of bytes 0-7, their low four in 8-11)."""
    s = s.reshape(s.shape[0], 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def dequant_q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _q4_k_scales(b[:, 4:16])
    scale = (d * sc.astype(F32)).reshape(n, 8, 1)
    offset = (dmin * mn.astype(F32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 16:], 32).reshape(n, 8, 32).astype(F32)
    return (scale * q - offset).reshape(n, QK_K)


def dequant_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql, qh = b[:, :128], b[:, 128:192]
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(F32)
    scale = (_f16(b[:, 208:210]) * scales).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)  # 4-bit low parts
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)  # 2-bit high parts
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (scale * q.reshape(n, 16, 16).astype(F32)).reshape(n, QK_K)


def dequant_bf16(b: np.ndarray) -> np.ndarray:
    # widen the bits (a float conversion might quiet a NaN's payload)
    return (np.ascontiguousarray(b).view(np.int16).astype(np.int32) << 16).view(F32)


def dequant_f16(b: np.ndarray) -> np.ndarray:
    return _f16(b)


def dequant_f32(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(F32)


DEQUANTIZERS = {
    Q.F32: dequant_f32, Q.F16: dequant_f16, Q.BF16: dequant_bf16, Q.Q8_0: dequant_q8_0,
    Q.Q4_0: dequant_q4_0, Q.Q4_1: dequant_q4_1, Q.Q4_K: dequant_q4_k, Q.Q6_K: dequant_q6_k,
}
SUPPORTED_TYPES = tuple(t.name for t in DEQUANTIZERS)


def dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes of one tensor (any numpy view of them) -> float32 tensor of `shape`
    (torch order: the GGUF shape reversed)."""
    qtype = Q(qtype)
    fn = DEQUANTIZERS.get(qtype)
    if fn is None:
        raise ValueError(f"unsupported GGUF tensor type {qtype.name} "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = int(np.prod(shape))
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if numel % block_size or data.size != numel // block_size * type_size:
        raise ValueError(f"{data.size} bytes of {qtype.name} do not hold a tensor of shape {shape}")
    out = fn(data.reshape(-1, type_size))
    return torch.from_numpy(np.require(out, requirements=["C", "W"])).reshape(shape)
