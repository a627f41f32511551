"""Prefill/decode disaggregation as a user runs it: a `longserve serve` kv_producer, a
`longserve serve` kv_consumer and `longserve proxy` in front, real processes on loopback: the
README's pcp2 -> tp2 recipe run as written (against a colocated tp=2 engine), and tp1 -> tp2 x
dcp2, tp2 -> tp1, block size 8 in HND -> 16 (against one instance). Completions through the
proxy (plain and streamed, and prefilled on the consumer as the proxy's --local-prefill-tokens
leaves a short prompt) give the same greedy tokens; a client that leaves mid-stream loses
nothing; both pools are whole afterwards; no process is left."""
import json
import os
import re
import subprocess
import sys
import time

import httpx
import pytest

from longserve import LLM, SamplingParams
from longserve.engine.executor import free_port

MODEL = "builtin:llama-tiny"
PROMPT = [(7 * i + 3) % 400 + 5 for i in range(37)]
N = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def start(tmp_path, name, args):
    port = free_port()
    log = open(tmp_path / f"{name}.log", "w")
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.Popen([sys.executable, "-m", "longserve.entrypoints.cli", *args, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


def serve_args(role, layout, **extra_kvt):
    kvt = {"kv_role": role, "kv_lease_s": 20, "kv_transfer_timeout_s": 10, **extra_kvt}
    return ["serve", MODEL, *layout, "--device", "cpu", "--max-model-len", "256",
            "--uvicorn-log-level", "warning", "--kv-transfer-config", json.dumps(kvt)]


def wait_healthy(procs, url, tmp_path, within_s=150):
    deadline = time.monotonic() + within_s
    while True:
        for name, proc in procs.items():
            assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()
        assert time.monotonic() < deadline, "not healthy in time"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)


def kv_usage(url) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^vllm:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))


