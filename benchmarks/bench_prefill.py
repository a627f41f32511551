"""Long-prompt prefill: time to first token and its scaling with PCP (or TP) ranks.

Llama-3-8B shape, random weights, bf16, one prompt per length, the whole prompt in one
step (max_num_batched_tokens = the longest length). For each layout size N (1, 2, 4 GPUs):
TTFT (median of --reps), parallel efficiency T1 / (N * TN), and TFLOP/s per GPU, with
FLOPs = 2 * params * S + 2 * S^2 * heads * head_dim * layers (causal attention, QK and PV).
Also writes the rows as JSON and a plot of TTFT against the number of GPUs.
"""
import argparse
import json
import os
import time

import numpy as np
import torch

from longserve import LLM, SamplingParams

PARAMS, LAYERS, HEADS, HEAD_DIM = 8.03e9, 32, 32, 128


def flops(s: int) -> float:
    return 2 * PARAMS * s + 2 * s * s * HEADS * HEAD_DIM * LAYERS


def ttft(mode: str, n: int, lengths: list[int], reps: int, profile: bool = False) -> dict[int, float]:
    size_kw = {"pcp": "prefill_context_parallel_size", "tp": "tensor_parallel_size"}[mode]
    longest = max(lengths)
    llm = LLM("builtin:llama3-8b-shape", load_format="dummy", dtype="bfloat16", max_num_seqs=1,
              max_model_len=longest + 64, max_num_batched_tokens=longest, enforce_eager=True,
              enable_prefix_caching=False, **{size_kw: n})
    rng = np.random.default_rng(0)
    out = {}
    for s in lengths:
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            p = {"prompt_token_ids": rng.integers(100, 128000, s).tolist()}
            t = time.perf_counter()
            llm.generate([p], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            times.append(time.perf_counter() - t)
        out[s] = float(np.median(times[1:]))
        print(json.dumps({"mode": mode, "gpus": n, "len": s, "ttft_s": round(out[s], 3)}), flush=True)
    if profile:
        profile_prefill(llm, min(lengths), rng)
    llm.shutdown()
    return out


def profile_prefill(llm, s, rng):
    """Rank 0's kernel table for one prefill, and how much of the wall time its GPU was busy."""
    from torch.profiler import ProfilerActivity, profile
    p = {"prompt_token_ids": rng.integers(100, 128000, s).tolist()}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        llm.generate([p], SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
        wall = time.perf_counter() - t
    events = prof.key_averages()
    busy = sum(e.self_device_time_total for e in events) / 1e6
    print(events.table(sort_by="self_cuda_time_total", row_limit=14), flush=True)
    print(f"profile {s} tokens: wall {wall:.3f} s, rank-0 GPU busy {busy:.3f} s", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="pcp", choices=["pcp", "tp"])
    ap.add_argument("--gpus", default="1,2,4")
    ap.add_argument("--lengths", default="32768,131072")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--peak", type=float, default=790.0, help="bf16 dense TFLOP/s of one GPU")
    ap.add_argument("--profile", action="store_true", help="kernel table of one prefill per layout")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    sizes = [int(x) for x in args.gpus.split(",") if int(x) <= torch.cuda.device_count()]
    res = {n: ttft(args.mode, n, lengths, args.reps, args.profile) for n in sizes}
    dev = torch.cuda.get_device_name()
    rows = []
    for s in lengths:
        t1 = res[sizes[0]][s] * sizes[0]
        for n in sizes:
            t = res[n][s]
            rows.append(dict(len=s, gpus=n, ttft_s=round(t, 3), efficiency=round(t1 / (n * t), 3),
                             tflops_per_gpu=round(flops(s) / t / n / 1e12, 1),
                             pct_peak=round(100 * flops(s) / t / n / 1e12 / args.peak, 1)))
    json.dump(dict(device=dev, mode=args.mode, rows=rows),
              open(os.path.join(args.out, f"prefill_{args.mode}.json"), "w"), indent=1)
    print(f"\n### Prefill, Llama-3-8B shape, {args.mode.upper()} ({dev})\n")
    print("| prompt | GPUs | TTFT (s) | efficiency T1/(N TN) | TFLOP/s per GPU | % of peak |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['len']} | {r['gpus']} | {r['ttft_s']} | {r['efficiency']} | {r['tflops_per_gpu']} | {r['pct_peak']} |")
    plot(rows, args)


def plot(rows, args):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for s in sorted({r["len"] for r in rows}):
        pts = [(r["gpus"], r["ttft_s"]) for r in rows if r["len"] == s]
        ax.plot(*zip(*pts), marker="o", label=f"{s // 1024}K tokens")
    ax.set_xlabel(f"GPUs ({args.mode.upper()})")
    ax.set_ylabel("time to first token (s)")
    ax.set_xticks(sorted({r["gpus"] for r in rows}))
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, f"prefill_{args.mode}.png"), dpi=120)


if __name__ == "__main__":
    main()
