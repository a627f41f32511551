"""Host arrays to device tensors without waiting for the device.

A blocking host-to-device copy (`tensor.to("cuda")`, `torch.tensor(..., device="cuda")`)
waits for every kernel queued before it, and so does a non-blocking one from pageable
memory when the driver stages it: either would make the host wait for step N before it
can finish preparing step N+1, which undoes asynchronous scheduling. So a step's inputs go
through pinned memory and copy non-blocking. The pinned buffer comes from PyTorch's
caching host allocator, which records the copy's event on it and reuses the buffer only
after the copy ran; on the CPU the array is wrapped, not copied.
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)
