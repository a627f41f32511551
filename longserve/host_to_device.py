"""Host arrays to device tensors without waiting for the device: pinned memory (PyTorch's caching host
allocator) copied non-blocking, where a pageable copy would wait for step N; on the CPU wrapped, not copied."""
from __future__ import annotations

import numpy as np
import torch


def to_device(a: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


def to_device_all(arrays: list, device: torch.device | str) -> list[torch.Tensor]:
    """Several host arrays through one pinned buffer and one copy. Each `to_device` costs a
    pinned allocation, a copy call and an event, a share of a host-bound decode step's time."""
    ts = [to_device(a, "cpu") for a in arrays]
    if torch.device(device).type != "cuda":
        return ts
    host, starts = pack(ts, pin=True)
    return unpack(host.to(device, non_blocking=True), ts, starts)


def pack(ts: list[torch.Tensor], pin: bool) -> tuple[torch.Tensor, np.ndarray]:
    """The tensors' bytes end to end in one uint8 buffer, each from a 16-byte aligned start."""
    starts = np.concatenate(([0], np.cumsum([-(-t.nbytes // 16) * 16 for t in ts])))
    buf = torch.empty(int(starts[-1]), dtype=torch.uint8, pin_memory=pin)
    raw = buf.numpy()
    for t, start in zip(ts, starts):
        a = t.numpy()  # (any strides: a size-1 array may have stride 0)
        raw[start:start + t.nbytes].view(a.dtype)[:] = a.reshape(-1)
    return buf, starts


def unpack(buf: torch.Tensor, ts: list[torch.Tensor], starts: np.ndarray) -> list[torch.Tensor]:
    return [buf[start:start + t.nbytes].view(t.dtype).view(t.shape) for t, start in zip(ts, starts)]
