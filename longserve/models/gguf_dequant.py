"""GGUF tensor dequantization: raw GGML blocks -> float32, by the `gguf` package's own
reference dequantizer (numpy), for the types the loader is tested on."""
from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q, quants

SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")


def dequantize(raw: np.ndarray, qtype: Q, shape: tuple[int, ...]) -> torch.Tensor:
    """Raw bytes of one tensor (any numpy view) -> float32 tensor of `shape` (torch order)."""
    qtype = Q(qtype)
    if qtype.name not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported GGUF tensor type {qtype.name} "
                         f"(supported: {', '.join(SUPPORTED_TYPES)})")
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    numel = int(np.prod(shape))
    data = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if numel % block_size or data.size != numel // block_size * type_size:
        raise ValueError(f"{data.size} bytes of {qtype.name} do not hold a tensor of shape {shape}")
    with np.errstate(all="ignore"):  # NaN / inf scales stay as gguf gives them
        out = quants.dequantize(data, qtype)
    return torch.from_numpy(np.require(out, np.float32, ["C", "W"])).reshape(shape)
