"""Several API-server processes on one port (`serve --api-server-count 2`, dp=2, SmolLM2): one
rank's greedy text, /metrics totals of every API server summed, /health 503 on a dead API
server, and SIGTERM stops every process."""
import os
import signal
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import per_request
from longserve import LLM, SamplingParams
from server_utils import Server, concurrently, descendants, wait_gone

PROMPTS = ["The capital of France is", "Three primary colors are", "Once upon a time",
           "def fibonacci(n):", "The quick brown fox", "Water boils at"]


def totals(url: str) -> dict:
    text = httpx.get(f"{url}/metrics").text
    return {s.name + str(sorted((k, v) for k, v in s.labels.items() if k != "model_name")): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def health(url: str) -> int | None:
    """/health's status; None: the connection went to the dead API server's socket (reset)."""
    try:
        return httpx.get(f"{url}/health").status_code
    except httpx.TransportError:
        return None


def complete_all(url: str) -> list[str]:
    """Every prompt at once, each on a connection of its own (the kernel spreads them)."""
    body = dict(max_tokens=12, temperature=0, ignore_eos=True)
    return concurrently(lambda i: httpx.post(f"{url}/v1/completions", json=dict(body, prompt=PROMPTS[i]),
                                             timeout=120).json()["choices"][0]["text"], len(PROMPTS))


@pytest.mark.timeout(300)
def test_two_api_servers_dp2_match_one_rank_sum_metrics_and_stop_on_sigterm(smollm2_gguf, tmp_path):
    with LLM(smollm2_gguf, device="cpu", max_model_len=512) as llm:
        want = [o.outputs[0].text for o in llm.generate(
            PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)]
    server = Server([smollm2_gguf, "-dp", "2", "--api-server-count", "2", "--device", "cpu",
                     "--max-model-len", "512"], tmp_path / "server.log")
    try:
        tree = descendants(server.proc.pid)
        assert len(tree) >= 4  # two engine cores, two API servers
        before = totals(server.url)
        assert complete_all(server.url) == want
        for _ in range(4):  # whichever API server answers the scrape, the sums of both
            after = totals(server.url)
            delta = lambda name: after.get(name, 0) - before.get(name, 0)  # noqa: E731
            assert delta("vllm:request_success_total[('finished_reason', 'length')]") == len(PROMPTS)
            assert delta("vllm:generation_tokens_total[]") == 12 * len(PROMPTS)
            assert delta("vllm:e2e_request_latency_seconds_count[]") == len(PROMPTS)
        api_servers = [p for p in tree if b"api_servers" in open(f"/proc/{p}/cmdline", "rb").read()]
        os.kill(api_servers[1], signal.SIGKILL)
        killed = time.monotonic()
        while any(health(server.url) in (200, None) for _ in range(4)):
            assert time.monotonic() - killed < 2, "a dead API server left /health at 200"
            time.sleep(0.05)
        assert "died" in httpx.get(f"{server.url}/health").text
        server.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert server.proc.wait(10) == 0
        assert wait_gone(tree, timeout=5) and time.monotonic() - stopped < 5
    finally:
        server.stop()


def test_a_steps_outputs_reach_only_the_front_end_that_sent_each_request():
    """Owners.route splits one step's message (its columns and its per-request outputs) by front
    end: an aborted request's token goes nowhere, an ended request is forgotten."""
    from longserve.engine.core_proc import Owners
    from longserve.engine.messages import EngineCoreOutput, EngineCoreOutputs, decode_outputs, encode
    owners = Owners(2)
    owners.add(["a", "b"], 0)
    owners.add(["c", "d"], 1)
    owners.drop(["b"])  # aborted by its front end while the step ran
    msg = EngineCoreOutputs(0, [EngineCoreOutput("d", [9], finish_reason="length")],
                            token_req_ids=["a", "b", "c"], token_ids=[1, 2, 3])
    parts = [decode_outputs(encode(p)) for p in owners.route(msg)]
    assert [(p.token_req_ids, p.token_ids) for p in parts] == [(["a"], [1]), (["c"], [3])]
    assert [[o.request_id for o in p.outputs] for p in parts] == [[], ["d"]]
    assert [(o.request_id, o.new_token_ids) for o in per_request(parts[1])] == [("c", [3]), ("d", [9])]
    assert owners.of == {"a": 0, "c": 1}
