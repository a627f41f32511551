"""`longserve serve` as a user starts it: a tp=2 server gives one rank's tokens; SIGTERM drains
the stream in flight and leaves no engine core or worker process behind."""
import signal
import threading

import httpx
import pytest

from longserve import LLM, SamplingParams
from server_utils import Server, descendants, wait_gone

MODEL = "builtin:llama-tiny"


@pytest.mark.timeout(240)
def test_tp2_server_matches_one_rank_and_sigterm_drains_and_leaves_no_process(tmp_path):
    server = Server([MODEL, "-tp", "2", "--device", "cpu", "--max-model-len", "256"],
                    tmp_path / "server.log")
    proc, url = server.proc, server.url
    try:
        body = dict(model=MODEL, prompt=[1, 30, 31, 32], max_tokens=12, temperature=0, logprobs=0,
                    ignore_eos=True, return_tokens_as_token_ids=True)
        got = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        with LLM(MODEL, device="cpu", max_model_len=256) as one_rank:
            want = one_rank.generate([{"prompt_token_ids": [1, 30, 31, 32]}],
                                     SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                                     use_tqdm=False)[0].outputs[0]
        assert [int(t.split(":")[1]) for t in got["logprobs"]["tokens"]] == want.token_ids
        assert got["text"] == want.text

        workers = descendants(proc.pid)
        assert len(workers) >= 2  # the engine core and its tp rank 1 process
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
        assert wait_gone(workers)  # (multiprocessing's resource tracker leaves on EOF)
    finally:
        server.stop()
