"""`longserve serve` and `longserve chat` as a user starts them: a tp=2 server gives one rank's
tokens; SIGTERM drains the stream in flight and leaves no engine core or worker process behind;
Ctrl-C past --shutdown-timeout ends it with an error event, no traceback; a taken port fails at
once; a piped chat keeps the conversation."""
import io
import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from longserve import LLM, SamplingParams
from longserve.engine import llm_engine
from longserve.entrypoints.cli import main as cli_main
from server_utils import Server, descendants, wait_gone

MODEL = "builtin:llama-tiny"


def stream_in_flight(url: str, **body) -> tuple[list[str], threading.Thread]:
    """A streamed completion read on a thread (its SSE lines so far), once its first line came."""
    lines, started = [], threading.Event()

    def stream():
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json=dict(prompt="Hello", stream=True, ignore_eos=True,
                                    return_token_ids=True, **body)) as resp:
            for line in filter(None, resp.iter_lines()):
                lines.append(line)
                started.set()
    reader = threading.Thread(target=stream)
    reader.start()
    assert started.wait(60)
    return lines, reader

@pytest.mark.timeout(240)
@pytest.mark.parametrize("placement", [[], ["--rank0-own-process"]], ids=["rank0-in-core", "rank0-own"])
def test_tp2_server_matches_one_rank_and_sigterm_drains_and_leaves_no_process(tmp_path, placement):
    server = Server([MODEL, "-tp", "2", "--device", "cpu", "--max-model-len", "256", *placement],
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
        # in flight when SIGTERM comes: it is drained, not cut
        lines, reader = stream_in_flight(url, model=MODEL, max_tokens=60)
        at_signal = len(lines)
        proc.send_signal(signal.SIGTERM)
        reader.join(60)
        assert proc.wait(60) in (0, -signal.SIGTERM)
        assert lines[-1] == "data: [DONE]" and '"finish_reason":"length"' in lines[-2]
        assert len(lines) > at_signal + 2  # tokens kept coming after SIGTERM: drained, not cut
        assert wait_gone(workers)  # (multiprocessing's resource tracker leaves on EOF)
        assert "exited with an error" not in server.log_text()  # every rank said goodbye
    finally:
        server.stop()


@pytest.mark.timeout(120)
def test_ctrl_c_with_a_stream_in_flight_ends_it_with_an_error_event_within_the_timeout(tmp_path):
    server = Server([MODEL, "--device", "cpu", "--max-model-len", "4096", "--shutdown-timeout", "3"],
                    tmp_path / "server.log")  # (uvicorn logs its errors, "Exception in ASGI ...")
    try:
        lines, reader = stream_in_flight(server.url, max_tokens=4000)  # more than the drain lets finish
        workers = descendants(server.proc.pid)
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(30) == 0
        took = time.monotonic() - t0
        reader.join(10)
        assert lines[-1] == "data: [DONE]" and "the server is shutting down" in lines[-2]
        log = server.log_text()
        assert "1 requests still in flight were aborted" in log
        assert "Traceback" not in log and "Exception in ASGI" not in log and "CancelledError" not in log
        assert took < 3 + 2  # the drain ends a second before --shutdown-timeout (3 s on an idle machine)
        assert wait_gone(workers)
    finally:
        server.stop()


@pytest.mark.timeout(60)
def test_a_taken_port_exits_at_once_before_any_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        t0 = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "longserve.entrypoints.cli", "serve", MODEL,
                               "--device", "cpu", "--port", str(taken.getsockname()[1])],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "cannot listen on 127.0.0.1" in done.stderr, done.stderr
    assert "in use" in done.stderr and "Traceback" not in done.stderr
    assert "engine" not in done.stderr  # nothing loaded
    assert time.monotonic() - t0 < 10  # ~2 s on an idle machine: Python and torch's import


@pytest.mark.timeout(120)
def test_chat_piped_answers_each_line_and_keeps_the_conversation(monkeypatch, capsys):
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
    seen, render = [], llm_engine.render_chat

    def render_chat(info, messages, add_generation_prompt, chat_template=None):  # builtin: no template
        seen.append([dict(m) for m in messages])
        return render(info, messages, add_generation_prompt, template)
    monkeypatch.setattr(llm_engine, "render_chat", render_chat)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n\nAnd again\n"))
    cli_main(["chat", "--model", MODEL, "--device", "cpu", "--max-tokens", "5", "--ignore-eos"])
    answers = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [a["prompt"] for a in answers] == ["Hello there", "And again"]
    assert all(a["text"] and a["finish_reason"] == "length" for a in answers)
    assert seen == [[dict(role="user", content="Hello there")],
                    [dict(role="user", content="Hello there"),
                     dict(role="assistant", content=answers[0]["text"]),
                     dict(role="user", content="And again")]]
