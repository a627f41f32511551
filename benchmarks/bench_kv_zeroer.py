"""KV block zeroing: KVBlockZeroer (one Triton launch) vs per-block zero_() vs the zero-fill ceiling.

Llama-3-8B-like cache: 32 layers x [2, 2000, 16, 8, 128] bf16 (4.2 GB); 256 random blocks,
filled with non-zero data before every timed call, are zeroed in all layers (512 MiB written).
The ceiling is `torch.zero_` of one contiguous buffer of the same byte count.

    python benchmarks/bench_kv_zeroer.py [--layers 32 --blocks 2000 --zero 256 ...]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from types import SimpleNamespace

import torch

from longserve.attention.kv_cache_spec import AttentionGroup, AttentionSpec
from longserve.worker.utils import KVBlockZeroer


def median_ms(fn, prepare, iters: int, warmup: int = 3) -> float:
    """Median CUDA-event time of fn(); prepare() (untimed) runs before every call."""
    times = []
    for i in range(warmup + iters):
        prepare()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        if i >= warmup:
            times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def build(args):
    """Layer caches (kernel blocks of args.kernel_block_size), their modules, and a zeroer."""
    k = args.block_size // args.kernel_block_size
    shape = (2, args.blocks * k, args.kernel_block_size, args.kv_heads, args.head_dim)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(args.layers)]
    context = {n: SimpleNamespace(kv_cache=torch.empty(shape, dtype=torch.bfloat16, device="cuda"))
               for n in names}
    spec = AttentionSpec(args.block_size, args.kv_heads, args.head_dim, torch.bfloat16)
    zeroer = KVBlockZeroer("cuda")
    zeroer.init_meta([AttentionGroup(object, names, spec)], [args.kernel_block_size], "bfloat16",
                     set(), context)
    return context, zeroer


def check(zeroer: KVBlockZeroer, ids: torch.Tensor) -> None:
    """Exactly the chosen blocks (K and V, every layer) are zero after zero_block_ids."""
    for view in zeroer.views:
        view.uniform_(0.5, 1.5)
    zeroer.zero_block_ids(ids)
    expected = torch.ones(zeroer.num_blocks, dtype=torch.bool, device="cuda")
    expected[ids] = False
    for view in zeroer.views:
        nonzero = (view != 0).any(-1)  # [2, num_blocks]
        if not torch.equal(nonzero, expected.expand(2, -1)):
            sys.exit("bench_kv_zeroer: KVBlockZeroer zeroed the wrong bytes; not timing it")


def measure(args, context, zeroer: KVBlockZeroer, ids: torch.Tensor, nbytes: int) -> list[tuple[str, float]]:
    """(method, median ms); every zeroing call finds non-zero data in its blocks."""
    ids_list, k = ids.tolist(), args.block_size // args.kernel_block_size
    caches = [m.kv_cache for m in context.values()]

    def poison_blocks():
        for view in zeroer.views:
            view.index_fill_(1, ids, 1.0)

    def per_block_loop():
        for cache in caches:
            for b in ids_list:
                cache[:, b * k:(b + 1) * k].zero_()

    def torch_batched():  # the zeroer's non-Triton path
        for view in zeroer.views:
            view.index_fill_(1, ids, 0)

    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    n = args.iters
    return [
        ("torch.zero_ of a contiguous buffer (ceiling)", median_ms(flat.zero_, lambda: flat.fill_(1.0), n)),
        ("KVBlockZeroer.zero_block_ids (device ids)", median_ms(lambda: zeroer.zero_block_ids(ids), poison_blocks, n)),
        ("KVBlockZeroer.zero_block_ids (python list)",
         median_ms(lambda: zeroer.zero_block_ids(ids_list), poison_blocks, n)),
        ("index_fill_ per layer (torch path)", median_ms(torch_batched, poison_blocks, n)),
        ("per-block zero_() loop", median_ms(per_block_loop, poison_blocks, max(3, n // 4), warmup=1)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=2000)
    p.add_argument("--zero", type=int, default=256, help="blocks zeroed per call")
    p.add_argument("--block-size", type=int, default=16, help="manager block size (tokens)")
    p.add_argument("--kernel-block-size", type=int, default=None)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kv_zeroer: needs a CUDA GPU and none is visible; nothing measured.")
    args.kernel_block_size = args.kernel_block_size or args.block_size

    torch.manual_seed(0)
    context, zeroer = build(args)
    ids = torch.randperm(args.blocks, device="cuda")[:args.zero]
    check(zeroer, ids)
    nbytes = args.zero * args.layers * 2 * zeroer.views[0].stride(1) * 2  # blocks x layers x K,V x bf16
    rows = measure(args, context, zeroer, ids, nbytes)

    ceiling = nbytes / rows[0][1] / 1e6  # GB/s
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    print(f"{args.layers} layers x [2, {args.blocks * args.block_size // args.kernel_block_size},"
          f" {args.kernel_block_size}, {args.kv_heads}, {args.head_dim}] bf16, manager block {args.block_size};"
          f" zeroing {args.zero} blocks = {nbytes / 2**20:.0f} MiB; Triton chunk {zeroer.chunk_bytes} B\n")
    print("| method | median time (us) | GB/s | % of zero-fill |")
    print("| --- | ---: | ---: | ---: |")
    for name, ms in rows:
        gbps = nbytes / ms / 1e6
        print(f"| {name} | {ms * 1e3:.1f} | {gbps:.0f} | {100 * gbps / ceiling:.1f}% |")


if __name__ == "__main__":
    main()
