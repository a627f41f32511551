"""The decode GEMV (models/gemv_kernel.py) against cuBLAS (F.linear) at Llama-3-8B's decode
shapes, one GPU and one rank of tp=2 (and smaller models' on one GPU): error against float32 and median time in a CUDA graph.

Each timed graph calls the linear on enough copies of the weight (>= 256 MB in all) that no
call finds its weight in L2, as in a decode step; us = graph time / copies, so it includes
the gap between kernels a graph has. TB/s = the weight's bytes / us. --sweep also times
other tile configs (what fills gemv_config).

    python benchmarks/bench_gemv.py --bw 3.35e12 [--rows 1,4,16] [--sweep]
"""
import argparse
import itertools
import math

import torch
import torch.nn.functional as F

from longserve.models.gemv_kernel import gemv_config, gemv_triton

HID, INTER, Q, KV, VOCAB = 4096, 14336, 32 * 128, 8 * 128, 128256
SHAPES = {  # name: (N, K) of the weight
    "1gpu qkv": (Q + 2 * KV, HID), "1gpu o": (HID, Q), "1gpu gate_up": (2 * INTER, HID),
    "1gpu down": (HID, INTER), "1gpu lm_head": (VOCAB, HID),
    "tp2 qkv": ((Q + 2 * KV) // 2, HID), "tp2 o": (HID, Q // 2), "tp2 gate_up": (INTER, HID),
    "tp2 down": (HID, INTER // 2), "tp2 lm_head": (VOCAB // 2, HID),
    "tp2 1kv qkv": (Q // 2 + 2 * 128, HID),
    # smaller models, one GPU: Qwen3-0.6B, SmolLM2-135M, Qwen3-30B-A3B's router
    "qwen3-0.6b qkv": (4096, 1024), "qwen3-0.6b o": (1024, 2048), "qwen3-0.6b gate_up": (6144, 1024),
    "qwen3-0.6b down": (1024, 3072), "qwen3-0.6b lm_head": (151936, 1024),
    "smollm2 qkv": (960, 576), "smollm2 o": (576, 576), "smollm2 gate_up": (3072, 576),
    "smollm2 down": (576, 1536), "smollm2 lm_head": (49152, 576), "moe router": (128, 2048),
}
SWEEP = [(bn, bk, w, s) for (bn, bk), w, s in itertools.product(
    [(2, 1024), (4, 512), (4, 1024), (8, 256), (8, 512), (8, 1024), (16, 256), (16, 512), (32, 128),
     (32, 256), (64, 256)], [4, 8], [2, 3, 4, 5])]


def graph_us(fn, copies: int, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return sorted(times)[reps // 2]


def rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def bench_shape(name, n, k, rows, args):
    nbytes = n * k * 2
    copies = max(1, math.ceil(256e6 / nbytes))
    ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ ws[0].float().T
    errs = rel_err(F.linear(x, ws[0]), ref), rel_err(gemv_triton(x, ws[0]), ref)
    cublas = graph_us(lambda: [F.linear(x, w) for w in ws], copies)
    ours = graph_us(lambda: [gemv_triton(x, w) for w in ws], copies)
    tbs = lambda us: nbytes / us / 1e6
    line = (f"| {name} | {rows} | {nbytes / 1e6:.1f} | {cublas:.1f} ({tbs(cublas):.2f}) | {ours:.1f} "
            f"({tbs(ours):.2f}) | {cublas / ours:.2f}x | {nbytes / args.bw * 1e6:.1f} | "
            f"{errs[0]:.1e} / {errs[1]:.1e} | {gemv_config(rows, k)}")
    if args.sweep:
        best = None
        for cfg in SWEEP:
            if k % cfg[1] or (rows > 1 and cfg[0] < 16):
                continue
            us = graph_us(lambda: [gemv_triton(x, w, config=cfg) for w in ws], copies, reps=5)
            best = min(best or (us, cfg), (us, cfg))
        line += f" | {best[0]:.1f} ({tbs(best[0]):.2f}) {best[1]}"
    print(line + " |", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="1,4,16")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--bw", type=float, default=3.35e12, help="the GPU's memory bandwidth, bytes/s")
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}; us a call (TB/s of weight)")
    print("| weight | rows | MB | cuBLAS | GEMV | speed-up | floor us | rel err (cuBLAS / GEMV) | config |"
          + (" best of sweep |" if args.sweep else ""))
    print("| --- " * (10 + args.sweep) + "|")
    for rows in map(int, args.rows.split(",")):
        for name in args.shapes.split(","):
            bench_shape(name, *SHAPES[name], rows, args)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
