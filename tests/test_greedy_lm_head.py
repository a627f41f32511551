"""ParallelLMHead.greedy: the argmax of the logits without gathering them (each TP rank's best
of its vocab slice, then the best of those) equals torch.argmax over the whole vocabulary on
every rank: ties go to the lower id, and the last slice's padding rows never win."""
import pytest
import torch
import torch.distributed as dist

from dist_utils import run_distributed
from longserve.distributed.parallel_state import GroupCoordinator
from longserve.models.layers import ParallelLMHead

VOCAB, HIDDEN = 10, 4  # over 3 ranks: slices of 4, the last with 2 padding rows


def weights_and_rows(seed: int):
    """Small integer weights and rows: exact float32 dot products, so ties are common; in half
    the rows every real logit is negative, below the padding rows' zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randint(-2, 3, (VOCAB, HIDDEN), generator=g).float()
    w[:, 0] = -3
    h = torch.randint(-2, 3, (64, HIDDEN), generator=g).float()
    h[:, 0] = torch.where(torch.arange(64) % 2 == 0, 5.0, 0.0)
    return w, h


def _greedy(rank, world_size, seed):
    group = GroupCoordinator(list(range(world_size)), rank, dist.group.WORLD, dist.group.WORLD)
    head = ParallelLMHead(VOCAB, HIDDEN, group)
    w, h = weights_and_rows(seed)
    head.load_rows(head.weight, w)
    ids = head.greedy(h)
    return ids.tolist()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_greedy_over_vocab_slices_is_the_first_argmax(world_size):
    for seed in range(3):
        w, h = weights_and_rows(seed)
        want = (h @ w.T).argmax(dim=-1)
        got = run_distributed(_greedy, world_size, seed)
        assert got == [want.tolist()] * world_size, seed  # every TP rank has the ids: no broadcast
        assert ((h @ w.T).max(dim=-1).values < 0).any()  # the padding rows were in the running
