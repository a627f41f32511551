"""The engine core in a process of its own (one per DP rank): the same tokens as the engine in
this process, through `LLM.generate` and through the server (openai client); faults: a killed
core fails its streams within seconds and /health turns 503, a dense DP server goes on serving
with the cores it has left, SIGTERM leaves no process (a killed front end: test_shutdown.py);
data parallelism over two "hosts" on loopback (`--headless`)."""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from conftest import assert_pool_whole
from longserve import LLM, SamplingParams
from longserve.engine.core_client import InprocClient, MPClient
from longserve.engine.core_launch import ForkedProcess
from longserve.engine.executor import free_port
from server_utils import Server, concurrently, descendants, fixed_ports, wait_gone

MODEL = "builtin:llama-tiny"
ENGINE = dict(device="cpu", max_model_len=256)
ENGINE_ARGS = ["--device", "cpu", "--max-model-len", "256"]
PROMPTS = [[1, 30, 31, 32], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
           [100, 101, 102], [7] * 40]


def greedy(n=12):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)


def one_rank(model=MODEL, n=12) -> list[list[int]]:
    with LLM(model, **ENGINE) as llm:
        assert isinstance(llm.engine.client, InprocClient)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(n), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [dict(), dict(tensor_parallel_size=2),
                                    dict(prefill_context_parallel_size=2),
                                    dict(data_parallel_size=2, tensor_parallel_size=2)],
                         ids=["1", "tp2", "pcp2", "dp2-tp2"])  # (dense dp2 x tp2: each core its own rendezvous)
def test_generate_through_the_core_process_matches_in_process(layout, monkeypatch):
    want = one_rank()
    monkeypatch.setenv("LONGSERVE_ENABLE_MULTIPROCESSING", "1")
    with LLM(MODEL, **ENGINE, **layout) as llm:
        assert isinstance(llm.engine.client, MPClient)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert_pool_whole(llm)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_forked_or_spawned_core_gives_one_ranks_tokens_and_starts_again(method, monkeypatch):
    """Forked (a GPU engine's default) or spawned (a CPU engine's): one rank's tokens, the core
    named for `top`, a whole pool, and a second engine in the same process."""
    want = one_rank()
    monkeypatch.setenv("LONGSERVE_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.setenv("LONGSERVE_START_METHOD", method)
    for _ in range(2):
        with LLM(MODEL, **ENGINE, tensor_parallel_size=2) as llm:
            [core] = llm.engine.client.procs.values()
            tree = [core.pid, *descendants(core.pid)]  # the core, its worker, a resource tracker
            assert isinstance(core, ForkedProcess) == (method == "fork")
            names = [open(f"/proc/{p}/comm").read().strip() for p in tree]
            assert names[0] == "longserve-core" and "longserve-rank1" in names
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(), use_tqdm=False)
            assert [o.outputs[0].token_ids for o in outs] == want
            assert_pool_whole(llm)
        assert core.poll() is not None and wait_gone(tree)


