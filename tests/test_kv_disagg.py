"""Prefill/decode disaggregation at the engine level: a producer engine in its own process(es),
a consumer engine here; the KV moves over gloo pair groups. Every layout pair gives the
greedy tokens of one instance alone, and both pools are whole afterwards."""
import time

import pytest

from longserve import LLM, SamplingParams
from pd_utils import DEVICE, ENGINE, MODEL, Producer, greedy

PROMPTS = [{"prompt_token_ids": [(7 * i + 3) % 400 + 5 for i in range(37)]},
           {"prompt_token_ids": [(11 * i + 1) % 400 + 5 for i in range(70)]}]
N = 6


@pytest.fixture(scope="module")
def reference():
    with LLM(MODEL, **ENGINE) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(N), use_tqdm=False)]


def with_params(params, n=N):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                          extra_args={"kv_transfer_params": params})


def wait_pool_whole(prod, within_s):
    deadline = time.monotonic() + within_s
    while True:
        free, total, held = prod.call("pool")
        if free == total and held == 0:
            return
        assert time.monotonic() < deadline, f"producer pool not whole: {free}/{total}, {held} held"
        time.sleep(0.1)


def consumer(**kw):
    kvt = {"kv_role": "kv_consumer", "kv_transfer_timeout_s": 5}
    kvt.update(kw.pop("kvt", {}))
    return LLM(MODEL, **ENGINE, kv_transfer_config=kvt, **kw)


LAYOUTS = {
    "pcp2->tp2": (dict(prefill_context_parallel_size=2), dict(tensor_parallel_size=2)),
    "tp1->tp2xdcp2": ({}, dict(tensor_parallel_size=2, decode_context_parallel_size=2)),
    "tp2->tp1": (dict(tensor_parallel_size=2), {}),
    "bs8 HND->bs16": (dict(block_size=8, kvt=dict(kv_buffer_layout="HND")), dict(block_size=16)),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_layouts_give_one_instance_tokens(case, reference, pool_whole):
    if DEVICE == "cuda" and case.startswith("bs8"):
        pytest.skip("the GPU attention kernels take blocks of 16 tokens or more")
    p_kw, c_kw = (dict(d) for d in LAYOUTS[case])
    kvt = {"kv_role": "kv_producer", "kv_lease_s": 60, **p_kw.pop("kvt", {})}
    prod = Producer(kv_transfer_config=kvt, **p_kw)
    try:
        params = [prod.call("prefill", p) for p in PROMPTS]
        assert all(p["do_remote_prefill"] for p in params)
        with consumer(**c_kw) as cons:
            outs = cons.generate(PROMPTS, [with_params(p) for p in params], use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == reference
            stats = cons.engine.core_stats()
            assert stats["kv_connector_num_loaded_tokens"] == sum(len(p["prompt_token_ids"]) - 1 for p in PROMPTS)
            assert stats["num_prompt_tokens_computed"] == len(PROMPTS)  # the last token of each
            pool_whole(cons)
        wait_pool_whole(prod, 5)  # released by the consumer, long before the lease
    finally:
        prod.close()
    assert not prod.proc.is_alive()


@pytest.mark.timeout(180)
def test_consumer_prefix_hit_pulls_less_and_full_hit_releases(reference, pool_whole):
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60})
    try:
        with consumer() as cons:
            cons.generate([PROMPTS[1]], greedy(1), use_tqdm=False)  # caches 4 blocks of 16
            p = prod.call("prefill", PROMPTS[1])
            out = cons.generate([PROMPTS[1]], with_params(p), use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference[1]
            assert cons.engine.core_stats()["kv_connector_num_loaded_tokens"] == 69 - 64
            wait_pool_whole(prod, 5)
            short = {"prompt_token_ids": PROMPTS[1]["prompt_token_ids"][:33]}  # 32 cached tokens
            p = prod.call("prefill", short)
            out = cons.generate([short], with_params(p, 2), use_tqdm=False)[0]
            assert cons.engine.core_stats()["kv_connector_num_loaded_tokens"] == 5  # nothing pulled
            assert len(out.outputs[0].token_ids) == 2
            wait_pool_whole(prod, 5)  # a full hit still releases the producer's blocks
            pool_whole(cons)
    finally:
        prod.close()


@pytest.mark.timeout(180)
def test_pull_right_after_prefill_with_an_empty_shard(pool_whole):
    """The consumer pulls at once (maybe before the producer's workers hear of the hold) one
    token that only one of its two DCP shards stores: the other rank moves nothing."""
    prompt = {"prompt_token_ids": PROMPTS[1]["prompt_token_ids"][:34]}
    with LLM(MODEL, **ENGINE) as ref:
        want = ref.generate([prompt], greedy(4), use_tqdm=False)[0].outputs[0].token_ids
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60})
    try:
        with consumer(tensor_parallel_size=2, decode_context_parallel_size=2) as cons:
            cons.generate([prompt], greedy(1), use_tqdm=False)  # caches one block of 32 tokens
            p = prod.call("prefill", prompt)
            out = cons.generate([prompt], with_params(p, 4), use_tqdm=False)[0]
            assert out.outputs[0].token_ids == want
            stats = cons.engine.core_stats()
            assert stats["kv_connector_num_loaded_tokens"] == 1
            assert stats["num_prompt_tokens_computed"] == 34 + 1  # nothing recomputed
            pool_whole(cons)
        wait_pool_whole(prod, 5)
    finally:
        prod.close()


