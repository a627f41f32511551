"""The FP8 KV cache in torch (reference and CPU path): a float8_e4m3fn cache holds k / s and v / s,
s = `Attention.kv_scale` [2, Hkv] float32 (models/kv_scales.py); values past e4m3's range
saturate, not NaN. With kv_scale None the cache holds the model's dtype as is."""
from __future__ import annotations

import torch

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """x [T, H, D] -> the cache's dtype; scale [H] (None: a plain cast)."""
    return x.to(dtype) if scale is None else (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows x [T, H, D] -> dtype; scale [H] (None: a plain cast)."""
    return x.to(dtype) if scale is None else (x.float() * scale[:, None]).to(dtype)
