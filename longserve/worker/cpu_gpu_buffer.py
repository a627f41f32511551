"""A host tensor paired with a device tensor of the same shape: step inputs are built on the host
(`.np` shares memory with `.cpu`) and copied once; pinned memory (off by default: it needs a
CUDA build) makes that copy asynchronous."""
from __future__ import annotations

import numpy as np
import torch


class CpuGpuBuffer:
    def __init__(self, *size: int, dtype: torch.dtype, device: torch.device | str, pin_memory: bool = False):
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu", pin_memory=pin_memory)
        self.np: np.ndarray = self.cpu.numpy()
        self.gpu = torch.zeros_like(self.cpu, device=device)

    def copy_to_gpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first `n` rows (all when None) to the device; return that device slice."""
        return self.gpu[:n].copy_(self.cpu[:n], non_blocking=True)

