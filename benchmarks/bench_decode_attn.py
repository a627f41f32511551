"""Decode attention kernel alone: paged_attention_lse (and its split merge) against the KV bytes.

Default: the offline workload's shapes at batch 256 (Qwen3-0.6B: 16 query / 8 KV heads;
Llama-3-8B: 32 / 8; head_dim 128, bf16, ~1152 cached tokens a request) for several page sizes.
--mixed: short requests beside a long one, the table as wide as a server's (the long one's shares).
--long: long-context decode, bf16 and FP8 caches: Llama-3-8B at 128K batch 1, and the one-KV-head
shape (32 query heads on one KV head; tp=2 holds 16 of them over the whole context, tp=2 x dcp=2
all 32 over half) at 128K batch 1 and 64 x 32K. --sweep bf16 fp8 / --split-sweep: split decode's
knobs per cache dtype, and the split count; --share-sweep: decode's minimum share. Each call is
replayed in a CUDA graph; GB/s counts the K and V bytes a call must read once (the split partials
it writes and merges are overhead, not counted); decode's work-item plan (plan_decode, once a step
for all layers) is built outside the timing.
"""
import argparse
import itertools

import torch

from longserve.attention import triton_kernels as tk


def make_case(hq, hkv, page, reqs, ctx, fp8, dev="cuda"):
    d = 128
    per_req = -(-ctx // page)
    n_blocks = reqs * per_req + 8
    k = torch.randn(n_blocks, page, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    kv_scale = None
    if fp8:  # values within e4m3's range, scale 1
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        kv_scale = torch.ones(2, hkv, device=dev)
    table = torch.randperm(n_blocks - 8, device=dev, dtype=torch.int32)[:reqs * per_req]
    return dict(q=torch.randn(reqs, hq, d, device=dev, dtype=torch.bfloat16), k_cache=k, v_cache=v,
                block_table=table.view(reqs, per_req), kv_lens=torch.full((reqs,), ctx, device=dev, dtype=torch.int32),
                query_start_loc=torch.arange(reqs + 1, device=dev, dtype=torch.int32),
                scale=d ** -0.5, max_query_len=1, kv_scale=kv_scale)


def timed_us(call, iters=50):
    """Median of `iters` replays of call captured in a CUDA graph (launch overhead excluded)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def bench(hq, hkv, page, reqs, ctx, fp8=False, splits=None, iters=50):
    case = make_case(hq, hkv, page, reqs, ctx, fp8)
    plan = tk.plan_decode(case["kv_lens"], hq, hkv, 128, splits)  # once a step, for every layer
    us = timed_us(lambda: tk.paged_attention_lse(**case, plan=plan), iters)
    gb = 2 * reqs * ctx * hkv * 128 * (1 if fp8 else 2) / 1e9
    return us, gb / (us / 1e6)


def default_splits(hkv, reqs, ctx, hq=32):
    """Decode's work-item budget (items past one a request; the kernel cuts each request's KV into
    shares near sum(kv) / budget)."""
    return tk._decode_budget(reqs, hq, hkv, 128, torch.device("cuda"))


MIXED = [  # (name, q heads, KV heads, short requests, their context, the long one's, table width)
    ("tp=4 server: 32 x 1K + 1 x 128K", 8, 2, 32, 1024, 131072, 140000),
    ("pcp=4 server, a rank's shard: 32 x 256 + 1 x 32K", 32, 8, 32, 256, 32768, 35000),
    ("one GPU: 256 x 1152 + 1 x 128K", 32, 8, 256, 1152, 131072, 140000),
    ("one GPU: 256 x 1152, table 140K", 32, 8, 256, 1152, 0, 140000),
    ("one GPU: 256 x 1152, table 33K", 32, 8, 256, 1152, 0, 33024),
    ("one GPU: 1 x 16K, table 140K", 32, 8, 0, 0, 16384, 140000),
    # a P/D consumer (or any server) decoding 1K-token requests beside one 32K prompt's decode
    ("one GPU: 64 x 1K + 1 x 32K, table 140K", 32, 8, 64, 1024, 32768, 140000),
    ("one GPU: 256 x 1K + 1 x 32K, table 140K", 32, 8, 256, 1024, 32768, 140000),
    ("one GPU: 16 x 1K, table 140K", 32, 8, 16, 1024, 0, 140000),
    # bench_dp's MoE rows at 512 decodes (Qwen3-30B-A3B: 32 q / 4 KV heads, 320 tokens, table 336)
    ("MoE dp=4 rank: 128 x 320", 32, 4, 128, 320, 0, 336),
    ("MoE tp=4 rank: 512 x 320", 8, 1, 512, 320, 0, 336),
    ("MoE tp=2 rank: 512 x 320", 16, 2, 512, 320, 0, 336),
]


def mixed_case(hq, hkv, page, n_short, short_ctx, long_ctx, table_ctx, dev="cuda"):
    """Short requests beside one long one (a server's decode batch while a long prompt decodes), the
    block table as wide as the engine's (max_model_len), as a captured decode step sees it."""
    lens = [short_ctx] * n_short + ([long_ctx] if long_ctx else [])
    width = -(-table_ctx // page)
    n_blocks = sum(-(-c // page) for c in lens) + 8
    k = torch.randn(n_blocks, page, hkv, 128, device=dev, dtype=torch.bfloat16)
    table = torch.zeros(len(lens), width, device=dev, dtype=torch.int32)
    free = torch.randperm(n_blocks - 8, device=dev, dtype=torch.int32)
    used = 0
    for r, c in enumerate(lens):
        n = -(-c // page)
        table[r, :n] = free[used:used + n]
        used += n
    reqs = len(lens)
    return dict(q=torch.randn(reqs, hq, 128, device=dev, dtype=torch.bfloat16), k_cache=k,
                v_cache=torch.randn_like(k), block_table=table,
                kv_lens=torch.tensor(lens, device=dev, dtype=torch.int32),
                query_start_loc=torch.arange(reqs + 1, device=dev, dtype=torch.int32),
                scale=128 ** -0.5, max_query_len=1), sum(lens)


def mixed_table(page, bw=4.8e12):
    """Decode attention of a mixed batch: the step waits for the slowest program (the long request's
    shares), not the bytes; floor = the KV bytes at `bw`."""
    print("\n| batch | item budget | us | floor (us) | / floor | plan (us, once a step) |"
          "\n| --- | --- | --- | --- | --- | --- |")
    for name, hq, hkv, n_short, short_ctx, long_ctx, table_ctx in MIXED:
        case, tokens = mixed_case(hq, hkv, page, n_short, short_ctx, long_ctx, table_ctx)
        plan = tk.plan_decode(case["kv_lens"], hq, hkv, 128)
        us = timed_us(lambda: tk.paged_attention_lse(**case, plan=plan))
        plan_us = timed_us(lambda: tk.plan_decode(case["kv_lens"], hq, hkv, 128))
        reqs = case["q"].shape[0]
        splits = default_splits(hkv, reqs, table_ctx, hq)
        floor = 2 * tokens * hkv * 128 * 2 / bw * 1e6
        print(f"| {name} | {splits} | {us:.1f} | {floor:.1f} | {us / floor:.2f}x | {plan_us:.1f} |", flush=True)


LONG = [  # (name, q heads, KV heads, requests, context)
    ("Llama-3-8B, 128K", 32, 8, 1, 131072),
    ("1 KV head, tp=2, 128K", 16, 1, 1, 131072),
    ("1 KV head, tp=2 x dcp=2 (a shard), 128K", 32, 1, 1, 65536),
    ("1 KV head, tp=2, 64 x 32K", 16, 1, 64, 32768),
    ("1 KV head, tp=2 x dcp=2 (a shard), 64 x 32K", 32, 1, 64, 16384),
]


def long_table(page):
    print("\n| shape | KV | item budget | us | KV GB/s |\n| --- | --- | --- | --- | --- |")
    for name, hq, hkv, reqs, ctx in LONG:
        for fp8 in (False, True):
            us, gbs = bench(hq, hkv, page, reqs, ctx, fp8)
            print(f"| {name} | {'fp8' if fp8 else 'bf16'} | {default_splits(hkv, reqs, ctx, hq)} | {us:.1f} | {gbs:.0f} |",
                  flush=True)


def sweep(page, fp8: bool, shapes):
    """Split decode's knobs: tile length, warps, stages (the FP8 dot in fp16: it beat bf16 at
    every setting on H100); the best four of each shape, against the default."""
    saved = tk.SPLIT_DECODE, tk.SPLIT_DECODE_WIDE, tk.SPLIT_DECODE_FP8, tk.FP8_DOT_F16
    dots = (True,) if fp8 else (saved[3],)
    for name, hq, hkv, reqs, ctx in shapes:
        base_us, base_gbs = bench(hq, hkv, page, reqs, ctx, fp8)
        rows = []
        for f16, bn, warps, stages in itertools.product(dots, (64, 128, 256), (4, 8), (2, 3, 4)):
            if fp8:
                tk.SPLIT_DECODE_FP8, tk.FP8_DOT_F16 = (bn, warps, stages), f16
            else:
                tk.SPLIT_DECODE = tk.SPLIT_DECODE_WIDE = (bn, warps, stages)
            try:
                rows.append((*bench(hq, hkv, page, reqs, ctx, fp8, iters=20), f16, bn, warps, stages))
            except Exception as e:  # out of shared memory, ...
                print(f"| {name} | {bn}, {warps} warps, {stages} stages | {type(e).__name__} |")
            tk.SPLIT_DECODE, tk.SPLIT_DECODE_WIDE, tk.SPLIT_DECODE_FP8, tk.FP8_DOT_F16 = saved
        print(f"\n{name}, {'fp8' if fp8 else 'bf16'}: default {base_us:.1f} us ({base_gbs:.0f} GB/s)\n"
              "| fp16 dot | BLOCK_N | warps | stages | us | KV GB/s |\n| --- | --- | --- | --- | --- | --- |")
        for us, gbs, f16, bn, warps, stages in sorted(rows)[:4]:
            print(f"| {f16} | {bn} | {warps} | {stages} | {us:.1f} | {gbs:.0f} |", flush=True)


def split_sweep(page):
    """The work-item budget around the default, per long shape, bf16 (partials and their merge grow
    with items x query heads: the one-KV-head shapes feel it most)."""
    print("\n| shape | KV | item budget | us | KV GB/s |\n| --- | --- | --- | --- | --- |")
    for (name, hq, hkv, reqs, ctx), fp8 in itertools.product(LONG, (False,)):
        base = default_splits(hkv, reqs, ctx, hq)
        for s in sorted({max(1, base // 4), max(1, base // 2), base, base * 2, base * 4}):
            us, gbs = bench(hq, hkv, page, reqs, ctx, fp8, splits=s, iters=20)
            mark = " (default)" if s == base else ""
            print(f"| {name} | {'fp8' if fp8 else 'bf16'} | {s}{mark} | {us:.1f} | {gbs:.0f} |", flush=True)


def share_sweep(page, shares=(256, 512, 1024, 2048)):
    """Decode's minimum share (tk.MIN_SHARE, a work item's fewest KV tokens) on the long shapes, both
    cache dtypes, and the mixed batches (bf16): fewer, longer items write fewer partials (one KV
    head: G = 16-32 query heads' partials an item) but fill fewer SMs."""
    def mixed_us(row):
        name, hq, hkv, *lens = row
        case, _ = mixed_case(hq, hkv, page, *lens)
        plan = tk.plan_decode(case["kv_lens"], hq, hkv, 128)
        return timed_us(lambda: tk.paged_attention_lse(**case, plan=plan))

    def long_us(row, fp8):
        name, hq, hkv, reqs, ctx = row
        return bench(hq, hkv, page, reqs, ctx, fp8)[0]

    cases = [(f"{row[0]} | {'fp8' if fp8 else 'bf16'}", lambda row=row, fp8=fp8: long_us(row, fp8))
             for row in LONG for fp8 in (False, True)]
    cases += [(f"{row[0]} | bf16", lambda row=row: mixed_us(row)) for row in MIXED]
    saved = tk.MIN_SHARE
    print("\n| shape | KV | " + " | ".join(f"min share {m}" for m in shares) + " |")
    print("|" + " --- |" * (2 + len(shares)))
    for name, run in cases:
        us = []
        for m in shares:
            tk.MIN_SHARE = m  # (plan_decode reads it when it plans)
            us.append(run())
        print(f"| {name} | " + " | ".join(f"{u:.1f}" for u in us) + " |", flush=True)
    tk.MIN_SHARE = saved


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reqs", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=1152)
    ap.add_argument("--page", type=int, default=16, help="kernel block size of the long shapes")
    ap.add_argument("--long", action="store_true", help="only the long-context table")
    ap.add_argument("--sweep", choices=["bf16", "fp8"], nargs="*", default=[],
                    help="split decode's tile / warps / stages per long shape, per cache dtype")
    ap.add_argument("--shapes", type=int, nargs="*", default=None, help="LONG rows to sweep (indices)")
    ap.add_argument("--split-sweep", action="store_true")
    ap.add_argument("--share-sweep", action="store_true", help="decode's minimum share, long and mixed shapes")
    ap.add_argument("--mixed", action="store_true", help="only mixed batches: short requests beside a long one")
    args = ap.parse_args()
    print(f"\n### Decode attention ({torch.cuda.get_device_name()})")
    if args.mixed:
        mixed_table(args.page)
    if args.share_sweep:
        share_sweep(args.page)
    if not (args.long or args.sweep or args.split_sweep or args.mixed or args.share_sweep):
        print(f"\n{args.reqs} requests x {args.ctx} tokens\n\n| heads (q/kv) | page | median (us) | KV read GB/s |"
              "\n| --- | --- | --- | --- |")
        for (hq, hkv), page in itertools.product(((16, 8), (32, 8)), (16, 32, 64, 128)):
            us, gbs = bench(hq, hkv, page, args.reqs, args.ctx)
            print(f"| {hq}/{hkv} | {page} | {us:.1f} | {gbs:.0f} |", flush=True)
    if args.long:
        long_table(args.page)
    for dtype in args.sweep:
        shapes = LONG if args.shapes is None else [LONG[i] for i in args.shapes]
        sweep(args.page, dtype == "fp8", shapes)
    if args.split_sweep:
        split_sweep(args.page)


if __name__ == "__main__":
    main()
