"""Engine lifecycle with real worker processes (tp=2, gloo): every start, stop, crash, hang and
interrupt ends in bounded time and leaves the process ready for the next engine, with no
worker process, process group or port left behind (checked by process id)."""
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

from longserve import LLM, SamplingParams
from longserve.engine.executor import process_state
from longserve.worker.worker import limit_cpu_threads

PROMPT = [{"prompt_token_ids": [1, 5, 6, 7]}]
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)


def tp2(**kw) -> LLM:
    return LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=2, max_model_len=512,
               **{"distributed_timeout_s": 30, **kw})


def tokens(llm, params=SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)):
    return llm.generate(PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids


def gone(pid: int) -> bool:
    """Dead and reaped: no process, not even a zombie, has this id."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def assert_clean(llm_or_pids, port=None):
    """The workers are gone; for an engine (not bare pids) the process groups are too."""
    pids = llm_or_pids if isinstance(llm_or_pids, list) else worker_pids(llm_or_pids)
    assert pids and all(gone(pid) for pid in pids), [process_state(p) for p in pids]
    assert isinstance(llm_or_pids, list) or not dist.is_initialized()
    if port is not None:  # the rendezvous port is free again
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def worker_pids(llm) -> list[int]:
    return [p.pid for p in llm.engine.core.executor.procs]


def timed(fn):
    t = time.monotonic()
    fn()
    return time.monotonic() - t


@pytest.fixture(scope="module")
def expected():
    with LLM("builtin:llama-tiny", device="cpu", max_model_len=512) as one:
        return tokens(one)


@pytest.mark.timeout(120)
def test_engines_built_one_after_another(expected):
    """shutdown() (twice), a context manager, and an engine never shut down that the next
    one replaces: each gives one rank's tokens and leaves nothing behind."""
    threads = torch.get_num_threads()
    first = tp2()
    assert tokens(first) == expected
    port = first.engine.core.executor.port
    first.shutdown()
    assert timed(first.shutdown) < 0.1  # idempotent
    assert_clean(first, port)
    with tp2() as second:
        assert tokens(second) == expected
    assert_clean(second, second.engine.core.executor.port)
    third = tp2()  # a notebook cell run again: the old engine is still referenced
    assert tokens(third) == expected
    fourth = tp2()
    assert_clean(worker_pids(third))
    with pytest.raises(RuntimeError, match="shut down when a newer one was built"):
        tokens(third)
    assert tokens(fourth) == expected
    fourth.shutdown()
    assert_clean(fourth)
    assert torch.get_num_threads() == threads  # the driver's own count is back


@pytest.mark.timeout(60)
def test_shutdown_frees_the_kv_cache_a_reference_still_holds():
    """The next engine checks the device's free memory: a caller's reference to the old engine, or
    to its caches, must not keep them (a P/D test's second consumer on a GPU failed so)."""
    llm = LLM("builtin:llama-tiny", device="cpu", max_model_len=512)
    caches = list(llm.engine.core.executor.driver.runner.kv_cache_dict.values())
    assert caches and all(c.untyped_storage().nbytes() > 0 for c in caches)
    llm.shutdown()
    assert all(c.untyped_storage().nbytes() == 0 for c in caches)


@pytest.mark.timeout(60)
def test_shutdown_frees_no_memory_under_a_running_step():
    """A step that still runs on another thread (one never ending, say) keeps its memory."""
    llm = LLM("builtin:llama-tiny", device="cpu", max_model_len=512)
    executor, release = llm.engine.core.executor, threading.Event()
    caches = list(executor.driver.runner.kv_cache_dict.values())
    holder = threading.Thread(target=lambda: executor._in_step("a test step", release.wait, 30))
    holder.start()
    try:
        llm.shutdown()
        assert all(c.untyped_storage().nbytes() > 0 for c in caches)
    finally:
        release.set()
        holder.join()


@pytest.mark.timeout(120)
def test_failed_starts_then_a_good_one(monkeypatch, expected):
    monkeypatch.setenv("LONGSERVE_TEST_WORKER_EXIT", "1")  # a worker dies before it joins
    with pytest.raises(RuntimeError, match="worker rank 1 died .*starting"):
        tp2()
    monkeypatch.delenv("LONGSERVE_TEST_WORKER_EXIT")
    from longserve.worker.worker import Worker

    def broken(self, num_blocks):  # rank 0 fails after the groups exist and the workers wait
        raise MemoryError("no room for the KV cache")
    with monkeypatch.context() as m:
        m.setattr(Worker, "init_cache", broken)
        with pytest.raises(MemoryError):
            tp2()
    time.sleep(0.2)
    assert not dist.is_initialized() and not __import__("multiprocessing").active_children()
    llm = tp2()
    assert tokens(llm) == expected
    llm.shutdown()
    assert_clean(llm)


@pytest.mark.timeout(120)
def test_worker_killed_mid_generate_then_a_new_engine(expected):
    llm = tp2()
    pids = worker_pids(llm)
    threading.Timer(0.5, os.kill, (pids[0], signal.SIGKILL)).start()
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 died \(exit code -9\) while"):
        tokens(llm, LONG)
    assert time.monotonic() - t < 10
    with pytest.raises(RuntimeError, match="worker rank 1 died"):  # stays failed, says why
        tokens(llm)
    assert_clean(pids)  # the crashed engine's workers were reaped without shutdown()
    again = tp2()
    assert tokens(again) == expected
    again.shutdown()
    llm.shutdown()
    assert_clean(again)


@pytest.mark.timeout(120)
def test_stopped_worker_is_named_within_the_timeout():
    """SIGSTOP: no connection closes, only the bounded collectives can notice."""
    llm = tp2(distributed_timeout_s=8)
    tokens(llm)
    pids = worker_pids(llm)
    os.kill(pids[0], signal.SIGSTOP)
    t = time.monotonic()
    stopped = r"worker rank 1 \(its process is stopped\) did not respond within 8 s while "
    with pytest.raises(RuntimeError, match=stopped + "(taking the plan of|running) step"):
        tokens(llm)
    assert time.monotonic() - t < 16
    assert timed(llm.shutdown) < 5
    assert_clean(pids)


def on_fifth_layer_call(llm, action) -> None:
    """Run `action` on rank 0 inside a step (between two layers), while rank 1 is mid-step."""
    layer, calls = llm.engine.core.executor.driver.runner.model.layers[1], []
    real = layer.forward

    def hooked(*a, **kw):
        calls.append(1)
        if len(calls) == 5:
            action()
        return real(*a, **kw)
    layer.forward = hooked


@pytest.mark.timeout(120)
def test_interrupt_in_the_front_end_leaves_the_engine_usable(expected):
    """Ctrl-C reaches the front end (a notebook's interrupt) while the engine core is mid-step:
    generate() stops and aborts its requests, the core finishes its step undisturbed (the ranks
    stay in step), and the engine is reusable."""
    llm = tp2()
    pids = worker_pids(llm)
    on_fifth_layer_call(llm, lambda: signal.raise_signal(signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        tokens(llm, LONG)
    assert llm.engine.pool_states()[0]["unfinished"] is False  # the abort reached the core
    assert tokens(llm) == expected
    assert len(tokens(llm, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))) == 50
    assert timed(llm.shutdown) < 5
    assert_clean(pids)


@pytest.mark.timeout(120)
def test_step_cut_short_on_the_driver_stops_the_workers(expected):
    """An exception inside rank 0's step (raised between two layers): the ranks are out of
    step, so the workers are stopped at once and the engine says so; the next engine works."""
    llm = tp2()
    pids = worker_pids(llm)

    def fail():
        raise ValueError("injected")
    on_fifth_layer_call(llm, fail)
    with pytest.raises(RuntimeError, match="step 5 was cut short on rank 0 by ValueError"):
        tokens(llm, LONG)
    assert all(gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="step 5 was cut short on rank 0 by ValueError"):
        tokens(llm)
    assert timed(llm.shutdown) < 1
    assert_clean(pids)
    again = tp2()
    assert tokens(again) == expected
    again.shutdown()


@pytest.mark.timeout(90)
def test_exit_without_shutdown_leaves_no_worker(tmp_path):
    """The atexit hook shuts down an engine the script forgot."""
    script = tmp_path / "forgot.py"
    script.write_text(textwrap.dedent("""
        from longserve import LLM, SamplingParams
        if __name__ == "__main__":
            llm = LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=2)
            llm.generate([{"prompt_token_ids": [1, 2]}], SamplingParams(max_tokens=2),
                         use_tqdm=False)
            print("pids", *[p.pid for p in llm.engine.core.executor.procs], flush=True)
    """))
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=60, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    pids = [int(x) for line in run.stdout.splitlines() if line.startswith("pids")
            for x in line.split()[1:]]
    deadline = time.monotonic() + 5
    while not all(gone(p) or process_state(p) == "Z" for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert pids and all(gone(p) or process_state(p) == "Z" for p in pids)


def test_cpu_threads_are_shared_among_local_ranks(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
        torch.set_num_threads(8)
        limit_cpu_threads(2)  # one core is the front end's: (8 - 1) // 2
        assert torch.get_num_threads() == 3
        limit_cpu_threads(16)  # more ranks than cores: one thread each
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)  # the user's smaller choice stays
        limit_cpu_threads(2)
        assert torch.get_num_threads() == 2
        torch.set_num_threads(8)
        monkeypatch.setenv("OMP_NUM_THREADS", "8")  # set by the user: left alone
        limit_cpu_threads(2)
        assert torch.get_num_threads() == 8
    finally:
        torch.set_num_threads(before)
