"""One expert layer of Qwen3-30B-A3B's shape on one GPU: the fused Triton kernel against
torch's grouped GEMMs (FusedMoE.torch_experts), checked and timed (what fills BLOCK_CONFIGS in
models/fused_moe_kernel.py, and why CUDA runs the kernel at every size).

128 experts, top-8, hidden 2048, expert width 768, as one rank of two holds them:
  tp2: every expert, half its width (384);  ep2: 64 whole experts (the pairs routed to the
  other 64 are another rank's);  (--variants full: all 128 experts, whole, as on one GPU).
For each batch (tokens entering the layer) and each path: the relative error of the output
against a float32 reference (the same bf16 weights, float32 math), whether a CUDA-graph
replay on new inputs equals eager, and the median time of `FusedMoE.experts` (sort, both
GEMMs, combine) replayed in a CUDA graph, against its bytes floor (the expert weights that
the batch hits, at --bw), and with the router in front (its GEMM, softmax and top-k).
--sweep also times other block configs of the fused kernel; --per-launch times each GEMM launch
alone over the configs (gate-up and down may want different tiles; both share BLOCK_M).

    python benchmarks/bench_moe_kernel.py            # ~1-2 minutes on one H100
"""
import argparse
from types import SimpleNamespace

import torch
import torch.nn.functional as F
import triton.testing

from longserve.models import fused_moe_kernel
from longserve.models.moe import FusedMoE, select_experts

E, K, HIDDEN, WIDTH = 128, 8, 2048, 768
VARIANTS = {"tp2": (2, False), "ep2": (2, True), "tp4": (4, False), "ep4": (4, True), "full": (1, True)}  # (ranks, expert parallel)
SWEEP = [(16, 32, 128, 4, 4), (16, 64, 128, 4, 3), (16, 64, 128, 4, 4), (16, 128, 128, 4, 2), (32, 64, 64, 4, 4),
         (32, 128, 64, 4, 3), (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 3), (128, 64, 64, 4, 3),
         (128, 128, 64, 8, 3)]  # BLOCK_M, BLOCK_N, BLOCK_K, warps, stages


def expert_layer(ranks: int, ep: bool) -> FusedMoE:
    """Rank 0's share of the layer, random bf16 weights (std 0.02, as dummy loading)."""
    group = SimpleNamespace(world_size=ranks, rank_in_group=0)
    cfg = SimpleNamespace(num_experts=E, moe_intermediate_size=WIDTH, hidden_size=HIDDEN,
                          num_experts_per_tok=K, norm_topk_prob=True)
    with torch.device("cuda"):
        moe = FusedMoE(cfg, SimpleNamespace(dp=group, tp=SimpleNamespace(world_size=1, rank_in_group=0)), ep)
    for p in moe.parameters():
        p.data = torch.randn_like(p, dtype=torch.bfloat16) * 0.02
    return moe


def reference(moe: FusedMoE, x, weights, ids) -> torch.Tensor:
    """float32 math on the same bf16 values: per local expert, its tokens, one matmul each."""
    out = torch.zeros(x.shape[0], HIDDEN, device="cuda")
    local = ids - moe.first
    for e in range(moe.num_local):
        tok, slot = (local == e).nonzero(as_tuple=True)
        if tok.numel():
            h = x[tok].float() @ moe.w13[e].float().T
            h = F.silu(h[:, :moe.width]) * h[:, moe.width:]
            out.index_add_(0, tok, weights[tok, slot, None] * (h @ moe.w2[e].float().T))
    return out


