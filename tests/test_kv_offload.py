"""CPU offload: evicted prefix-cache blocks go to a host pool and come back on a later hit."""
import random
from types import SimpleNamespace

import pytest

from longserve import LLM, SamplingParams
from longserve.kv_transfer.offload import OffloadConnectorScheduler

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def workload(seed=0):
    """Prompts sharing prefixes, 11 blocks of 4 tokens each: together far more than 24 blocks."""
    r = random.Random(seed)
    stems = [[r.randrange(5, 200) for _ in range(20)] for _ in range(2)]
    prompts = [s + [r.randrange(5, 200) for _ in range(r.randrange(17, 25))] for s in stems for _ in range(3)]
    return [{"prompt_token_ids": p} for p in prompts]


def run_rounds(llm, prompts, rounds=2):
    """Each prompt alone, round after round (the later rounds hit what was evicted)."""
    return [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
            for _ in range(rounds) for p in prompts]


@pytest.mark.timeout(180)
def test_offload_gives_same_tokens_with_fewer_recomputed(pool_whole):
    prompts = workload()
    kw = dict(device="cpu", max_model_len=256, block_size=4, num_gpu_blocks=24)
    with LLM("builtin:llama-tiny", **kw) as plain:
        want = run_rounds(plain, prompts)
        plain_stats = plain.engine.core_stats()
    with LLM("builtin:llama-tiny", kv_offload_gb=0.002, **kw) as off:  # ~1000 host blocks
        got = run_rounds(off, prompts)
        stats = off.engine.core_stats()
        pool_whole(off)
    assert got == want
    assert stats["kv_connector_num_saved_blocks"] > 0 and stats["kv_connector_num_loaded_tokens"] > 0
    saved = plain_stats["num_prompt_tokens_computed"] - stats["num_prompt_tokens_computed"]
    assert saved == stats["kv_connector_num_loaded_tokens"] > 0
    # the second round recomputes only the one token per prompt whose logits are needed
    assert stats["num_prompt_tokens_computed"] <= sum(len(p["prompt_token_ids"]) for p in prompts) + len(prompts)


@pytest.mark.timeout(180)
def test_small_host_pool_and_batches_keep_tokens(pool_whole):
    """A host pool smaller than the prefix set evicts its own LRU entries; batched requests
    evict and load in the same step. Tokens equal those of a cache large enough for all."""
    prompts = workload(1)
    with LLM("builtin:llama-tiny", device="cpu", max_model_len=256, block_size=4) as big:
        want = [o.outputs[0].token_ids for o in big.generate(prompts, GREEDY, use_tqdm=False)]
    bpb = 2048  # bytes of one llama-tiny block of 4 tokens (checked below)
    with LLM("builtin:llama-tiny", device="cpu", max_model_len=256, block_size=4, num_gpu_blocks=28,
             kv_offload_gb=20 * bpb / (1 << 30)) as off:
        assert off.engine.core.executor.driver.runner.kv_bytes_per_block() == bpb
        got = [o.outputs[0].token_ids for o in off.generate(prompts[::-1], GREEDY, use_tqdm=False)]
        assert got == want[::-1]
        assert run_rounds(off, prompts, 1) == want
        pool_whole(off)
        assert off.engine.core_stats()["kv_connector_num_loaded_tokens"] > 0


def test_offload_scheduler_lru_and_pinning():
    conn = OffloadConnectorScheduler(num_host_blocks=2, tokens_per_block=4)
    conn.on_evict(5, 111)
    conn.on_evict(6, 222)
    assert conn.build_connector_meta(None).saves == [(5, 0), (6, 1)]
    req = SimpleNamespace(num_tokens=13, block_hashes=[111, 222, 333], num_computed_tokens=0)
    assert conn.get_num_new_matched_tokens(req, 0) == (8, False)  # 3rd block: not on host
    conn.on_evict(7, 333)  # both host blocks are read this step: 333 is dropped, not saved
    req.num_computed_tokens = 8
    conn.update_state_after_alloc(req, [9, 10, 11], 8)
    meta = conn.build_connector_meta(None)
    assert meta.saves == [] and meta.loads == [(0, 9), (1, 10)] and meta.filled_block_ids == [9, 10]
    conn.on_evict(7, 333)  # next step: the least recently used entry (111) gives its block
    assert conn.build_connector_meta(None).saves == [(7, 0)] and 111 not in conn.host
    assert conn.build_connector_meta(None) is None


def test_offload_config_errors():
    with pytest.raises(ValueError, match="kv_offload_gb"):
        LLM("builtin:llama-tiny", device="cpu", kv_offload_gb=-1)
    with pytest.raises(ValueError, match="prefix caching"):
        LLM("builtin:llama-tiny", device="cpu", kv_offload_gb=0.01, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="unknown kv_transfer_config keys"):
        LLM("builtin:llama-tiny", device="cpu", kv_transfer_config={"kv_rol": "kv_producer"})
    with pytest.raises(ValueError, match="data_parallel_size=1"):
        LLM("builtin:llama-tiny", device="cpu", kv_offload_gb=0.01, data_parallel_size=2)
    with pytest.raises(ValueError, match="kv_role must be one of"):
        LLM("builtin:llama-tiny", device="cpu", kv_transfer_config={"kv_role": "producer"})
    for bad, match in (({"kv_role": "kv_producer", "kv_connect": ["h:1"]}, "needs kv_role"),
                       ({"kv_role": "kv_consumer", "kv_connect": ["localhost"]}, "host:port"),
                       ({"kv_role": "kv_consumer", "kv_connect": "h:1"}, "list")):
        with pytest.raises(ValueError, match=match):
            LLM("builtin:llama-tiny", device="cpu", kv_transfer_config=bad)


@pytest.mark.timeout(240)
def test_offload_with_tp2_and_pcp2(pool_whole):
    """Every rank offloads its own shard; the same block ids on every rank's host pool."""
    prompts = workload(2)[:4]
    with LLM("builtin:llama-tiny", device="cpu", max_model_len=256, block_size=4) as big:
        want = [o.outputs[0].token_ids for o in big.generate(prompts, GREEDY, use_tqdm=False)]
    for layout in (dict(tensor_parallel_size=2), dict(prefill_context_parallel_size=2)):
        with LLM("builtin:llama-tiny", device="cpu", max_model_len=256, block_size=2, num_gpu_blocks=24,
                 kv_offload_gb=0.001, **layout) as off:
            assert run_rounds(off, prompts) == want + want
            assert off.engine.core_stats()["kv_connector_num_loaded_tokens"] > 0
            pool_whole(off)
