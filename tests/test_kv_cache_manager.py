"""Block pool and prefix caching rules."""
from hypothesis import given, settings
from hypothesis import strategies as st

from longserve.engine.kv_cache_manager import KVCacheManager
from longserve.engine.request import Request
from longserve.sampling_params import SamplingParams


def req(tokens, rid="r"):
    return Request(rid, list(tokens), SamplingParams())


def admit(kv, r):
    """What the scheduler does for a waiting request: hits first, then allocate the rest."""
    blocks, computed = kv.get_computed_blocks(r)
    r.num_computed_tokens = computed
    assert kv.allocate_slots(r, r.num_tokens - computed, blocks)
    r.num_computed_tokens = r.num_tokens
    kv.cache_full_blocks(r)
    return computed


def test_repeated_prompt_hits_all_full_blocks_but_the_last_token():
    kv = KVCacheManager(16, 4)
    a = req(range(10), "a")
    assert admit(kv, a) == 0
    kv.free(a)
    b = req(range(10), "b")
    assert admit(kv, b) == 8  # two full blocks; at least one token is left to compute
    c = req(range(8), "c")
    assert admit(kv, c) == 4  # 8 tokens = 2 blocks, but the last token is recomputed
    d = req(list(range(4)) + [99] * 6, "d")
    assert admit(kv, d) == 4  # shares only the first block
    for r in (b, c, d):
        kv.free(r)
    assert kv.num_free_blocks == 16 and all(x == 0 for x in kv.ref_cnt)


def test_lru_eviction_takes_the_oldest_free_block_first():
    """a is freed before b, so a new request evicts a's cached blocks and b's survive."""
    kv = KVCacheManager(6, 2)
    a, b = req([1, 2, 3, 4, 5], "a"), req([7, 8, 9, 10, 11], "b")
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.free(b)
    c = req([20, 21, 22, 23, 24], "c")
    admit(kv, c)
    kv.free(c)
    assert admit(kv, req([7, 8, 9, 10, 11], "b2")) == 4  # b's two full blocks survived
    assert kv.get_computed_blocks(req([1, 2, 3, 4, 5], "a2"))[1] == 0  # a's were evicted


def test_allocation_fails_cleanly_when_the_pool_is_short():
    kv = KVCacheManager(3, 4)
    a = req(range(9), "a")
    assert kv.allocate_slots(a, 9)
    b = req(range(100, 109), "b")
    assert not kv.allocate_slots(b, 9)
    assert b.block_ids == [] and kv.num_free_blocks == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(0, 3), st.booleans()), min_size=1, max_size=25))
def test_pool_accounting_holds_for_any_sequence(ops):
    """Every block is free xor referenced; freeing everything returns the whole pool."""
    kv = KVCacheManager(12, 4)
    live = []
    for i, (n, vocab_seed, free_one) in enumerate(ops):
        r = req([(vocab_seed * 7 + j) % 5 for j in range(n)], str(i))
        blocks, computed = kv.get_computed_blocks(r)
        r.num_computed_tokens = computed
        if kv.allocate_slots(r, n - computed, blocks):
            r.num_computed_tokens = n
            kv.cache_full_blocks(r)
            live.append(r)
        else:
            r.num_computed_tokens = 0
        if free_one and live:
            kv.free(live.pop(0))
        referenced = {b for x in live for b in x.block_ids}
        assert set(kv.free_queue).isdisjoint(referenced)
        assert len(kv.free_queue) + len(referenced) == kv.num_blocks
        assert all(kv.ref_cnt[b] == sum(x.block_ids.count(b) for x in live) for b in range(12))
        assert all(kv.block_hash[b] == h for h, b in kv.cached.items())
    for r in live:
        kv.free(r)
    assert kv.num_free_blocks == kv.num_blocks
