"""`longserve serve` as a user starts it: a tp=2 server gives one rank's tokens; SIGTERM drains
the stream in flight and leaves no worker process behind."""
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from longserve import LLM, SamplingParams
from longserve.engine.executor import free_port

MODEL = "builtin:llama-tiny"


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie has exited
    except OSError:
        return True


@pytest.mark.timeout(240)
def test_tp2_server_matches_one_rank_and_sigterm_drains_and_leaves_no_process(tmp_path):
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "longserve.entrypoints.cli", "serve", MODEL, "-tp", "2",
                             "--device", "cpu", "--max-model-len", "256", "--port", str(port),
                             "--uvicorn-log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 150
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        body = dict(model=MODEL, prompt=[1, 30, 31, 32], max_tokens=12, temperature=0, logprobs=0,
                    ignore_eos=True, return_tokens_as_token_ids=True)
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        with LLM(MODEL, device="cpu", max_model_len=256) as one_rank:
            want = one_rank.generate([{"prompt_token_ids": [1, 30, 31, 32]}],
                                     SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                     use_tqdm=False)[0].outputs[0]
        assert [int(t.split(":")[1]) for t in got["logprobs"]["tokens"]] == want.token_ids
        assert got["text"] == want.text

        workers = children(proc.pid)
        assert workers  # the tp rank 1 process
        lines, started = [], threading.Event()

        def stream():  # in flight when SIGTERM comes: it is drained, not cut
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                              json=dict(model=MODEL, prompt="Hello", max_tokens=60, stream=True,
                                        ignore_eos=True, return_token_ids=True)) as resp:
                for line in filter(None, resp.iter_lines()):
                    lines.append(line)
                    started.set()
        reader = threading.Thread(target=stream)
        reader.start()
        assert started.wait(60)
        at_signal = len(lines)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
        assert len(lines) > at_signal + 2  # tokens kept coming after SIGTERM: drained, not cut
        deadline = time.monotonic() + 10  # (multiprocessing's resource tracker leaves on EOF)
        while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(gone(pid) for pid in workers)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
