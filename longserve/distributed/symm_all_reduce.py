"""Low-latency all-reduce of small tensors over NVLink, through torch symmetric memory.

Inside a CUDA graph NCCL's all-reduce costs ~19 us even at 8 KB; over a symmetric buffer (memory
every rank of the group can load and store) a one-shot all-reduce (each rank loads every peer's
buffer and sums: one kernel) costs 6-7 us, a two-shot one (reduce-scatter then all-gather by peer
loads) ~13 us at 2 MB against NCCL's 38 (2 x H200, ../shared/design/performance.md). Only peer
loads and stores: NVLink multicast stays off (TORCH_SYMM_MEM_DISABLE_MULTICAST=1).

An all-gather (and an all-to-all) is an all-reduce of zero-padded rows: rank r writes its x into
row r of a zeroed [W, ...] buffer, and the sum holds every rank's x exactly (x + 0 = x, -inf and
NaN included). It moves W times the bytes, so it pays only while latency dominates: ALGORITHMS
sizes it by those W x bytes.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# group size -> ((largest bytes, algorithm), ...) in ascending order; larger tensors, and group
# sizes not listed, go through NCCL. 2 x H200 at 8 KB / 128 KB / 2 MB: NCCL 19.1 / 18.9 / 38.4 us,
# one-shot 6.3 / 7.5 / 18.6, two-shot 6.2 / 7.2 / 12.8; refill from benchmarks/bench_allreduce.py.
ALGORITHMS = {2: ((256 << 10, "one_shot"), (8 << 20, "two_shot"))}
DTYPES = (torch.bfloat16, torch.float32)  # what torch's symmetric-memory kernels dispatch on
DISABLE = "LONGSERVE_SYMM_MEM"  # "0": NCCL for everything (A/B runs)
_WARNED: list = []  # the failure is logged once, not once per group


class SymmAllReduce:
    """One process group's symmetric buffer (allocated and rendezvoused once) and the ops on it.
    Every call takes a tensor it can handle and returns True / a result, or leaves it to NCCL
    (False / None); the choice depends on shapes only, so every rank makes the same one."""

    def __init__(self, group, device: torch.device, table):
        import torch.distributed._symmetric_memory as symm_mem
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.table, self.name = table, group.group_name
        self.rank, self.world_size = group.rank(), group.size()
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed by older torch, a no-op later
            symm_mem.enable_symm_mem_for_group(self.name)
        self.buf = symm_mem.empty(table[-1][0], dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buf, self.name)  # views of buf start at its base: same handle

    def algorithm(self, x: torch.Tensor, nbytes: int) -> str | None:
        offset = x.storage_offset() * x.element_size()  # the kernels want x aligned as the buffer
        if x.dtype not in DTYPES or not x.is_contiguous() or not nbytes or (nbytes | offset) % 16:
            return None
        return next((alg for limit, alg in self.table if nbytes <= limit), None)

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum x over the group in place; False: not this path (dtype, layout or size)."""
        alg = self.algorithm(x, x.numel() * x.element_size())
        if alg is None:
            return False
        flat = x.view(-1)
        self._reduce(alg, self.buf[:flat.numel() * flat.element_size()].view(x.dtype), flat, flat)
        return True

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """[W, *x.shape]: every rank's x in rank order (the zero-padded all-reduce), or None."""
        W, n = self.world_size, x.numel()
        alg = self.algorithm(x, W * n * x.element_size())
        if alg is None:
            return None
        rows = self.buf[:W * n * x.element_size()].view(x.dtype).view(W, n)
        rows.zero_()
        rows[self.rank].copy_(x.view(-1))
        out = torch.empty((W,) + tuple(x.shape), dtype=x.dtype, device=x.device)
        self._reduce(alg, rows.view(-1), None, out.view(-1))
        return out

    def _reduce(self, alg: str, staged: torch.Tensor, local: torch.Tensor | None, out: torch.Tensor):
        """out = sum over ranks of staged (a view of the symmetric buffer); `local` (not
        symmetric) is copied into staged first. out may be `local` (each element is read
        before it is written, by the same thread)."""
        ops = torch.ops.symm_mem
        if alg == "one_shot" and local is not None and hasattr(ops, "one_shot_all_reduce_copy_out"):
            ops.one_shot_all_reduce_copy_out(staged, local, "sum", self.name, out)  # copy fused in
            return
        if local is not None:
            staged.copy_(local)
        if alg == "one_shot":
            ops.one_shot_all_reduce_out(staged, "sum", self.name, out)
        elif hasattr(ops, "two_shot_all_reduce_out"):
            ops.two_shot_all_reduce_out(staged, "sum", self.name, out)
        else:  # older torch: in place on the buffer (every peer done with it when it returns)
            out.copy_(ops.two_shot_all_reduce_(staged, "sum", self.name))


def create(device_group, device: torch.device) -> SymmAllReduce | None:
    """The group's symmetric-memory path, or None (gloo, a group size without a table row,
    LONGSERVE_SYMM_MEM=0, or a failure on any rank: logged once, NCCL then). Collective over
    the group's ranks, in the same order on each."""
    if device.type != "cuda" or os.environ.get(DISABLE) == "0" or \
            dist.get_backend(device_group) != "nccl":
        return None
    table = ALGORITHMS.get(dist.get_world_size(device_group))
    if table is None:
        return None
    try:
        comm = SymmAllReduce(device_group, device, table)
    except Exception as e:  # no NVLink peer access, a torch without symmetric memory, ...
        if not _WARNED:
            logger.warning("symmetric-memory all-reduce unavailable (%s: %s): NCCL",
                           type(e).__name__, e)
        _WARNED.append(e)
        comm = None
    ok = torch.tensor([comm is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=device_group)  # all ranks or none
    return comm if ok.item() else None
