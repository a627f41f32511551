"""CPU offload copy bandwidth: copy_kv_blocks (device <-> pinned host pool, one batched copy
per layer) against one pinned copy of the same bytes.

Default: Llama-3-8B shape (32 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks),
2048 blocks (32K tokens, 4 GiB) each way, block ids in one run (as the host allocator hands
them out) and scattered (the device's LRU order). On CPU (`--device cpu --blocks 64
--layers 2`) it only checks that the script runs.
"""
import argparse
import json
import time

import torch

from longserve.kv_transfer.utils import copy_kv_blocks


def timed(fn, device, repeat):
    fn()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / repeat


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--blocks", type=int, default=2048, help="blocks moved each way")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device(args.device)
    pin = dev.type == "cuda"
    shape = (args.block_size, args.kv_heads, args.head_dim)
    n, pool = args.blocks, 2 * args.blocks
    dev_caches = {f"l{i}": torch.randn(2, pool, *shape, device=dev).to(torch.bfloat16) for i in range(args.layers)}
    host_caches = {f"l{i}": torch.zeros(2, pool, *shape, dtype=torch.bfloat16, pin_memory=pin)
                   for i in range(args.layers)}
    nbytes = sum(c[:, :n].numel() * c.element_size() for c in dev_caches.values())
    flat_dev = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    flat_host = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=pin)
    run = list(range(n))
    scattered = torch.randperm(pool)[:n].tolist()
    stream = torch.cuda.Stream(dev) if pin else None

    def on_side(fn):  # as the offload connector runs them
        if stream is None:
            return fn
        def wrapped():
            with torch.cuda.stream(stream):
                fn()
        return wrapped

    rows = {
        "pinned copy d2h": timed(lambda: flat_host.copy_(flat_dev, non_blocking=True), dev, args.repeat),
        "pinned copy h2d": timed(lambda: flat_dev.copy_(flat_host, non_blocking=True), dev, args.repeat),
        "offload d2h (run)": timed(on_side(lambda: copy_kv_blocks(dev_caches, host_caches, run, run, "d2h")),
                                   dev, args.repeat),
        "offload h2d (run)": timed(on_side(lambda: copy_kv_blocks(host_caches, dev_caches, run, run, "h2d")),
                                   dev, args.repeat),
        "offload d2h (scattered device ids)": timed(on_side(lambda: copy_kv_blocks(
            dev_caches, host_caches, scattered, run, "d2h")), dev, args.repeat),
        "offload h2d (scattered device ids)": timed(on_side(lambda: copy_kv_blocks(
            host_caches, dev_caches, run, scattered, "h2d")), dev, args.repeat),
    }
    copy_kv_blocks(dev_caches, host_caches, scattered, run, "d2h")  # the right bytes moved
    sync(dev)
    assert torch.equal(host_caches["l0"][:, :n], dev_caches["l0"][:, scattered].cpu())
    host_caches["l1"][:, :n].fill_(1)
    copy_kv_blocks(host_caches, dev_caches, run, scattered, "h2d")
    sync(dev)
    assert torch.equal(dev_caches["l1"][:, scattered].cpu(), host_caches["l1"][:, :n])
    gib = nbytes / (1 << 30)
    print(f"{gib:.2f} GiB each way on {dev} ({torch.cuda.get_device_name(dev) if pin else 'cpu'})")
    print("| copy | time (ms) | GB/s | of pinned copy |\n| --- | --- | --- | --- |")
    for name, t in rows.items():
        base = rows["pinned copy " + ("d2h" if "d2h" in name else "h2d")]
        print(f"| {name} | {1000 * t:.2f} | {nbytes / t / 1e9:.1f} | {base / t:.0%} |")
    print(json.dumps({k: round(nbytes / t / 1e9, 2) for k, t in rows.items()}))


if __name__ == "__main__":
    main()
