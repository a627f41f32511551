"""Asynchronous vs synchronous scheduling, side by side in one run (one GPU).

For each mode: the offline workload (N prompts x (in + out), greedy, ignore_eos, random
weights at a real shape), its wall time, the median time of a decode-only step at the full
batch (one `EngineCore.step` call: with asynchronous scheduling that is the real step period),
the GPU busy fraction over a window of decode steps and of mixed steps (union of kernel and
copy intervals from torch.profiler over the window's span), and whether both modes give the
same tokens.

    python benchmarks/bench_async.py --model qwen3-0.6b-shape --num-prompts 256
"""
import argparse
import json
import os
import time

import numpy as np
import torch

from longserve import LLM, SamplingParams

os.environ.setdefault("LONGSERVE_ENABLE_MULTIPROCESSING", "0")  # the spies read the core here


def prompts(n, length, vocab, seed):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(100, vocab - 100, length).tolist()} for _ in range(n)]


def spy_steps(llm):
    """Time every EngineCore.step() call and note its plan: (decode rows, prefill tokens, s)."""
    eng, log = llm.engine.core, []
    schedule, step = eng.scheduler.schedule, eng.step

    def planned():
        out = schedule()
        dec = sum(1 for r in out.all_requests() if r.num_computed_tokens > 0 and len(r.token_ids) == 1)
        log.append([dec, out.num_tokens - dec, 0.0])
        return out

    def timed(lockstep=False):
        t = time.perf_counter()
        done = step(lockstep)
        log[-1][2] = time.perf_counter() - t
        return done
    eng.scheduler.schedule, eng.step = planned, timed
    return log


def busy_fraction(prof) -> float:
    """Union of device intervals (kernels, copies, sets) over their first-to-last span."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return float("nan")
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy, cur_s, cur_e = busy + cur_e - cur_s, s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    return busy / (spans[-1][1] - spans[0][0])


def profile_window(llm, n, inp, steps, mixed: bool):
    """GPU busy fraction over `steps` engine steps: decode-only, or with prefill chunks."""
    from torch.profiler import ProfilerActivity, profile
    vocab = llm.config.model.vocab_size
    with llm.engine.client.paused() as eng:  # this thread steps the core
        for p in prompts(n, inp, vocab, 6 if mixed else 5):  # no prefix hits between windows
            eng.add_request(llm.engine.make_request(p, SamplingParams(temperature=0, max_tokens=64,
                                                                      ignore_eos=True)))
        budget = llm.config.scheduler.max_num_batched_tokens
        warm = 2 if mixed else -(-n * inp // budget) + 4  # decode window: after the last prefill
        for _ in range(warm):
            eng.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                eng.step()
            torch.cuda.synchronize()
        while eng.has_work():
            eng.step()
    return busy_fraction(prof), prof


def run(model, asynchronous, n, inp, out, show_profile, cprofile=False):
    llm = LLM(f"builtin:{model}", load_format="dummy", dtype="bfloat16", max_model_len=inp + out + 80,
              max_num_seqs=n, async_scheduling=asynchronous)
    vocab = llm.config.model.vocab_size
    llm.generate(prompts(n, inp, vocab, 7), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    log = spy_steps(llm)
    torch.cuda.synchronize()
    prof_host = __import__("cProfile").Profile() if cprofile else None
    t = time.perf_counter()
    if prof_host:
        prof_host.enable()
    outs = llm.generate(prompts(n, inp, vocab, 0),
                        SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    if prof_host:
        prof_host.disable()
        __import__("pstats").Stats(prof_host).sort_stats("tottime").print_stats(30)
    log = list(log)  # the profile windows below step the same engine
    full = [dt for dec, pre, dt in log if dec == n and pre == 0]
    mixed = [x for x in log if x[1] > 0]
    busy_dec, prof = profile_window(llm, n, inp, 12, mixed=False)
    busy_mix, prof_mix = profile_window(llm, n, inp, 6, mixed=True)
    if show_profile:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15), flush=True)
        print(prof_mix.key_averages().table(sort_by="cuda_time_total", row_limit=25), flush=True)
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()
    return dict(mode="async" if asynchronous else "sync", total_s=round(total, 3),
                out_tok_s=round(n * out / total, 1), steps=len(log), mixed_steps=len(mixed),
                mixed_s=round(sum(x[2] for x in mixed), 3),
                decode_step_ms=round(1e3 * float(np.median(full)), 2) if full else None,
                gpu_busy_decode=round(busy_dec, 3), gpu_busy_mixed=round(busy_mix, 3)), \
        [o.outputs[0].token_ids for o in outs]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-0.6b-shape")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--show-profile", action="store_true", help="op tables (async run)")
    ap.add_argument("--cprofile", action="store_true", help="Python hot spots of the async run")
    ap.add_argument("--modes", default="sync,async")
    args = ap.parse_args()
    rows, tokens = [], []
    for asynchronous in [m == "async" for m in args.modes.split(",")]:
        row, toks = run(args.model, asynchronous, args.num_prompts, args.input_len, args.output_len,
                        args.show_profile and asynchronous, args.cprofile and asynchronous)
        rows.append(row)
        tokens.append(toks)
        print(json.dumps(row), flush=True)
    same = np.mean([a == b for a, b in zip(tokens[0], tokens[-1])])
    print(f"\n### Scheduling modes, {args.model}, {args.num_prompts} x ({args.input_len} in + "
          f"{args.output_len} out) ({torch.cuda.get_device_name()}); identical greedy outputs: "
          f"{100 * same:.1f}%\n")
    print("| mode | total (s) | output tok/s | steps (with prefill) | prefill steps (s) | "
          "decode step (ms) | GPU busy, decode | GPU busy, mixed |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['mode']} | {r['total_s']} | {r['out_tok_s']} | {r['steps']} ({r['mixed_steps']}) | "
              f"{r['mixed_s']} | {r['decode_step_ms']} | {r['gpu_busy_decode']} | {r['gpu_busy_mixed']} |")


if __name__ == "__main__":
    main()