@pytest.mark.timeout(120)
def test_later_pulls_reuse_the_pair_group(reference, pool_whole):
    """A rank pair's process group is built (and warmed) at the first pull and reused by
    every later one, on both sides; with kv_connect, at the consumer's start."""
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60})
    try:
        with consumer() as cons:
            groups = cons.engine.core.executor.driver.runner.kv_connector.groups
            for prompt, want in zip(PROMPTS, reference):
                p = prod.call("prefill", prompt)
                out = cons.generate([prompt], with_params(p), use_tqdm=False)[0]
                assert out.outputs[0].token_ids == want
                assert (groups.num_created, prod.call("groups")) == (1, 1)
            assert cons.engine.core_stats()["num_prompt_tokens_computed"] == len(PROMPTS)
            pool_whole(cons)
        wait_pool_whole(prod, 5)
        # kv_connect: a consumer builds the pair's group at its start; its pull builds none
        addr = f"{p['remote_host']}:{p['remote_port']}"
        p = prod.call("prefill", PROMPTS[0])
        with consumer(kvt={"kv_connect": [addr]}) as cons:
            groups = cons.engine.core.executor.driver.runner.kv_connector.groups
            deadline = time.monotonic() + 10
            while groups.num_created == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert (groups.num_created, prod.call("groups")) == (1, 2)
            out = cons.generate([PROMPTS[0]], with_params(p), use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference[0]
            assert (groups.num_created, prod.call("groups")) == (1, 2)
            assert cons.engine.core_stats()["num_prompt_tokens_computed"] == 1
            pool_whole(cons)
        wait_pool_whole(prod, 5)
    finally:
        prod.close()


@pytest.mark.timeout(180)
def test_bad_params_are_refused_at_the_door(pool_whole):
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60})
    try:
        p = prod.call("prefill", PROMPTS[0])
        with consumer() as cons:
            with pytest.raises(ValueError, match="different prompt"):
                cons.generate([PROMPTS[1]], with_params(p), use_tqdm=False)
            with pytest.raises(ValueError, match="lacks"):
                cons.generate([PROMPTS[0]], with_params({"do_remote_prefill": True}), use_tqdm=False)
            pool_whole(cons)
        with LLM(MODEL, **ENGINE) as plain:
            with pytest.raises(ValueError, match="kv_role"):
                plain.generate([PROMPTS[0]], with_params(p), use_tqdm=False)
    finally:
        prod.close()


# ---- faults ---------------------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_lease_ends_without_consumer_and_late_pull_recomputes(reference, pool_whole):
    """A consumer that never pulls (dead or aborted) leaves no producer blocks held past the
    lease; a pull after the lease is refused and the consumer recomputes the prompt."""
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 1.0})
    try:
        p = prod.call("prefill", PROMPTS[0])
        t0 = time.monotonic()
        wait_pool_whole(prod, 3)
        assert time.monotonic() - t0 < 2.5
        with consumer() as cons:
            out = cons.generate([PROMPTS[0]], with_params(p), use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference[0] and out.error is None
            assert cons.engine.core_stats()["num_prompt_tokens_computed"] == 37  # recomputed
            pool_whole(cons)
        with consumer(kvt={"kv_load_failure_policy": "fail"}) as cons:
            out = cons.generate([PROMPTS[0]], with_params(p), use_tqdm=False)[0]
            assert out.outputs[0].finish_reason == "error" and "failed" in out.error
            assert out.outputs[0].token_ids == []
            pool_whole(cons)
    finally:
        prod.close()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["die", "drop"])