def graphed(fn):
    fn()  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def check_and_time(moe, num_tokens: int, path: str) -> dict:
    """Error against float32, graph replay on new inputs vs eager, median us of a replay."""
    experts = moe.experts if path == "triton" else moe.torch_experts
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    logits = torch.randn(num_tokens, E, device="cuda", generator=g)
    w, ids = select_experts(logits, K, True)
    out = experts(x, w, ids)
    ref = reference(moe, x, w, ids)
    err = ((out.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item()  # 0: none routed here
    graph, static_out = graphed(lambda: experts(x, w, ids))
    x2, (w2, ids2) = torch.randn_like(x), select_experts(torch.randn_like(logits), K, True)
    for static, new in ((x, x2), (w, w2), (ids, ids2)):  # new tokens and routing, same shapes
        static.copy_(new)
    graph.replay()
    same = torch.equal(static_out, experts(x, w, ids))
    us = 1e3 * triton.testing.do_bench_cudagraph(lambda: experts(x, w, ids), return_mode="median")
    routed = 1e3 * triton.testing.do_bench_cudagraph(lambda: experts(x, *moe.route(x)),
                                                     return_mode="median")
    return dict(err=err, graph_ok=same, us=us, routed_us=routed)


def floor_us(moe: FusedMoE, num_tokens: int, bw: float) -> tuple[float, float]:
    """(experts of this rank the batch hits, microseconds to read their weights at bw)."""
    hit = moe.num_local * (1 - (1 - 1 / E) ** (num_tokens * K))
    return hit, 1e6 * hit * 3 * HIDDEN * moe.width * 2 / bw


def sweep(moe, num_tokens: int) -> str:
    """The fastest block config of the fused kernel at this batch."""
    saved, best = fused_moe_kernel.BLOCK_CONFIGS, None
    try:
        for cfg in SWEEP:
            fused_moe_kernel.BLOCK_CONFIGS = [(1 << 62,) + cfg]
            try:
                us = check_and_time(moe, num_tokens, "triton")["us"]
            except Exception as e:  # a config past the shared memory: say so, go on
                print(f"sweep {cfg} at {num_tokens}: {type(e).__name__}", flush=True)
                continue
            best = min(best or (us, cfg), (us, cfg))
    finally:
        fused_moe_kernel.BLOCK_CONFIGS = saved
    return f"{best[0]:.0f} us {best[1]}"


def per_launch(moe, num_tokens: int, bw: float) -> None:
    """Each expert GEMM launch alone at every SWEEP config: the best few, x the bytes of the
    expert weights it reads (align and combine timed apart)."""
    g = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, HIDDEN, device="cuda", generator=g).bfloat16()
    w, ids = select_experts(torch.randn(num_tokens, E, device="cuda", generator=g), K, True)
    hit, _ = floor_us(moe, num_tokens, bw)
    times = {True: [], False: []}
    for bm, bn, bk, warps, stages in SWEEP:
        slot_pair, block_expert = fused_moe_kernel.align_pairs(ids, moe.first, moe.num_local, bm)
        h = x.new_empty(slot_pair.numel(), moe.width)
        out = x.new_empty(ids.numel(), HIDDEN)
        for gate_up, a, b, c in ((True, x, moe.w13, h), (False, h, moe.w2, out)):
            def launch():
                fused_moe_kernel.expert_gemm(gate_up, a, b, c, slot_pair, block_expert, w.flatten(), K,
                                             (bm, bn, bk, warps, stages))
            launch()
            floor = 1e6 * hit * (2 if gate_up else 1) * HIDDEN * moe.width * 2 / bw
            us = 1e3 * triton.testing.do_bench_cudagraph(launch, return_mode="median")
            times[gate_up].append((us, f"{us:.1f} us ({us / floor:.2f}x) {(bm, bn, bk, warps, stages)}"))
    align = 1e3 * triton.testing.do_bench_cudagraph(
        lambda: fused_moe_kernel.align_pairs(ids, moe.first, moe.num_local, 64), return_mode="median")
    for gate_up in (True, False):
        print(f"{num_tokens} tokens, {'gate-up' if gate_up else 'down'}: "
              + "; ".join(t for _, t in sorted(times[gate_up])[:4]), flush=True)
    print(f"{num_tokens} tokens, align (BLOCK_M 64): {align:.1f} us", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="tp2,ep2")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 512])
    ap.add_argument("--bw", type=float, default=3.35e12, help="HBM bytes/s (H100)")
    ap.add_argument("--sweep", action="store_true", help="also time other fused block configs")
    ap.add_argument("--per-launch", action="store_true", help="only each GEMM launch over the configs")
    args = ap.parse_args()
    if args.per_launch:
        for name in args.variants.split(","):
            print(f"### {name}, {torch.cuda.get_device_name()}")
            for n in args.batches:
                per_launch(expert_layer(*VARIANTS[name]), n, args.bw)
        return
    print(f"### One expert layer, {torch.cuda.get_device_name()}, bf16, CUDA-graph replays\n")
    print("| variant | tokens | experts hit | floor us | fused us (x floor) | + router us "
          "| grouped_mm us (x floor) | rel err fused / gmm | graph = eager | best sweep |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.variants.split(","):
        moe = expert_layer(*VARIANTS[name])
        for n in args.batches:
            hit, floor = floor_us(moe, n, args.bw)
            fused, gmm = check_and_time(moe, n, "triton"), check_and_time(moe, n, "grouped_mm")
            best = sweep(moe, n) if args.sweep else ""
            print(f"| {name} | {n} | {hit:.1f} | {floor:.0f} | {fused['us']:.0f} ({fused['us'] / floor:.2f}x) "
                  f"| {fused['routed_us']:.0f} | {gmm['us']:.0f} ({gmm['us'] / floor:.2f}x) | {fused['err']:.1e} / {gmm['err']:.1e} "
                  f"| {fused['graph_ok'] and gmm['graph_ok']} | {best} |", flush=True)
        del moe
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