def prompt_tokens(url) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return float(re.search(r"^vllm:prompt_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M).group(1))


def stop(proc):
    """SIGTERM the session (a server and its rank processes, or a shell and what it started in
    the background), then SIGKILL whatever of it is left after 30 s."""
    deadline = time.monotonic() + 30
    for sig in (15, 9):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        while sig == 15 and session_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    proc.wait(10)


def session_alive(sid: int) -> bool:
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[3]) == sid and fields[0] != "Z":
                    return True
            except (OSError, IndexError, ValueError):
                pass
    return False


def one_instance(n=N):
    with LLM(MODEL, device="cpu", max_model_len=256) as one:
        return one.generate([{"prompt_token_ids": PROMPT}],
                            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids


def start_pd(tmp_path, procs, producer, consumer, producer_kvt=None):
    """Producer, consumer and proxy as real processes; the proxy's URL and both servers'."""
    procs["producer"], p_url = start(tmp_path, "producer",
                                     serve_args("kv_producer", producer, **(producer_kvt or {})))
    procs["consumer"], d_url = start(tmp_path, "consumer", serve_args("kv_consumer", consumer))
    wait_healthy(procs, p_url, tmp_path)
    wait_healthy(procs, d_url, tmp_path)
    procs["proxy"], url = start(tmp_path, "proxy", ["proxy", "--prefill", p_url, "--decode", d_url])
    wait_healthy(procs, url, tmp_path, 60)
    return url, p_url, d_url


def wait_pools_whole(p_url, d_url, within_s=30):
    deadline = time.monotonic() + within_s  # well inside the lease (20 s) + slack
    while (usage := (kv_usage(p_url), kv_usage(d_url))) != (0.0, 0.0):
        assert time.monotonic() < deadline, f"KV pools not whole (producer, consumer): {usage}"
        time.sleep(0.5)


def stop_all(procs):
    for proc in procs.values():
        stop(proc)
    assert not any(session_alive(proc.pid) for proc in procs.values())


BODY = dict(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0, ignore_eos=True,
            return_token_ids=True)


def readme_recipe() -> str:
    """The README's four-GPU block: a pcp=2 producer, a tp=2 consumer, the proxy, one curl."""
    with open(os.path.join(ROOT, "README.md")) as f:
        blocks = re.findall(r"```bash\n(.*?)```", f.read(), re.S)
    return next(b for b in blocks if "--kv-transfer-config producer" in b)


@pytest.mark.timeout(240)
def test_readme_pcp2_producer_tp2_consumer_proxy_match_colocated_tp2(tmp_path):
    """The README's recipe as written (engine cores as processes, as a user runs it; only its
    ports moved to free ones): its curl gives a colocated tp=2 engine's greedy text; then the
    same proxy streams, and loses nothing to a client that leaves mid-stream."""
    recipe = readme_recipe()
    body = json.loads(re.search(r"-d '(.*)'", recipe).group(1))
    with LLM(MODEL, device="cpu", max_model_len=256, tensor_parallel_size=2) as tp2:
        want_text = tp2.generate([body["prompt"]], SamplingParams(temperature=0, max_tokens=body["max_tokens"]),
                                 use_tqdm=False)[0].outputs[0].text
        want = tp2.generate([{"prompt_token_ids": PROMPT}], SamplingParams(
            temperature=0, max_tokens=N, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    ports = {p: str(free_port()) for p in ("8000", "8100", "8200")}
    script = re.sub(r"\b(8000|8100|8200)\b", lambda m: ports[m.group(1)], recipe)
    cli = f'longserve() {{ "{sys.executable}" -m longserve.entrypoints.cli "$@"; }}\n'
    env = dict(os.environ, PYTHONPATH=ROOT, LONGSERVE_ENABLE_MULTIPROCESSING="1")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "log", "w") as log:
        proc = subprocess.Popen(["bash", "-c", cli + script], stdout=out, stderr=log, env=env,
                                start_new_session=True)
    try:
        try:
            proc.wait(150)
        except subprocess.TimeoutExpired:
            pytest.fail("the recipe did not finish:\n" + (tmp_path / "log").read_text()[-3000:])
        text = (tmp_path / "out").read_text()  # curl's reply among the servers' access log lines
        reply = json.JSONDecoder().raw_decode(text[text.index('{"id"'):])[0]
        assert reply["choices"][0]["text"] == want_text
        assert "loading the KV" not in (tmp_path / "log").read_text()  # pulled, not recomputed

        url, p_url, d_url = (f"http://127.0.0.1:{ports[p]}" for p in ("8000", "8100", "8200"))
        got = []
        with httpx.stream("POST", f"{url}/v1/completions", json=dict(BODY, stream=True), timeout=60) as resp:
            assert resp.status_code == 200
            lines = [line for line in resp.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        for line in lines[:-1]:
            got += json.loads(line[len("data: "):])["choices"][0].get("token_ids") or []
        assert got == want

        # a client that leaves mid-stream: the decode instance aborts, the producer's blocks come back
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json=dict(BODY, max_tokens=200, stream=True)) as resp:
            next(line for line in resp.iter_lines() if line)
        wait_pools_whole(p_url, d_url)
    finally:
        stop_all({"recipe": proc})


@pytest.mark.timeout(180)
@pytest.mark.parametrize("producer, consumer, producer_kvt", [
    ([], ["-tp", "2", "-dcp", "2"], None),
    (["-tp", "2"], [], None),
    (["--block-size", "8"], ["--block-size", "16"], {"kv_buffer_layout": "HND"}),
], ids=["tp1->tp2xdcp2", "tp2->tp1", "bs8 HND->bs16"])
def test_other_layouts_behind_proxy_match_one_instance(tmp_path, producer, consumer, producer_kvt):
    want = one_instance()
    procs = {}
    try:
        url, p_url, d_url = start_pd(tmp_path, procs, producer, consumer, producer_kvt)
        assert kv_usage(p_url) == 0.0  # the server's warm-up holds no blocks under a lease
        r = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        # a proxy that leaves prompts this short to the consumer: the same tokens, the producer idle
        procs["local"], local_url = start(tmp_path, "local", ["proxy", "--prefill", p_url, "--decode", d_url,
                                                              "--local-prefill-tokens", str(len(PROMPT))])
        wait_healthy(procs, local_url, tmp_path, 60)
        produced = prompt_tokens(p_url)
        r = httpx.post(f"{local_url}/v1/completions", json=BODY, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want and prompt_tokens(p_url) == produced
        wait_pools_whole(p_url, d_url)
    finally:
        stop_all(procs)
