"""AIPerf (NVIDIA's serving benchmark) against `longserve serve`, streaming completions and chat.

Starts the server, gives AIPerf a local tokenizer folder (made from the GGUF's metadata for
a .gguf model; a built-in's own folder), runs one `aiperf profile` per endpoint at a fixed
concurrency with synthetic prompts of fixed length, and prints AIPerf's numbers as a table.
AIPerf is heavy (~1 GB with its dependencies), so it is not a test extra: install it into
its own environment and point --aiperf at it.

    python -m venv /tmp/aiperf && /tmp/aiperf/bin/pip install aiperf
    python benchmarks/bench_aiperf.py --aiperf /tmp/aiperf/bin/aiperf -- smollm2 --device cpu
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from bench_serving import start_server  # noqa: E402

from longserve.engine.executor import free_port  # noqa: E402
from longserve.models.builtin import resolve_model  # noqa: E402

# a template for models without one (the built-in shapes): chat needs some rendering
PLAIN_CHAT = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
              "{% if add_generation_prompt %}assistant:{% endif %}")


def tokenizer_folder(model: str, tmp: str) -> str:
    path = resolve_model(model)
    if not path.endswith(".gguf"):
        return path  # an HF folder or a built-in's: tokenizer.json is there
    from transformers import AutoTokenizer
    folder = os.path.join(tmp, "tokenizer")
    AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).save_pretrained(folder)
    return folder


def in_vocab_bias(model: str, tokenizer: str) -> list[str]:
    """A built-in's random weights emit ids from the whole vocabulary, most of them beyond
    its small tokenizer's, which decode to no text that AIPerf could time: a logit bias keeps
    them inside (a real model needs none)."""
    if not model.startswith("builtin:"):
        return []
    from tokenizers import Tokenizer
    n = Tokenizer.from_file(os.path.join(tokenizer, "tokenizer.json")).get_vocab_size()
    return ["--extra-inputs", json.dumps({"logit_bias": {str(t): 100 for t in range(n)}})]


def profile(args, url: str, tokenizer: str, endpoint: str, out: str) -> dict:
    cmd = [args.aiperf, "profile", "--model", args.served_name, "--url", url,
           "--endpoint-type", endpoint, "--streaming", "--tokenizer", tokenizer,
           "--request-count", str(args.requests), "--concurrency", str(args.concurrency),
           "--prompt-input-tokens-mean", str(args.isl), "--prompt-input-tokens-stddev", "0",
           "--prompt-output-tokens-mean", str(args.osl), "--prompt-output-tokens-stddev", "0",
           "--extra-inputs", "ignore_eos:true", "--use-server-token-count",
           *in_vocab_bias(args.engine_model, tokenizer), "--warmup-request-count", str(args.concurrency),
           "--output-artifact-dir", out, "--ui-type", "simple"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if not args.verbose else None)
    with open(os.path.join(out, "profile_export_aiperf.json")) as f:
        return json.load(f)


def row(endpoint: str, r: dict) -> str:
    ttft, itl = r["time_to_first_token"], r["inter_token_latency"]
    return (f"| {endpoint} | {r['request_throughput']['avg']:.2f} | {r['output_token_throughput']['avg']:,.1f} "
            f"| {ttft['avg']:.1f} / {ttft['p50']:.1f} / {ttft['p99']:.1f} "
            f"| {itl['avg']:.2f} / {itl['p50']:.2f} / {itl['p99']:.2f} | {r['request_latency']['p50']:.0f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--aiperf", default="aiperf", help="the aiperf executable")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--isl", type=int, default=128, help="prompt tokens")
    ap.add_argument("--osl", type=int, default=64, help="output tokens")
    ap.add_argument("--served-name", default="longserve")
    ap.add_argument("--endpoints", default="completions,chat")
    ap.add_argument("--out", default="aiperf-results")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("engine", nargs=argparse.REMAINDER, help="-- MODEL [longserve serve flags]")
    args = ap.parse_args()
    engine = [a for a in args.engine if a != "--"] or ["smollm2"]
    args.engine_model = engine[0]
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = tokenizer_folder(engine[0], tmp)
        template = [] if engine[0] == "smollm2" or engine[0].endswith(".gguf") else ["--chat-template", PLAIN_CHAT]
        server = start_server([engine[0], "--served-model-name", args.served_name, *template, *engine[1:]],
                              port, 900)
        try:
            rows = {ep: profile(args, f"http://127.0.0.1:{port}", tokenizer, ep, os.path.join(args.out, ep))
                    for ep in args.endpoints.split(",")}
        finally:
            server.terminate()
            server.wait(60)
    print(f"\n{args.requests} requests, concurrency {args.concurrency}, {args.isl} prompt + {args.osl} "
          f"output tokens, streaming; model {' '.join(engine)}\n")
    print("| endpoint | req/s | output tok/s | TTFT avg / p50 / p99 (ms) | ITL avg / p50 / p99 (ms) | latency p50 (ms) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for ep, r in rows.items():
        print(row(ep, r))


if __name__ == "__main__":
    main()
