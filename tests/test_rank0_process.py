"""Rank 0's worker in a process of its own (rank0_own_process, the default on a GPU): the same tokens
as one in-process rank for every layout, grammars included; its failures are named, whether it dies
or raises; nothing is left behind; the rule's refusals at the door."""
import os
import signal
import threading
import time

import pytest

from conftest import assert_pool_whole
from longserve import LLM, SamplingParams
from longserve.sampling_params import StructuredOutputsParams

ENGINE = dict(device="cpu", max_model_len=512)
PROMPTS = ["The capital of France is", "One two three four", "def fib(n):", "hello"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def tokens(llm, params=GREEDY, prompts=PROMPTS):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:  # a zombie not reaped yet
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.fixture(scope="module")
def expected():
    with LLM("builtin:qwen2-tiny", **ENGINE) as one:
        return tokens(one)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [dict(), dict(tensor_parallel_size=2),
                                    dict(prefill_context_parallel_size=2),
                                    dict(tensor_parallel_size=2, decode_context_parallel_size=2)])
def test_same_tokens_and_nothing_left(expected, layout):
    with LLM("builtin:qwen2-tiny", rank0_own_process=True, **layout, **ENGINE) as llm:
        executor = llm.engine.core.executor
        assert executor.driver is None and len(executor.procs) == llm.config.parallel.replica_size
        assert tokens(llm) == expected
        assert_pool_whole(llm)
        assert llm.engine.core_stats()["num_dbo_steps"] is None  # (counted in rank 0's process)
        pids = [p.pid for p in executor.procs]
        assert "rank 0:" in llm.engine.startup  # its start-up phases reach the banner
    deadline = time.monotonic() + 10
    while not all(map(gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(map(gone, pids))


@pytest.mark.timeout(240)
def test_logprobs_and_prompt_logprobs_come_back_the_same():
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2),
              SamplingParams(temperature=0.9, seed=3, max_tokens=6, logprobs=1), GREEDY, GREEDY]

    def run(**kw):
        with LLM("builtin:llama-tiny", tensor_parallel_size=2, **kw, **ENGINE) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
        return [(o.prompt_logprobs, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    assert run(rank0_own_process=True) == run(rank0_own_process=False)


@pytest.mark.timeout(240)
def test_grammar_bitmask_reaches_rank_0():
    """A structured step's sampling waits for the mask, which goes to rank 0 the plan's way."""
    so = StructuredOutputsParams(regex=r"[a-c]{3}-\d\d")
    params = [SamplingParams(temperature=t, seed=i, max_tokens=20, structured_outputs=so)
              for i, t in enumerate([0, 0.8])] + [GREEDY, GREEDY]
    with LLM("builtin:llama-tiny", **ENGINE) as one:
        want = tokens(one, params)
    with LLM("builtin:llama-tiny", rank0_own_process=True, tensor_parallel_size=2, **ENGINE) as llm:
        assert tokens(llm, params) == want
        assert_pool_whole(llm)


@pytest.mark.timeout(120)
def test_rank_0_killed_mid_generate_is_named():
    llm = LLM("builtin:llama-tiny", rank0_own_process=True, tensor_parallel_size=2, **ENGINE)
    pids = [p.pid for p in llm.engine.core.executor.procs]
    threading.Timer(0.3, os.kill, (pids[0], signal.SIGKILL)).start()
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 0 died \(exit code -9\)"):
        tokens(llm, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), PROMPTS * 8)
    assert time.monotonic() - t < 10
    llm.shutdown()
    time.sleep(0.5)
    assert all(map(gone, pids))


@pytest.mark.timeout(120)
def test_rank_0_raising_at_start_says_why():
    """An error in rank 0's process reaches the caller as its message, not only an exit code."""
    with pytest.raises(RuntimeError, match="worker rank 0 failed: ValueError: the KV cache has room for no block"):
        LLM("builtin:llama-tiny", rank0_own_process=True, tensor_parallel_size=2, cpu_kv_cache_gb=1e-9,
            **ENGINE)
    with LLM("builtin:llama-tiny", rank0_own_process=True, **ENGINE) as llm:  # the next one starts
        assert len(tokens(llm)[0]) == 12


@pytest.mark.timeout(240)
def test_dense_dp_cores_each_with_rank_0_in_its_own_process(expected):
    with LLM("builtin:qwen2-tiny", rank0_own_process=True, data_parallel_size=2, **ENGINE) as llm:
        assert tokens(llm) == expected
        assert_pool_whole(llm)


@pytest.mark.timeout(240)
def test_expert_dp_lockstep_through_the_cores_own_group():
    """dp=2 + EP: each core's rank 0 in its own process; the cores' wave check is their own all-reduce."""
    prompts = [{"prompt_token_ids": list(range(5 + i, 20 + 3 * i))} for i in range(6)]
    with LLM("builtin:qwen3-moe-tiny", **ENGINE) as one:
        want = tokens(one, prompts=prompts)
    with LLM("builtin:qwen3-moe-tiny", rank0_own_process=True, data_parallel_size=2,
             enable_expert_parallel=True, **ENGINE) as llm:
        assert tokens(llm, prompts=prompts) == want
        assert_pool_whole(llm)


def test_refused_where_the_core_needs_rank_0_in_process():
    with pytest.raises(ValueError, match="rank0_own_process is not supported with KV transfer"):
        LLM("builtin:llama-tiny", rank0_own_process=True, kv_offload_gb=0.01, **ENGINE)
