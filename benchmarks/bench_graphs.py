"""Piecewise CUDA graphs for steps with prefill (worker/piecewise_graphs.py): correctness and speed.

1. Teacher-forced, on every step with prefill of a 256 x 1024-token batch (8 to 248 decodes
   beside ~8K prefill tokens), then of steps of 248 decodes beside 256 to ~8K prefill tokens:
   the eager forward and the piecewise one on the same inputs; max |logit difference|,
   argmax agreement, and the time of each forward (host included, median of --reps).
2. The full offline run, N x (1024 in + 256 out), greedy, with piecewise graphs on and off
   (LONGSERVE_PIECEWISE=off: decode graphs only), with the per-step breakdown and the GPU
   busy share over a window of mixed steps (bench_async.profile_window).

    python benchmarks/bench_graphs.py                        # one GPU, Qwen3-0.6B shape, bf16
    python benchmarks/bench_graphs.py --device cpu --model builtin:qwen3-tiny --dtype float32 \
        --num-prompts 6 --input-len 40 --output-len 4 --budget 64   # CPU: graphs off ("eager")
"""
import argparse
import os
import time

import numpy as np
import torch

from bench_async import profile_window, prompts, spy_steps
from longserve import LLM, SamplingParams
from longserve.worker import piecewise_graphs


def random_prompts(llm, n, length, seed):
    return prompts(n, length, llm.config.model.vocab_size, seed)


def print_step_breakdown(log, total):
    """log: bench_async.spy_steps entries [decode rows, prefill tokens, seconds of step()]."""
    mixed, dec = [x for x in log if x[1] > 0], [x for x in log if x[1] == 0]
    print(f"  steps {len(log)}: {len(mixed)} with prefill ({sum(x[2] for x in mixed):.2f} s), "
          f"{len(dec)} decode-only ({sum(x[2] for x in dec):.2f} s, median "
          f"{1e3 * np.median([x[2] for x in dec] or [0]):.2f} ms); total {total:.2f} s", flush=True)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def build(args, mode):
    """mode: LONGSERVE_PIECEWISE for this engine ("graphs", "eager" or "off")."""
    os.environ["LONGSERVE_PIECEWISE"] = mode
    start = time.perf_counter()
    llm = LLM(args.model, load_format=args.load_format, dtype=args.dtype, device=args.device,
              max_model_len=args.input_len + args.output_len + 16, max_num_seqs=args.num_prompts,
              max_num_batched_tokens=args.budget, rank0_own_process=False)  # (its runner: here)
    pw = llm.engine.core.executor.driver.runner.piecewise
    capture = pw.capture_s if pw is not None and pw.use_graphs else None
    print(f"engine ({mode}) ready in {time.perf_counter() - start:.1f} s"
          + ("" if pw is None else f"; piecewise buckets {pw.buckets[0]}..{pw.buckets[-1]} "
             f"({len(pw.buckets)})") + ("" if capture is None else f", captured in {capture:.1f} s"),
          flush=True)
    return llm


def timed(fn, device, reps):
    out = fn()  # the first call at this shape (cuBLAS heuristics, Triton variants)
    sync(device)
    start = time.perf_counter()
    for _ in range(reps):
        out = fn()
    sync(device)
    return out, (time.perf_counter() - start) / reps


