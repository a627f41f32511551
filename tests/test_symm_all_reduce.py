"""The symmetric-memory path of GroupCoordinator (distributed/symm_all_reduce.py) on CPU ranks:
the CUDA kernels' sum is stood in for by a gloo all-reduce of the staged buffer, so what is
checked here is the rest (which tensors take the path, the zero-padded gather, and the
all-gather / all-to-all built on it) against the plain gloo collectives."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from longserve.distributed import symm_all_reduce
from longserve.distributed.parallel_state import GroupCoordinator


class GlooStandIn(symm_all_reduce.SymmAllReduce):
    def __init__(self, group, table):  # no symmetric memory: a plain buffer
        self.table, self.name, self.group = table, None, group
        self.rank, self.world_size = group.rank(), group.size()
        self.buf = torch.full((table[-1][0],), 7, dtype=torch.uint8)  # garbage until zeroed

    def _reduce(self, alg, staged, local, out):
        if local is not None:
            staged.copy_(local)
        out.copy_(staged)
        dist.all_reduce(out, group=self.group)


def _both_paths(rank, world_size):
    ranks = list(range(world_size))
    plain = GroupCoordinator(ranks, rank, dist.group.WORLD)
    fast = GroupCoordinator(ranks, rank, dist.group.WORLD)
    fast.symm = GlooStandIn(dist.group.WORLD, ((256, "one_shot"), (512, "two_shot")))
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(4, 3, 8, generator=g)
    x[0, 0, 0] = float("-inf")  # an empty shard's LSE survives the zero padding
    cases = {
        "all_reduce": lambda c: c.all_reduce(x[:2].clone()),
        "all_gather0": lambda c: c.all_gather(x[:1], 0),
        "all_gather1": lambda c: c.all_gather(x[:1], 1),
        "all_to_all": lambda c: c.all_to_all(x[:world_size]),
        "too_big": lambda c: c.all_gather(x, 1),  # over the table: the plain path
        "odd_size": lambda c: c.all_reduce(x[0, :1, :3].clone()),  # not 16-byte aligned
    }
    out = {name: (fn(plain), fn(fast)) for name, fn in cases.items()}
    nbytes = lambda t, gathered=True: t.numel() * 4 * (world_size if gathered else 1)  # noqa: E731
    took = {"all_reduce": fast.symm.algorithm(x[:2], nbytes(x[:2], False)),
            "all_to_all": fast.symm.algorithm(x[:2], nbytes(x[:2])),
            "all_gather1": fast.symm.algorithm(x[:1], nbytes(x[:1])),
            "too_big": fast.symm.algorithm(x, nbytes(x))}
    return {name: torch.equal(a, b) for name, (a, b) in out.items()}, took


@pytest.mark.timeout(60)
def test_symmetric_path_equals_the_plain_collectives():
    for same, took in run_distributed(_both_paths, 2):
        assert all(same.values()), same
        assert took == {"all_reduce": "one_shot", "all_to_all": "two_shot", "all_gather1": "one_shot",
                        "too_big": None}


def test_gloo_and_cpu_groups_keep_the_plain_path():
    assert symm_all_reduce.create(None, torch.device("cpu")) is None
