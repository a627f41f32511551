"""GroupCoordinator.broadcast_object, which carries the step plan to every rank each step under
torchrun: small and large objects in turn."""
import pytest
import torch.distributed as dist

from dist_utils import run_distributed
from longserve.distributed.parallel_state import GroupCoordinator

OBJECTS = [None, {"plan": [1, 2, 3], "ids": ["a", "b"]}, list(range(1 << 16)), b"x" * (1 << 16),
           "small again"]


def _receive_all(rank, world_size):
    group = GroupCoordinator(list(range(world_size)), rank, dist.group.WORLD, dist.group.WORLD)
    return [group.broadcast_object(obj if rank == 0 else None) for obj in OBJECTS]


@pytest.mark.timeout(60)
def test_every_rank_receives_what_the_first_sent_small_or_large():
    for got in run_distributed(_receive_all, 3):
        assert got == OBJECTS
