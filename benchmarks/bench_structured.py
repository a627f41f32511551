"""Structured outputs' cost: the decode step time of a batch of N requests constrained by a JSON
schema (xgrammar bitmask built on the host, applied to the logits on the device) against N
free ones, with asynchronous scheduling on and off. The engine core is paused and stepped
here; a step's time is one `EngineCore.step` call (with asynchronous scheduling, the real
step period). Only decode steps with the whole batch count. Also: the host time of the
bitmask per step (it overlaps the forward when scheduling is asynchronous).

    python benchmarks/bench_structured.py                       # GPU, qwen3-0.6b-shape, 64 + 64
    python benchmarks/bench_structured.py --model smollm2    # the real model and tokenizer
    python benchmarks/bench_structured.py --device cpu --model qwen3-tiny --num-requests 16
"""
import argparse
import json
import os
import time

import numpy as np
import torch

from longserve import LLM, SamplingParams
from longserve.sampling_params import StructuredOutputsParams

os.environ.setdefault("LONGSERVE_ENABLE_MULTIPROCESSING", "0")  # the core is stepped here

# a record whose first field is free text: a greedy random model stays inside it for long
SCHEMA = {"type": "object", "required": ["summary", "kind", "count", "tags"],
          "properties": {"summary": {"type": "string"}, "kind": {"enum": ["a", "b", "c"]},
                         "count": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}}


def prompts(n, length, vocab, seed):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(100, min(vocab, 480) - 1, length).tolist()} for _ in range(n)]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def timing(obj, name: str, times: dict):
    """Wrap obj.<name> so each call's host seconds go to times[name]; returns the original."""
    real = getattr(obj, name)

    def timed(*a, **kw):
        t = time.perf_counter()
        out = real(*a, **kw)
        times.setdefault(name, []).append(time.perf_counter() - t)
        return out
    setattr(obj, name, timed)
    return real


def decode_steps(llm, n, inp, steps, structured, seed):
    """Median full-batch decode step (s), host ms per step of the parts that grow with
    structured requests (bitmask: the matchers' masks; update_from_output: apply, where the
    matchers accept the tokens; schedule: the plan), steps counted."""
    so = StructuredOutputsParams(json=SCHEMA) if structured else None
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, structured_outputs=so)
    vocab = llm.config.model.vocab_size
    with llm.engine.client.paused() as core:
        # _sample_masked: waiting for the mask, then the sampling launch; execute_async: the
        # next step's launch; _apply: waiting for the step's ids, then update_from_output
        times, parts = {}, [(core.structured, "bitmask"), (core.scheduler, "update_from_output"),
                            (core.scheduler, "schedule"), (core, "_sample_masked"),
                            (core.executor, "execute_async"), (core, "_apply")]
        reals = [timing(obj, name, times) for obj, name in parts]
        for p in prompts(n, inp, vocab, seed):
            core.add_request(llm.engine.make_request(p, params))
        start = len(core.decode_steps)
        sync(llm.config.device)
        while core.has_work():
            core.step()
        sync(llm.config.device)
        for (obj, name), real in zip(parts, reals):
            setattr(obj, name, real)
        full = [s for tokens, s, _ in core.decode_step_log(start) if tokens == n]
    host = {name: round(1e3 * float(np.median(t)), 3) for name, t in times.items()}
    return float(np.median(full)) if full else float("nan"), host, len(full)


def run(args, asynchronous):
    gpu = args.device == "cuda"
    real = args.model == "smollm2"  # the real model: its weights and its 49,152-token tokenizer
    llm = LLM(args.model if real else f"builtin:{args.model}", load_format="auto" if real else "dummy",
              device=args.device, dtype="bfloat16" if gpu else "float32", max_model_len=args.input_len + args.steps + 64,
              max_num_seqs=args.num_requests, async_scheduling=asynchronous)
    decode_steps(llm, args.num_requests, args.input_len, 4, True, 1)  # warm-up (both kinds)
    decode_steps(llm, args.num_requests, args.input_len, 4, False, 2)
    free, free_host, n_free = decode_steps(llm, args.num_requests, args.input_len, args.steps, False, 3)
    constrained, host, n_con = decode_steps(llm, args.num_requests, args.input_len, args.steps, True, 4)
    llm.shutdown()
    return dict(mode="async" if asynchronous else "sync", free_ms=round(1e3 * free, 2),
                structured_ms=round(1e3 * constrained, 2),
                overhead_pct=round(100 * (constrained / free - 1), 1),
                mask_ms_per_step=host.get("bitmask", 0.0), host_ms_free=free_host,
                host_ms_structured=host, full_steps=(n_free, n_con))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b-shape")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="decode steps (max_tokens) per request")
    ap.add_argument("--modes", default="async,sync")
    args = ap.parse_args()
    rows = [run(args, m == "async") for m in args.modes.split(",")]
    for r in rows:
        print(json.dumps(r), flush=True)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\n### Structured outputs, {args.model}, {args.num_requests} requests, {args.input_len} "
          f"prompt tokens, decode steps of the full batch ({name})\n")
    print("| scheduling | free step (ms) | JSON-schema step (ms) | overhead | bitmask (host ms/step) | steps timed |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['free_ms']} | {r['structured_ms']} | {r['overhead_pct']}% | "
              f"{r['mask_ms_per_step']} | {r['full_steps'][0]} / {r['full_steps'][1]} |")


if __name__ == "__main__":
    main()
