"""Worker processes: a dead worker surfaces as an error in bounded time; nothing is left behind."""
import multiprocessing
import os
import signal
import time

import pytest

from longserve import LLM, SamplingParams


def test_killed_worker_surfaces_as_error_and_no_process_is_left():
    llm = LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=2, distributed_timeout_s=30)
    procs = list(llm.engine.core.executor.procs)
    ok = llm.generate([{"prompt_token_ids": [1, 5, 6, 7]}], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(ok[0].outputs[0].token_ids) == 4
    os.kill(procs[0].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 died"):
        llm.generate([{"prompt_token_ids": [1, 5, 6, 7]}], SamplingParams(max_tokens=50), use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.shutdown()
    assert all(not p.is_alive() for p in procs)


def test_worker_dying_before_it_joins_fails_start_up_fast(monkeypatch):
    """Also: workers fork from a forkserver started before the variable is set (by the engine
    here), and each still runs with the engine's environment of now."""
    LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=2).shutdown()
    monkeypatch.setenv("LONGSERVE_TEST_WORKER_EXIT", "2")
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 2 died .*starting"):
        LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=4, distributed_timeout_s=120)
    assert time.monotonic() - start < 60  # not the 120 s timeout
    time.sleep(0.5)
    assert not multiprocessing.active_children()  # the failed start left no process behind


def test_shutdown_leaves_no_process():
    llm = LLM("builtin:qwen2-tiny", device="cpu", prefill_context_parallel_size=2)
    procs = list(llm.engine.core.executor.procs)
    llm.generate(["hello"], SamplingParams(max_tokens=3), use_tqdm=False)
    llm.shutdown()
    assert procs and all(not p.is_alive() for p in procs)


def test_torchrun_launch_matches_one_rank():
    """`torchrun --nproc-per-node 2 ... -tp 2`: rank 0 drives and prints, rank 1 serves, both exit 0."""
    import json
    import subprocess
    import sys

    cmd = ["-m", "longserve.entrypoints.cli", "generate", "--device", "cpu", "--max-tokens", "8",
           "--model", "builtin:qwen3-tiny", "--prompt", "Hello there"]
    one = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=120)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          *cmd, "-tp", "2"], capture_output=True, text=True, timeout=180)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    text = lambda out: [json.loads(line)["text"] for line in out.splitlines() if line.startswith("{")]  # noqa: E731
    assert text(two.stdout) == text(one.stdout) and len(text(one.stdout)) == 1


@pytest.mark.timeout(30)
def test_watchdog_of_a_replica_without_workers_returns_at_once():
    """A DP rank of an expert model is a replica of one rank (world > 1, no children): the
    watchdog has nothing to watch and must not spin (it held the GIL and starved the rank's
    CUDA-graph capture on two H100s)."""
    import threading
    from types import SimpleNamespace

    from longserve.engine.executor import watch
    ex = SimpleNamespace(failure=None, _closing=False, procs=[], worker_ranks=range(1, 1),
                         _waiting=None, timeout=60.0)
    # watch takes a weakref-like callable; a daemon, so a spinning one cannot hold pytest open
    t = threading.Thread(target=watch, args=(lambda: ex,), daemon=True)
    t.start()
    t.join(timeout=2)
    assert not t.is_alive()