def test_producer_dies_or_connection_drops_during_transfer(fault, reference, pool_whole, monkeypatch):
    monkeypatch.setenv("LONGSERVE_TEST_KV_FAULT", fault)  # the producer inherits it
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 3})
    monkeypatch.delenv("LONGSERVE_TEST_KV_FAULT")
    try:  # the consumer first: on a GPU its start outlasts the 3-s lease, and the pull came too late
        with consumer(kvt={"kv_transfer_timeout_s": 3}) as cons:
            p = prod.call("prefill", PROMPTS[1])
            out = cons.generate([PROMPTS[1]], with_params(p), use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference[1]  # recomputed, never partial KV
            assert cons.engine.core_stats()["num_prompt_tokens_computed"] == 70
            pool_whole(cons)
        if fault == "die":
            prod.proc.join(10)
            assert prod.proc.exitcode == 9
        else:
            wait_pool_whole(prod, 5)  # the lease (3 s) frees the blocks of the failed pull
    finally:
        prod.close()
    assert not prod.proc.is_alive()


@pytest.mark.timeout(180)
def test_consumer_stalls_mid_pull(reference, pool_whole, monkeypatch):
    """A consumer that stalls in the middle of a pull (4 s, past the 3 s lease): the producer
    gives up its send at the lease and frees the blocks, the consumer's pull times out and
    it recomputes; the same pair then serves the next request's pull."""
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 3})
    try:
        monkeypatch.setenv("LONGSERVE_TEST_KV_FAULT", "consumer_stall")  # read in the pull
        with consumer(kvt={"kv_transfer_timeout_s": 3}) as cons:  # first: see the test above
            p = prod.call("prefill", PROMPTS[1])
            out = cons.generate([PROMPTS[1]], with_params(p), use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference[1]  # recomputed, never partial KV
            # gloo's send waits for its receive: the lease ends it and the consumer recomputes.
            # NCCL may have landed every (small) piece in the receiver's buffers before the stall
            # ended: then the pull is whole (measured on 2 x H200)
            computed = cons.engine.core_stats()["num_prompt_tokens_computed"]
            assert computed == 70 or (DEVICE == "cuda" and computed == 1)
            wait_pool_whole(prod, 3)
            monkeypatch.delenv("LONGSERVE_TEST_KV_FAULT")
            p = prod.call("prefill", PROMPTS[0])
            out = cons.generate([PROMPTS[0]], with_params(p), use_tqdm=False)[0]
            assert out.outputs[0].token_ids == reference[0]
            assert cons.engine.core_stats()["num_prompt_tokens_computed"] == computed + 1  # pulled
            pool_whole(cons)
        wait_pool_whole(prod, 5)
    finally:
        prod.close()
    assert not prod.proc.is_alive()


@pytest.mark.timeout(180)
def test_consumer_aborts_while_loading(pool_whole):
    """An abort during the load keeps the consumer's blocks until the load reports back,
    then frees them; the producer is released."""
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": 60})
    try:
        p = prod.call("prefill", PROMPTS[1])
        with consumer() as cons, cons.engine.client.paused() as core:
            req = cons.engine.make_request(PROMPTS[1], with_params(p))
            core.add_request(req)
            core.step()  # the load starts
            assert req.request_id in core.scheduler.loading
            core.abort_requests([req.request_id])
            assert core.kv.num_free_blocks < core.kv.num_blocks  # a load may still write them
            deadline = time.monotonic() + 10
            while core.scheduler.has_kv_transfers() and time.monotonic() < deadline:
                core.step()
            assert core.pool_state() == dict(num_free_blocks=core.kv.num_blocks,
                                             num_blocks=core.kv.num_blocks, refs_zero=True,
                                             unfinished=False)
        wait_pool_whole(prod, 5)
    finally:
        prod.close()


@pytest.mark.timeout(90)
def test_consumer_dies_during_pull_producer_frees_by_the_lease(monkeypatch):
    """A consumer process that dies in the middle of a pull (it never releases) leaves no
    producer blocks held past the lease, even with a long transfer timeout."""
    lease = 3.0
    prod = Producer(kv_transfer_config={"kv_role": "kv_producer", "kv_lease_s": lease,
                                        "kv_transfer_timeout_s": 60})
    monkeypatch.setenv("LONGSERVE_TEST_KV_FAULT", "consumer_die")  # the consumer inherits it
    cons = Producer(kv_transfer_config={"kv_role": "kv_consumer", "kv_transfer_timeout_s": 60},
                    beside_test=True)
    monkeypatch.delenv("LONGSERVE_TEST_KV_FAULT")
    try:
        p = prod.call("prefill", PROMPTS[1])
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="died"):
            cons.call("generate", (PROMPTS[1], p, N))
        cons.proc.join(10)
        assert cons.proc.exitcode == 9
        wait_pool_whole(prod, lease + 2 - (time.monotonic() - t0))
        assert time.monotonic() - t0 < lease + 2
    finally:
        cons.close()
        prod.close()
    assert not prod.proc.is_alive() and not cons.proc.is_alive()
