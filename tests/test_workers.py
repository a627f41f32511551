"""Worker processes: a dead worker surfaces as an error in bounded time; nothing is left behind."""
import os
import signal
import time

import pytest

from longserve import LLM, SamplingParams


def test_killed_worker_surfaces_as_error_and_no_process_is_left():
    llm = LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=2, distributed_timeout_s=30)
    procs = list(llm.engine.executor.procs)
    ok = llm.generate([{"prompt_token_ids": [1, 5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 4
    os.kill(procs[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 died"):
        llm.generate([{"prompt_token_ids": [1, 5, 6, 7]}], SamplingParams(max_tokens=50), use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.shutdown()
    assert all(not p.is_alive() for p in procs)


def test_shutdown_leaves_no_process():
    llm = LLM("builtin:qwen2-tiny", device="cpu", prefill_context_parallel_size=2)
    procs = list(llm.engine.executor.procs)
    llm.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    llm.shutdown()
    assert procs and all(not p.is_alive() for p in procs)
