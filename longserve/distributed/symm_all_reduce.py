"""Low-latency all-reduce over NVLink through torch symmetric memory (one-shot or two-shot;
multicast off); which size takes which: `ALGORITHMS` (docs/architecture.md, 'Small collectives')."""
from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# group size -> ((largest bytes, algorithm), ...) ascending, the fastest in a graph (bench_allreduce.py);
# "nccl" rows, sizes past the last row and group sizes not listed go through NCCL.
ALGORITHMS = {2: ((64 << 10, "one_shot"), (1 << 20, "nccl"), (8 << 20, "two_shot"))}
DTYPES = (torch.bfloat16, torch.float32)  # what torch's symmetric-memory kernels dispatch on
DISABLE = "LONGSERVE_SYMM_MEM"  # "0": NCCL for everything (A/B runs)
_WARNED: list = []  # the failure is logged once, not once per group


class SymmAllReduce:
    """One process group's symmetric buffer (allocated and rendezvoused once) and the all-reduce on it;
    all_reduce takes a tensor (True) or leaves it to NCCL (False), by its shape alone (every rank alike)."""

    def __init__(self, group, device: torch.device, table):
        import torch.distributed._symmetric_memory as symm_mem
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.table, self.name = table, group.group_name
        self.buf = symmetric_buffer(symm_mem, table[-1][0], device)
        symm_mem.rendezvous(self.buf, self.name)  # views of buf start at its base: same handle

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum x over the group in place; False: not this path (dtype, layout or size)."""
        nbytes, offset = x.numel() * x.element_size(), x.storage_offset() * x.element_size()
        if x.dtype not in DTYPES or not x.is_contiguous() or not nbytes or (nbytes | offset) % 16:
            return False  # (the kernels want x aligned as the buffer)
        alg = next((alg for limit, alg in self.table if nbytes <= limit), "nccl")
        if alg == "nccl":
            return False
        flat = x.view(-1)
        self._reduce(alg, self.buf[:nbytes].view(x.dtype), flat, flat)
        return True

    def _reduce(self, alg: str, staged: torch.Tensor, local: torch.Tensor, out: torch.Tensor):
        """out = the sum over ranks of `local`, staged through `staged` (a view of the symmetric
        buffer). out may be `local` (each element is read before it is written, by one thread)."""
        ops = torch.ops.symm_mem
        if alg == "one_shot" and hasattr(ops, "one_shot_all_reduce_copy_out"):
            ops.one_shot_all_reduce_copy_out(staged, local, "sum", self.name, out)  # copy fused in
            return
        staged.copy_(local)
        if alg == "one_shot":
            ops.one_shot_all_reduce_out(staged, "sum", self.name, out)
        elif hasattr(ops, "two_shot_all_reduce_out"):
            ops.two_shot_all_reduce_out(staged, "sum", self.name, out)
        else:  # older torch: in place on the buffer (every peer done with it when it returns)
            out.copy_(ops.two_shot_all_reduce_(staged, "sum", self.name))


def symmetric_buffer(symm_mem, nbytes: int, device: torch.device) -> torch.Tensor:
    """symm_mem.empty(nbytes), allocated as empty allocates (in torch's implicit pool where it uses
    one) but with the stride given: empty's stride helper imports sympy, seconds of a cold start."""
    raw = getattr(getattr(symm_mem, "_SymmetricMemory", None), "empty_strided_p2p", None)
    if raw is None:
        return symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
    if getattr(symm_mem, "_should_use_implicit_mempool", lambda: False)():
        with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
            return raw((nbytes,), (1,), torch.uint8, device)
    return raw((nbytes,), (1,), torch.uint8, device)


def create(device_group, device: torch.device) -> SymmAllReduce | None:
    """The group's symmetric-memory path, or None (gloo, a group size without a table row,
    LONGSERVE_SYMM_MEM=0, a failure on any rank: logged once). Collective over the group's ranks."""
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
            logger.warning("symmetric-memory all-reduce unavailable (%s: %s): NCCL", type(e).__name__, e)
        _WARNED.append(e)
        comm = None
    ok = torch.tensor([comm is not None], dtype=torch.int32, device=device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=device_group)  # all ranks or none
    return comm if ok.item() else None
