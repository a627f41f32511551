"""The symmetric-memory all-reduce of GroupCoordinator (distributed/symm_all_reduce.py) on CPU
ranks: the CUDA kernels' sum is stood in for by a gloo all-reduce of the staged buffer, so what
is checked here is the rest (which tensors take the path and with which algorithm, the staging
through the buffer) against the plain gloo all-reduce."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from longserve.distributed import symm_all_reduce
from longserve.distributed.parallel_state import GroupCoordinator

TABLE = ((64, "one_shot"), (256, "nccl"), (512, "two_shot"))


class GlooStandIn(symm_all_reduce.SymmAllReduce):
    def __init__(self, group, table):  # no symmetric memory: a plain buffer
        self.table, self.name, self.group = table, None, group
        self.buf = torch.full((table[-1][0],), 7, dtype=torch.uint8)  # garbage until staged
        self.calls = []

    def _reduce(self, alg, staged, local, out):
        self.calls.append(alg)
        staged.copy_(local)
        out.copy_(staged)
        dist.all_reduce(out, group=self.group)


def _both_paths(rank, world_size):
    ranks = list(range(world_size))
    plain = GroupCoordinator(ranks, rank, dist.group.WORLD)
    fast = GroupCoordinator(ranks, rank, dist.group.WORLD)
    fast.symm = GlooStandIn(dist.group.WORLD, TABLE)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(rank))
    cases = {"one_shot": x[:1, :16], "nccl_middle": x[:2], "two_shot": x[:4],
             "too_big": torch.randn(8, 32), "odd_size": x[0, :3]}  # odd_size: not 16-byte aligned
    same = {}
    for name, t in cases.items():
        before = len(fast.symm.calls)
        same[name] = (torch.equal(plain.all_reduce(t.clone()), fast.all_reduce(t.clone())),
                      fast.symm.calls[before:])
    return same


@pytest.mark.timeout(60)
def test_symmetric_path_equals_the_plain_all_reduce_and_follows_the_table():
    for same in run_distributed(_both_paths, 2):
        assert all(ok for ok, _ in same.values()), same
        assert {name: calls for name, (_, calls) in same.items()} == {
            "one_shot": ["one_shot"], "nccl_middle": [], "two_shot": ["two_shot"],
            "too_big": [], "odd_size": []}


def test_gloo_and_cpu_groups_keep_the_plain_path():
    assert symm_all_reduce.create(None, torch.device("cpu")) is None


def test_symmetric_buffer_gives_its_stride_and_falls_back_to_empty():
    """The raw allocation with the stride given (empty's stride helper imports sympy), outside
    an implicit pool as torch chooses; a torch without it gets symm_mem.empty."""
    calls = []

    class Raw:
        @staticmethod
        def empty_strided_p2p(size, stride, dtype, device):
            calls.append(("raw", size, stride, dtype))
            return torch.empty(size, dtype=dtype)

    class SymmMem:
        _SymmetricMemory = Raw

        @staticmethod
        def _should_use_implicit_mempool():
            return False

        @staticmethod
        def empty(n, dtype, device):
            calls.append(("empty", n, dtype))
            return torch.empty(n, dtype=dtype)

    assert symm_all_reduce.symmetric_buffer(SymmMem, 96, torch.device("cpu")).shape == (96,)
    del SymmMem._SymmetricMemory
    symm_all_reduce.symmetric_buffer(SymmMem, 32, torch.device("cpu"))
    assert calls == [("raw", (96,), (1,), torch.uint8), ("empty", 32, torch.uint8)]
