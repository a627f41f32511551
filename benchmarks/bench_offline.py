"""Offline batch throughput on one GPU: LongServe vs HF transformers `generate`, same GPU, same run.

Workload (performance.md): N prompts x (1024 in + 256 out), greedy, random weights at the
Qwen3-0.6B and Llama-3-8B shapes. Also the decode step time against the bytes floor
(weights + KV read per step at 4.2 TB/s on H200; pass --bw for the GPU at hand).
"""
import argparse
import json
import time

import numpy as np
import torch

from longserve import LLM, SamplingParams

SHAPES = {"qwen3-0.6b-shape": dict(params=0.596e9, kv_per_tok=28 * 2 * 8 * 128 * 2),
          "llama3-8b-shape": dict(params=8.03e9, kv_per_tok=32 * 2 * 8 * 128 * 2)}


def random_prompts(llm, n, length, seed):
    rng = np.random.default_rng(seed)
    vocab = llm.config.model.vocab_size
    return [{"prompt_token_ids": rng.integers(100, vocab - 100, length).tolist()} for _ in range(n)]


def ours(model, n, inp, out, profile=False, **kw):
    llm = LLM(f"builtin:{model}", load_format="dummy", dtype="bfloat16", max_model_len=inp + out + 16,
              max_num_seqs=n, **kw)
    # warm-up over the same mix of batch shapes (Triton compiles each kernel variant once), on
    # other prompts: the timed run must not hit the prefix cache
    llm.generate(random_prompts(llm, n, inp, 7), SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    steps = record_steps(llm)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(random_prompts(llm, n, inp, 0),
                        SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == out for o in outs)
    print_step_breakdown(steps, total)
    if profile:
        profile_steps(llm, n, inp)
    step = decode_step_time(llm, n, inp)
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()
    return total, step


def record_steps(llm):
    """Wrap the executor: per step (decode rows, prefill tokens, seconds in execute)."""
    ex, log = llm.engine.executor, []
    inner = ex.execute

    def timed(plan):
        t = time.perf_counter()
        res = inner(plan)
        dec = sum(1 for r in plan.requests if r.num_computed_tokens > 0 and len(r.token_ids) == 1)
        log.append((dec, plan.num_tokens - dec, time.perf_counter() - t))
        return res
    ex.execute = timed
    return log


def print_step_breakdown(log, total):
    mixed = [x for x in log if x[1] > 0]
    dec = [x for x in log if x[1] == 0]
    ex = sum(x[2] for x in log)
    print(f"  steps {len(log)}: {len(mixed)} with prefill ({sum(x[2] for x in mixed):.2f} s, "
          f"{sum(x[1] for x in mixed)} prefill tokens), {len(dec)} decode-only "
          f"({sum(x[2] for x in dec):.2f} s, median {1e3 * np.median([x[2] for x in dec] or [0]):.2f} ms); "
          f"execute {ex:.2f} s of {total:.2f} s (the rest: scheduler, outputs)", flush=True)
    for d, p, dt in sorted(log, key=lambda x: -x[2])[:5]:
        print(f"    slow step: {d} decode rows + {p} prefill tokens: {1e3 * dt:.1f} ms", flush=True)


def profile_steps(llm, n, inp):
    """Kernel-time table of a few mixed and decode steps (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile
    eng = llm.engine
    for p in random_prompts(llm, n, inp, 3):
        eng.add_request(eng.make_request(p, SamplingParams(max_tokens=12, ignore_eos=True)))
    for _ in range(3):
        eng.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.step()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)
    while eng.has_unfinished():
        eng.step()


def decode_step_time(llm, n, ctx):
    """Median time of a decode step with all n requests in the batch, context ~ctx (timed
    through the engine: host work included). Requests run long enough that the steps after
    the last prefill still hold the whole batch."""
    budget = llm.config.scheduler.max_num_batched_tokens
    eng = llm.engine
    log = record_steps(llm)
    for p in random_prompts(llm, n, ctx, 1):
        eng.add_request(eng.make_request(p, SamplingParams(max_tokens=24 + -(-n * ctx // budget),
                                                           ignore_eos=True)))
    while eng.has_unfinished():
        eng.step()
    full = [dt for dec, pre, dt in log if dec == n and pre == 0]
    return float(np.median(full))


def hf(model, n, inp, out):
    import transformers as T
    cfg = dict(json.load(open(__import__("longserve.models.builtin", fromlist=["x"]).resolve_model(f"builtin:{model}") + "/config.json")))
    cls = T.Qwen3ForCausalLM if "qwen3" in model else T.LlamaForCausalLM
    conf = (T.Qwen3Config if "qwen3" in model else T.LlamaConfig)(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    with torch.device("cuda"):
        m = cls(conf).to(torch.bfloat16).eval()
    ids = torch.randint(100, conf.vocab_size - 100, (n, inp), device="cuda")
    m.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out, min_new_tokens=out, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del m
    torch.cuda.empty_cache()
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b-shape,llama3-8b-shape")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--hf", default="qwen3-0.6b-shape", help="models to also run through HF generate")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--profile", action="store_true", help="print a kernel table of a few steps")
    ap.add_argument("--bw", type=float, default=None, help="memory bandwidth for the floor, TB/s")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    bw = args.bw or (4.2 if "H200" in dev else 3.0)
    n, inp, out = args.num_prompts, args.input_len, args.output_len
    rows = []
    for model in args.models.split(","):
        total, step = ours(model, n, inp, out, args.profile, block_size=args.block_size)
        hf_t = hf(model, n, inp, out) if model in args.hf.split(",") else None
        s = SHAPES[model]
        floor_step = (2 * s["params"] + s["kv_per_tok"] * n * (inp + 20)) / (bw * 1e12)
        rows.append(dict(model=model, ours_s=round(total, 2), out_tok_s=round(n * out / total, 1),
                         hf_s=None if hf_t is None else round(hf_t, 2),
                         speedup=None if hf_t is None else round(hf_t / total, 2),
                         decode_step_ms=round(1e3 * step, 2), floor_step_ms=round(1e3 * floor_step, 2),
                         step_over_floor=round(step / floor_step, 2)))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n### Offline batch, {n} x ({inp} in + {out} out), greedy, bf16, block size {args.block_size} "
          f"({dev}, floor at {bw} TB/s)\n")
    print("| model | LongServe (s) | output tok/s | HF generate (s) | speed-up | decode step (ms) | bytes floor (ms) | step / floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['ours_s']} | {r['out_tok_s']} | {r['hf_s']} | {r['speedup']} | "
              f"{r['decode_step_ms']} | {r['floor_step_ms']} | {r['step_over_floor']} |")


if __name__ == "__main__":
    main()
