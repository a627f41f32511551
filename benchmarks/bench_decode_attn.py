"""Decode attention kernel alone: paged_attention_lse at batch 256, against the KV bytes floor.

Shapes of the offline workload (Qwen3-0.6B: 16 query / 8 KV heads; Llama-3-8B: 32 / 8;
head_dim 128, bf16, ~1152 cached tokens a request), for several page (kernel block) sizes.
GB/s counts the K and V bytes each call must read once.
"""
import argparse

import torch

from longserve.attention.triton_kernels import paged_attention_lse


def bench(hq, hkv, page, reqs, ctx, iters=50):
    d, dev = 128, "cuda"
    blocks_per_req = -(-ctx // page)
    n_blocks = reqs * blocks_per_req + 8
    k = torch.randn(n_blocks, page, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    table = torch.randperm(n_blocks - 8, device=dev, dtype=torch.int32)[:reqs * blocks_per_req]
    table = table.view(reqs, blocks_per_req)
    q = torch.randn(reqs, hq, d, device=dev, dtype=torch.bfloat16)
    qsl = torch.arange(reqs + 1, device=dev, dtype=torch.int32)
    lens = torch.full((reqs,), ctx, device=dev, dtype=torch.int32)
    call = lambda: paged_attention_lse(q, k, v, table, qsl, lens, d ** -0.5, 1)
    for _ in range(3):
        call()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    gb = 2 * reqs * ctx * hkv * d * 2 / 1e9
    return ms, gb / (ms / 1e3)


def sweep(page, reqs, ctx):
    """Decode tile configurations (BLOCK_N, num_warps, num_stages) at one page size."""
    from longserve.attention import triton_kernels as tk
    original = tk._attn_tiles
    results = []
    for block_n in (16, 32, 64, 128):
        for warps in (2, 4, 8):
            for stages in (2, 3, 4):
                tk._attn_tiles = lambda *a, bn=block_n, w=warps, st=stages: (1, 16, bn, 128, w, st)
                try:
                    ms, gbs = bench(16, 8, page, reqs, ctx, iters=20)
                except Exception as e:  # out of shared memory, ...
                    continue
                results.append((ms, block_n, warps, stages, gbs))
    tk._attn_tiles = original
    for ms, bn, w, st, gbs in sorted(results)[:4]:
        print(f"| sweep page {page} | BLOCK_N {bn}, warps {w}, stages {st} | {1e3 * ms:.1f} | {gbs:.0f} |",
              flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reqs", type=int, default=256)
    ap.add_argument("--ctx", type=int, default=1152)
    ap.add_argument("--sweep", action="store_true", help="also try decode tile configurations")
    args = ap.parse_args()
    print(f"\n### Decode attention, {args.reqs} requests x {args.ctx} tokens ({torch.cuda.get_device_name()})\n")
    print("| heads (q/kv) | page | median (us) | KV read GB/s |\n| --- | --- | --- | --- |")
    for hq, hkv in ((16, 8), (32, 8)):
        for page in (16, 32, 64, 128):
            ms, gbs = bench(hq, hkv, page, args.reqs, args.ctx)
            print(f"| {hq}/{hkv} | {page} | {1e3 * ms:.1f} | {gbs:.0f} |", flush=True)
    if args.sweep:
        for page in (16, 32):
            sweep(page, args.reqs, args.ctx)


if __name__ == "__main__":
    main()