def compare_steps(llm, args):
    """Run every step with prefill both ways (teacher-forced: the same inputs and cache):
    a 256 x 1024 batch (the offline run's mixed steps), then a sweep of mixed steps of
    248 decodes + P prefill tokens."""
    runner = llm.engine.core.executor.driver.runner
    pw, inner, rows = runner.piecewise, runner.run_model, []
    if pw is None:
        print("no piecewise runner for this model / layout: nothing to compare")
        return

    def both(inp):
        if inp.is_pure_decode or not pw.fits(inp.num_local_tokens):
            return inner(inp)
        args_ = (inp.input_ids, inp.positions, inp.meta)
        eager, t_e = timed(lambda: runner.model(*args_), args.device, args.reps)
        eager_logits = runner.model.compute_logits(eager[inp.logits_indices])
        piece, t_p = timed(lambda: pw.run(*args_), args.device, args.reps)
        logits = runner.model.compute_logits(piece[inp.logits_indices])
        agree = (logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item()
        dec = inp.meta.num_decode_tokens
        rows.append((dec, inp.num_local_tokens - dec, t_e, t_p,
                     (logits - eager_logits).abs().max().item(), agree))
        return piece
    runner.run_model = both
    try:
        llm.generate(random_prompts(llm, args.num_prompts, args.input_len, 11),
                     SamplingParams(max_tokens=4 + args.num_prompts * args.input_len // args.budget,
                                    ignore_eos=True), use_tqdm=False)
        print_comparison(rows)
        rows.clear()
        sweep(llm, args)
        print_comparison(rows)
    finally:
        runner.run_model = inner


def sweep(llm, args):
    """Steps of D requests decoding (D = num_prompts - 8, prefilled with 32-token prompts)
    beside P new prompt tokens, P from 1/32 of the budget to what the budget leaves."""
    eng, d = llm.engine, max(1, args.num_prompts - 8)
    sizes = sorted({args.budget // 32, args.budget // 16, args.budget // 8, args.budget // 4,
                    args.budget // 2, args.budget - d} - {0})
    for i, p in enumerate(x for x in sizes if x > 0):
        length = min(p, args.input_len)
        for x in random_prompts(llm, d, 32, 100 + i):
            eng.add_request(eng.make_request(x, SamplingParams(max_tokens=6, ignore_eos=True)))
        eng.step()  # the decoders' prompts (one step when d * 32 <= budget)
        for x in random_prompts(llm, p // length, length, 200 + i):
            eng.add_request(eng.make_request(x, SamplingParams(max_tokens=1, ignore_eos=True)))
        while eng.has_unfinished():
            eng.step()


def print_comparison(rows):
    print("\n| decodes | prefill tokens | eager (ms) | piecewise (ms) | speed-up | max abs logit diff "
          "| argmax agree |\n| --- | --- | --- | --- | --- | --- | --- |")
    for dec, pre, t_e, t_p, diff, agree in rows:
        print(f"| {dec} | {pre} | {1e3 * t_e:.2f} | {1e3 * t_p:.2f} | {t_e / t_p:.2f} | {diff:.3g} "
              f"| {agree:.3f} |")
    if rows:
        e, p = sum(r[2] for r in rows), sum(r[3] for r in rows)
        print(f"\n{len(rows)} steps with prefill: eager {1e3 * e:.1f} ms, piecewise {1e3 * p:.1f} ms "
              f"({e / p:.2f}x); max |logit diff| {max(r[4] for r in rows):.3g}, argmax agreement "
              f"min {min(r[5] for r in rows):.3f} mean {np.mean([r[5] for r in rows]):.3f}",
              flush=True)


def full_run(llm, args):
    n, inp, out = args.num_prompts, args.input_len, args.output_len
    llm.generate(random_prompts(llm, n, inp, 7), SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)  # warm-up on other prompts: no prefix-cache hits below
    steps = spy_steps(llm)  # per engine.step(): with async scheduling, the step period
    pw = llm.engine.core.executor.driver.runner.piecewise
    before = 0 if pw is None else pw.num_steps
    sync(args.device)
    start = time.perf_counter()
    outs = llm.generate(random_prompts(llm, n, inp, 0),
                        SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
    sync(args.device)
    total = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == out for o in outs)
    print_step_breakdown(steps, total)
    if args.device == "cuda":  # GPU busy share over 6 steps with prefill chunks (torch.profiler)
        busy, _ = profile_window(llm, n, inp, 6, mixed=True)
        print(f"  GPU busy over 6 mixed steps: {busy:.3f}", flush=True)
    return total, [o.outputs[0].token_ids for o in outs], 0 if pw is None else pw.num_steps - before


def shutdown(llm, device):
    llm.shutdown()
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:qwen3-0.6b-shape")
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--reps", type=int, default=3, help="timed forwards per step and path")
    ap.add_argument("--max-graph-tokens", type=int, default=None,
                    help="largest step run piecewise (default: piecewise_graphs.MAX_GRAPH_TOKENS)")
    args = ap.parse_args()
    if args.max_graph_tokens is not None:  # read when the engine's runner builds its buckets
        piecewise_graphs.MAX_GRAPH_TOKENS = args.max_graph_tokens
    on = "graphs" if args.device == "cuda" else "eager"  # no graphs on CPU: the same path, called
    llm = build(args, on)
    compare_steps(llm, args)  # (the compare runs take the warm-up's place for the full run)
    results = {}
    print(f"\nfull run, piecewise {on}:", flush=True)
    results[on] = full_run(llm, args)
    shutdown(llm, args.device)
    print("\nfull run, piecewise off (decode graphs only):", flush=True)
    llm = build(args, "off")
    results["off"] = full_run(llm, args)
    shutdown(llm, args.device)
    (t_on, tok_on, n_on), (t_off, tok_off, _) = results[on], results["off"]
    same = np.mean([a == b for a, b in zip(tok_on, tok_off)])
    print(f"\n{args.num_prompts} x ({args.input_len} + {args.output_len}): piecewise {t_on:.2f} s "
          f"({n_on} steps piecewise), off {t_off:.2f} s ({t_off / t_on:.2f}x); identical outputs "
          f"{same:.3f} of sequences", flush=True)


if __name__ == "__main__":
    main()
