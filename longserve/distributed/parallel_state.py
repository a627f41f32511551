"""Rank layout and process groups: rank = ((dp * PCP) + pcp) * TP + tp, dcp_rank = tp_rank % dcp,
cp_rank = pcp_rank * dcp + dcp_rank (docs/architecture.md, 'Rank layout'). A group of size 1
returns its input untouched, so one rank needs no torch.distributed."""
from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from longserve.config import ParallelConfig
from longserve.distributed import symm_all_reduce

logger = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 5.0  # closing the groups with every rank present takes well under a second


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


@dataclass(frozen=True)
class RankLayout:
    """Coordinates of one global rank."""
    tp_size: int
    pcp_size: int
    dcp_size: int
    dp_size: int
    rank: int

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pcp_rank(self) -> int:
        return (self.rank // self.tp_size) % self.pcp_size

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.tp_size * self.pcp_size)

    @property
    def dcp_rank(self) -> int:
        return self.tp_rank % self.dcp_size

    @property
    def cp_rank(self) -> int:
        return self.pcp_rank * self.dcp_size + self.dcp_rank


def group_ranks(cfg: ParallelConfig) -> dict[str, list[list[int]]]:
    """Rank lists of every group kind, each list ordered by rank within the group."""
    tp, pcp, dcp, dp = (cfg.tensor_parallel_size, cfg.prefill_context_parallel_size,
                        cfg.decode_context_parallel_size, cfg.data_parallel_size)
    rank = lambda d, p, t: (d * pcp + p) * tp + t  # noqa: E731 (the module docstring's layout)
    D, P, T, R = range(dp), range(pcp), range(tp), range(dcp)
    S = range(0, tp, dcp)  # the first TP rank of each DCP group (each KV head group)
    return {"tp": [[rank(d, p, t) for t in T] for d in D for p in P],
            "pcp": [[rank(d, p, t) for p in P] for d in D for t in T],
            "dcp": [[rank(d, p, s + r) for r in R] for d in D for p in P for s in S],
            "cp": [[rank(d, p, s + r) for p in P for r in R] for d in D for s in S],
            "dp": [[rank(d, p, t) for d in D] for p in P for t in T],
            "model": [[rank(d, p, t) for p in P for t in T] for d in D]}


class GroupCoordinator:
    """One process group seen from one rank, with size-1 fast paths."""

    def __init__(self, ranks: list[int], rank: int, device_group=None, cpu_group=None):
        self.ranks = ranks
        self.rank_in_group = ranks.index(rank)
        self.world_size = len(ranks)
        self.device_group = device_group
        self.cpu_group = cpu_group  # gloo, for Python objects and CPU tensors
        self.symm = None  # small collectives over NVLink (distributed/symm_all_reduce.py)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (a small CUDA tensor through symmetric memory)."""
        if self.world_size == 1 or (self.symm is not None and self.symm.all_reduce(x)):
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Concatenate every rank's `x` along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        out = all_gather_async(self, x, async_op=False)()
        if dim == 0:
            return out
        return torch.cat(out.view((self.world_size,) + tuple(x.shape)).unbind(0), dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """Sum over ranks, then keep this rank's 1/world_size slice along `dim`."""
        if self.world_size == 1:
            return x
        return reduce_scatter_async(self, x.movedim(dim, 0), async_op=False)().movedim(0, dim)

    def all_to_all(self, x: torch.Tensor, async_op: bool = False):
        """x [world_size, ...]: x[j] goes to rank j; returns rank j's piece for this rank at [j]
        (all_to_all_single: one NCCL call, graph-capturable; gloo has it on CPU too), or with
        async_op a function that waits for it (the device waits, not the host)."""
        wait = (lambda: x) if self.world_size == 1 else all_to_all_async(self, x, async_op)
        return wait if async_op else wait()

    def gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor | None:
        """Concatenation on the first rank of the group, None elsewhere."""
        gathered = self.all_gather(x, dim)  # NCCL gather is point-to-point; all-gather is one call
        return gathered if self.is_first_rank else None

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """The first rank's `x` on every rank (in place; the device group: no host wait)."""
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[0], group=self.device_group)
        return x

    def broadcast_object(self, obj=None):
        """The group's first rank's picklable object on every rank: the plan under torchrun
        (ranks perhaps on other hosts; spawned workers read theirs from the shared-memory ring)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.cpu_group)
        return box[0]

    def gather_object(self, obj):
        """Every rank's picklable object, in rank order, on the first rank; None elsewhere."""
        if self.world_size == 1:
            return [obj]
        out = [None] * self.world_size if self.is_first_rank else None
        dist.gather_object(obj, out, dst=self.ranks[0], group=self.cpu_group)
        return out


@dataclass
class ParallelState:
    layout: RankLayout
    tp: GroupCoordinator
    pcp: GroupCoordinator
    dcp: GroupCoordinator
    cp: GroupCoordinator
    dp: GroupCoordinator
    model: GroupCoordinator  # every rank of one DP replica; its first rank (the engine core) drives it


# ---- collectives started at once (async_op) or run now; calling the result gives the value ---
def _is_gloo(group: GroupCoordinator) -> bool:
    return dist.get_backend(group.device_group) == "gloo"


def _waiter(work, value: torch.Tensor):
    return lambda: (work is not None and work.wait(), value)[1]


