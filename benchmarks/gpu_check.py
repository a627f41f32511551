"""GPU correctness checks (run on a CUDA machine; prints a table).

1. float32 on the GPU gives the CPU reference's greedy tokens on the built-in models.
2. bfloat16 agrees with float32 on >= 99% of greedy tokens over 256-token generations
   (counted up to the first divergence per request, then the rest compared as well).
3. CUDA-graph decode gives the tokens of eager decode.
"""
import argparse
import json
import os
import time

import torch

from longserve import LLM, SamplingParams


def prompts(n, lo, hi, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab - 3, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                               generator=g).tolist()} for _ in range(n)]


def run(model, ps, max_tokens, logprobs=None, **kw):
    llm = LLM(model, **kw)
    t = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate(ps, params, use_tqdm=False)
    dt = time.perf_counter() - t
    kv = llm.engine.kv
    whole = kv.num_free_blocks == kv.num_blocks
    llm.shutdown()
    del llm
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if logprobs:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], dt, whole
    return [o.outputs[0].token_ids for o in outs], dt, whole


def agreement(a, b):
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


def logprobs_close(a, b):
    """vLLM's rule for low precision: up to the first differing token the sequences agree,
    and there each model's token is among the other's top log-probabilities. Returns the
    share of requests that pass and the share of tokens before the first divergence."""
    ok, before = 0, 0
    for (ta, la), (tb, lb) in zip(a, b):
        i = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        before += len(ta) if i is None else i
        ok += i is None or (ta[i] in lb[i] and tb[i] in la[i])
    return ok / len(a), before / sum(len(t) for t, _ in a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parallel", default="{}", help="extra LLM kwargs as JSON, e.g. tp/pcp")
    ap.add_argument("--models", default="llama-tiny,qwen2-tiny,qwen3-tiny")
    ap.add_argument("--skip-bf16", action="store_true")
    args = ap.parse_args()
    par = json.loads(args.parallel)
    rows = []
    for name in args.models.split(","):
        model = f"builtin:{name}"
        ps = prompts(16, 5, 300, 512)
        cpu, _, _ = run(model, ps, 32, device="cpu", dtype="float32")
        gpu32, _, w1 = run(model, ps, 32, device="cuda", dtype="float32", **par)
        eager, _, w2 = run(model, ps, 32, device="cuda", dtype="float32", enforce_eager=True, **par)
        rows.append((name, "fp32 GPU vs CPU", agreement(gpu32, cpu), w1))
        rows.append((name, "CUDA graphs vs eager (fp32)", agreement(gpu32, eager), w2))
        if args.skip_bf16:
            continue
        long_ps = prompts(32, 16, 512, 512, seed=1)
        ref, _, _ = run(model, long_ps, 256, logprobs=5, device="cuda", dtype="float32", **par)
        bf, _, w3 = run(model, long_ps, 256, logprobs=5, device="cuda", dtype="bfloat16", **par)
        passed, before = logprobs_close(bf, ref)
        rows.append((name, "bf16 vs fp32, 256 tokens: requests logprob-close", passed, w3))
        rows.append((name, "bf16 vs fp32, 256 tokens: tokens before 1st divergence", before, w3))
    dev = torch.cuda.get_device_name()
    print(f"\n### GPU correctness ({dev}, {torch.cuda.device_count()} GPU(s), parallel={par})\n")
    print("| model | check | token agreement | pool whole |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {100 * r[2]:.2f}% | {r[3]} |")


if __name__ == "__main__":
    main()