def test_cores_fork_only_where_it_is_safe_and_free(monkeypatch):
    from types import SimpleNamespace

    from longserve.engine import core_launch

    def forks(device, ranks):
        return core_launch.fork_is_safe(SimpleNamespace(device=device, parallel=SimpleNamespace(world_size=ranks)))
    for name in ("LONGSERVE_START_METHOD", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(core_launch.os, "sched_getaffinity", lambda _: set(range(16)))
    monkeypatch.setattr(core_launch, "cuda_driver_started", lambda: False)
    assert forks("cuda", 2) and forks("cpu", 8)  # 15 spare cores / 8 ranks: one thread each anyway
    assert not forks("cpu", 2)  # seven threads a rank: spawned, so that it keeps them
    monkeypatch.setenv("OMP_NUM_THREADS", "4")  # the user's thread count: kept
    assert not forks("cpu", 8)
    monkeypatch.setenv("LONGSERVE_START_METHOD", "spawn")
    assert not forks("cuda", 2)
    monkeypatch.setenv("LONGSERVE_START_METHOD", "fork")
    assert forks("cpu", 2)
    monkeypatch.setattr(core_launch, "cuda_driver_started", lambda: True)  # a child could not use CUDA
    assert not forks("cuda", 2) and not forks("cpu", 2)


@pytest.mark.timeout(120)
def test_a_killed_forked_core_fails_the_call_at_once_and_leaves_nothing(monkeypatch):
    monkeypatch.setenv("LONGSERVE_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.setenv("LONGSERVE_START_METHOD", "fork")
    with LLM(MODEL, **ENGINE, tensor_parallel_size=2) as llm:
        [core] = llm.engine.client.procs.values()
        tree = [core.pid, *descendants(core.pid)]
        os.kill(core.pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(RuntimeError, match=r"engine core 0 died \(exit code -9\)"):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], greedy(200), use_tqdm=False)
        assert time.monotonic() - killed < 15
        assert wait_gone(tree, 10)  # its worker too: it follows its parent


def complete_all(url: str, model: str, n: int = 12) -> list[list[int]]:
    """Every prompt at once (concurrent requests), greedy, token ids back."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    return concurrently(lambda i: client.completions.create(
        model=model, prompt=PROMPTS[i], max_tokens=n, temperature=0,
        extra_body=dict(ignore_eos=True, return_token_ids=True)).choices[0].token_ids, len(PROMPTS))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("model,args", [
    (MODEL, ["-pcp", "2"]),
    (MODEL, ["-dp", "2"]),
    ("builtin:qwen3-moe-tiny", ["-dp", "2", "--enable-expert-parallel"]),
], ids=["pcp2", "dp2", "moe-dp2-ep"])
def test_server_matches_one_rank(model, args, tmp_path):
    want = one_rank(model)
    server = Server([model, *args, *ENGINE_ARGS], tmp_path / "server.log")
    try:
        assert complete_all(server.url, model) == want
    finally:
        server.stop()


def stream_lines(url: str, lines: list, started: threading.Event) -> None:
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json=dict(model=MODEL, prompt="Hello", max_tokens=200, stream=True,
                                    ignore_eos=True, return_token_ids=True)) as resp:
            for line in filter(None, resp.iter_lines()):
                lines.append(line)
                started.set()
    except httpx.HTTPError as e:
        lines.append(f"transport error: {e}")


def core_pids(server_pid: int) -> list[int]:
    """The engine-core processes: the server's children running `python -m longserve.engine`
    (spawned) or named longserve-core (forked)."""
    out = []
    for pid in descendants(server_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f, open(f"/proc/{pid}/comm") as g:
                if b"longserve.engine\x00" in f.read() + b"\x00" or g.read().strip() == "longserve-core":
                    out.append(pid)
        except OSError:
            pass
    return out


@pytest.mark.timeout(240)
def test_killed_core_fails_its_streams_health_503_and_sigterm_leaves_nothing(tmp_path):
    server = Server([MODEL, "-tp", "2", *ENGINE_ARGS, "--max-num-seqs", "8"], tmp_path / "server.log")
    try:
        tree = descendants(server.proc.pid)
        [core] = core_pids(server.proc.pid)
        streams = [([], threading.Event()) for _ in range(4)]
        readers = [threading.Thread(target=stream_lines, args=(server.url, *s)) for s in streams]
        for r in readers:
            r.start()
        assert all(started.wait(60) for _, started in streams)
        os.kill(core, signal.SIGKILL)
        killed = time.monotonic()
        for r in readers:
            r.join(30)
        assert time.monotonic() - killed < 15  # every stream ended within seconds...
        for lines, _ in streams:  # ... with an OpenAI-shaped error, not a clean finish
            assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2], lines[-3:]
            assert "engine core 0 died" in json.loads(lines[-2][len("data: "):])["error"]["message"]
        assert httpx.get(f"{server.url}/health").status_code == 503
        r = httpx.post(f"{server.url}/v1/completions", json=dict(model=MODEL, prompt="Hi"))
        assert r.status_code == 503 and "engine core 0 died" in r.json()["error"]["message"]
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) in (0, -signal.SIGTERM)
        assert wait_gone(tree)
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_a_forked_cores_signals_do_not_wake_the_front_ends_event_loop(monkeypatch):
    """An event loop's signal handlers (asyncio's add_signal_handler) set the process's wake-up
    fd; a forked core must not inherit it, or its own SIGTERM would reach the front end's loop."""
    import socket
    monkeypatch.setenv("LONGSERVE_ENABLE_MULTIPROCESSING", "1")
    monkeypatch.setenv("LONGSERVE_START_METHOD", "fork")
    ours, loops = socket.socketpair()
    ours.setblocking(False)
    loops.setblocking(False)
    previous = signal.set_wakeup_fd(loops.fileno())
    try:
        with LLM(MODEL, **ENGINE) as llm:
            [core] = llm.engine.client.procs.values()
            os.kill(core.pid, signal.SIGTERM)
            core.wait(10)
            time.sleep(0.2)
            with pytest.raises(BlockingIOError):  # nothing written to the front end's loop
                ours.recv(16)
    finally:
        signal.set_wakeup_fd(previous)
        ours.close()
        loops.close()


@pytest.mark.timeout(240)
def test_dense_dp_goes_on_serving_when_a_core_dies(tmp_path):
    server = Server([MODEL, "-dp", "2", *ENGINE_ARGS], tmp_path / "server.log")
    try:
        want = complete_all(server.url, MODEL)
        cores = core_pids(server.proc.pid)
        assert len(cores) == 2
        os.kill(cores[1], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while httpx.get(f"{server.url}/health").status_code == 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert complete_all(server.url, MODEL) == want  # the other core serves them all
    finally:
        server.stop()


@pytest.mark.timeout(240)
def test_two_hosts_on_loopback_give_one_ranks_tokens(tmp_path):
    """The front end runs DP rank 0; a `--headless` "host" runs DP rank 1 and connects to it."""
    want = one_rank()
    rpc = fixed_ports(3)  # commands, outputs, the rendezvous
    dp = ["-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-rpc-port", str(rpc),
          "--data-parallel-address", "127.0.0.1"]
    front = Server([MODEL, *dp, *ENGINE_ARGS], tmp_path / "front.log", wait=False)
    env = dict(os.environ, LONGSERVE_ENABLE_MULTIPROCESSING="1")
    headless = subprocess.Popen([sys.executable, "-m", "longserve.entrypoints.cli", "serve", MODEL,
                                 *dp, "--data-parallel-start-rank", "1", "--headless", *ENGINE_ARGS],
                                stdout=open(tmp_path / "headless.log", "w"), stderr=subprocess.STDOUT,
                                env=env)
    try:
        front.wait_healthy()
        assert complete_all(front.url, MODEL) == want
        stats = httpx.get(f"{front.url}/metrics").text  # both cores took requests
        assert "vllm:num_requests_running" in stats
        front.proc.send_signal(signal.SIGTERM)
        assert front.proc.wait(60) in (0, -signal.SIGTERM)
        assert headless.wait(60) == 0  # its core was told to stop by the front end
    finally:
        front.stop()
        if headless.poll() is None:
            headless.kill()
            headless.wait()