def all_gather_async(group: GroupCoordinator, x: torch.Tensor, async_op: bool = True):
    x = x.contiguous()
    if _is_gloo(group):
        parts = [torch.empty_like(x) for _ in range(group.world_size)]
        work = dist.all_gather(parts, x, group=group.device_group, async_op=async_op)
        return lambda: (work is not None and work.wait(), torch.cat(parts))[1]
    out = x.new_empty((group.world_size * x.shape[0],) + tuple(x.shape[1:]))
    return _waiter(dist.all_gather_into_tensor(out, x, group=group.device_group, async_op=async_op), out)


def reduce_scatter_async(group: GroupCoordinator, x: torch.Tensor, async_op: bool = True):
    """Sum over ranks; this rank keeps its 1/world_size of the rows."""
    if _is_gloo(group):  # gloo has no reduce_scatter: sum a copy whole, keep a slice
        x = x.clone(memory_format=torch.contiguous_format)
        work = dist.all_reduce(x, group=group.device_group, async_op=async_op)
        return _waiter(work, x.chunk(group.world_size)[group.rank_in_group])
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group.world_size,) + tuple(x.shape[1:]))
    return _waiter(dist.reduce_scatter_tensor(out, x, group=group.device_group, async_op=async_op), out)


def all_reduce_async(group: GroupCoordinator, x: torch.Tensor, async_op: bool = True):
    if not async_op:  # in order: the group's own (symmetric memory where its table says so)
        return _waiter(None, group.all_reduce(x))
    return _waiter(dist.all_reduce(x, group=group.device_group, async_op=True), x)


def all_to_all_async(group: GroupCoordinator, x: torch.Tensor, async_op: bool = True):
    """x [world_size, ...]: x[j] goes to rank j; rank j's piece for this rank lands at [j]."""
    x = x.contiguous()
    out = torch.empty_like(x)  # of the contiguous x: empty_like keeps a permuted x's strides
    return _waiter(dist.all_to_all_single(out, x, group=group.device_group, async_op=async_op), out)


def single_rank_state() -> ParallelState:
    g = GroupCoordinator([0], 0)
    return ParallelState(RankLayout(1, 1, 1, 1, 0), g, g, g, g, g, g)


# a worker waits for the next plan as long as the engine idles: the driver watches that send instead
IDLE_TIMEOUT = datetime.timedelta(days=3650)


def attach_symmetric_memory(groups: list[GroupCoordinator], device: torch.device) -> None:
    """One symmetric buffer a process, for the first of a decode step's groups with peers; a later
    group of the same ranks shares it, others keep NCCL (a second rendezvous over other ranks
    deadlocks: docs/architecture.md, 'Small collectives over NVLink')."""
    first = next((g for g in groups if g.world_size > 1), None)
    if first is None:
        return
    first.symm = symm_all_reduce.create(first.device_group, device)
    for g in groups:
        if g.ranks == first.ranks:
            g.symm = first.symm


def build_parallel_state(cfg: ParallelConfig, rank: int) -> ParallelState:
    """Create every group, all ranks in the same order (new_group is collective): one device group a
    rank list (the world's: the default group; a communicator's first collective costs 0.3-0.9 s),
    none for a rank alone. Collectives: `distributed_timeout_s`; the plan channel: IDLE_TIMEOUT."""
    layout = RankLayout(cfg.tensor_parallel_size, cfg.prefill_context_parallel_size,
                        cfg.decode_context_parallel_size, cfg.data_parallel_size, rank)
    if cfg.world_size == 1:
        return single_rank_state()
    mine, device_groups, cpu_groups = {}, {}, {}
    world, timeout = tuple(range(cfg.world_size)), datetime.timedelta(seconds=cfg.distributed_timeout_s)
    for kind, lists in group_ranks(cfg).items():
        for ranks in lists:
            key, plan = tuple(ranks), kind == "model"
            if len(ranks) > 1 and key not in device_groups:  # (the size-1 paths touch no group)
                device_groups[key] = (dist.group.WORLD if key == world
                                      else dist.new_group(ranks, timeout=timeout))
            if len(ranks) > 1 and (key, plan) not in cpu_groups:
                cpu_groups[key, plan] = dist.new_group(ranks, backend="gloo",
                                                       timeout=IDLE_TIMEOUT if plan else timeout)
            if rank in ranks:
                mine[kind] = GroupCoordinator(ranks, rank, device_groups.get(key),
                                              cpu_groups.get((key, plan)))
    if torch.cuda.is_available() and dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
        attach_symmetric_memory([mine[k] for k in ("tp", "pcp", "dcp", "cp")], device)
        for kind in ("cp", "dp"):  # NCCL connects at the first all-to-all: now, not in a request
            if mine[kind].world_size > 1:
                mine[kind].all_to_all(torch.zeros(mine[kind].world_size, device=device))
    return ParallelState(layout, **mine)


def close_process_groups(peers_present: bool) -> None:
    """Free every process group of this process, bounded (a hung close is logged and left). NCCL's
    destroy is collective: all ranks call this after the goodbye; with a peer gone it aborts (local)."""
    if not dist.is_initialized():
        return
    nccl = dist.get_backend() == "nccl"
    close = (dist.destroy_process_group if peers_present or not nccl
             else dist.distributed_c10d._abort_process_group)
    errors: list[BaseException] = []
    device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def run():
        try:
            if device is not None:  # a new thread starts on device 0
                torch.cuda.set_device(device)
            close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    closer = threading.Thread(target=run, name="longserve-close-groups", daemon=True)
    closer.start()
    closer.join(CLOSE_TIMEOUT_S)
    if closer.is_alive() or errors:
        logger.warning("closing the process groups %s", f"failed: {errors[0]}" if errors
                       else f"did not finish within {CLOSE_TIMEOUT_S:g} s; left behind")
