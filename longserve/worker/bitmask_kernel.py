"""Structured outputs: a grammar bitmask applied to the logits in one Triton launch (CUDA, or CPU
under TRITON_INTERPRET=1); sampler.py's torch version takes ~10 launches on the critical path."""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from longserve.host_to_device import to_device

BLOCK = 1024


@triton.jit
def _bitmask_kernel(logits_ptr, mask_ptr, stride_l, stride_m, vocab, covered, BLOCK: tl.constexpr):
    # mask row i: [logits row, word 0, word 1, ...]; bit j of word w allows id 32 w + j; ids
    # past `covered` (the ids the grammar's tokenizer has) are refused
    i = tl.program_id(0)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(mask_ptr + i * stride_m).to(tl.int64)
    words = tl.load(mask_ptr + i * stride_m + 1 + ids // 32, mask=ids < covered, other=0)
    refused = (ids < vocab) & (((words >> (ids % 32)) & 1) == 0)
    ninf = tl.full([BLOCK], float("-inf"), tl.float32).to(logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_l + ids, ninf, mask=refused)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """logits [N, V] in place; bitmask int32 [R, W] (host) for `rows`: one upload, one launch."""
    r, w = bitmask.shape
    packed = np.empty((r, w + 1), np.int32)
    packed[:, 0], packed[:, 1:] = rows, bitmask.numpy()
    mask = to_device(packed, logits.device)
    vocab = logits.shape[-1]
    _bitmask_kernel[(r, triton.cdiv(vocab, BLOCK))](logits, mask, logits.stride(0), w + 1, vocab,
                                                    min(32 * w, vocab), BLOCK=BLOCK)
