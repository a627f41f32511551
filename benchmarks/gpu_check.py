"""GPU correctness checks (run on a CUDA machine; prints a table).

1. float32 on the GPU gives the CPU reference's greedy tokens on the built-in models.
2. bfloat16 agrees with float32 on >= 99% of greedy tokens over 256-token generations
   (counted up to the first divergence per request, then the rest compared as well).
3. CUDA graphs (full graphs for decode, piecewise for steps with prefill) give the tokens of eager.
4. --cp-merge: the CP merge (attention/cp_attention.py). One GPU: the Triton merge kernel
   against the torch reference and the old path's formula, eager and replayed in a CUDA graph.
   Two or more GPUs: the one all-to-all + merge over NCCL against the old LSE all-gather +
   all-reduce / reduce-scatter sequence, captured in a CUDA graph too, with both timed.
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from longserve import LLM, SamplingParams
from longserve.attention.cp_attention import exchange_partials, merge_partials, pack_partial
from longserve.distributed.parallel_state import GroupCoordinator


def prompts(n, lo, hi, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, vocab - 3, (int(torch.randint(lo, hi, (1,), generator=g)),),
                                               generator=g).tolist()} for _ in range(n)]


def run(model, ps, max_tokens, logprobs=None, **kw):
    llm = LLM(model, **kw)
    t = time.perf_counter()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate(ps, params, use_tqdm=False)
    dt = time.perf_counter() - t
    whole = all(s["num_free_blocks"] == s["num_blocks"] for s in llm.engine.pool_states())
    llm.shutdown()
    del llm
    torch.cuda.empty_cache() if torch.cuda.is_initialized() else None  # (is_available() starts the
    # CUDA driver here, and the next engine's processes are spawned, not forked)
    if logprobs:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], dt, whole
    return [o.outputs[0].token_ids for o in outs], dt, whole


def agreement(a, b):
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    return same / sum(len(r) for r in a)


def logprobs_close(a, b):
    """vLLM's rule for low precision: up to the first differing token the sequences agree,
    and there each model's token is among the other's top log-probabilities. Returns the
    share of requests that pass and the share of tokens before the first divergence."""
    ok, before = 0, 0
    for (ta, la), (tb, lb) in zip(a, b):
        i = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        before += len(ta) if i is None else i
        ok += i is None or (ta[i] in lb[i] and tb[i] in la[i])
    return ok / len(a), before / sum(len(t) for t, _ in a)


def single_gpu_checks(name, rows, skip_bf16, dev):
    """fp32 GPU vs CPU reference, CUDA graphs vs eager, bf16 vs fp32 (one GPU)."""
    model = f"builtin:{name}"
    ps = prompts(16, 5, 300, 512)
    cpu, _, _ = run(model, ps, 32, device="cpu", dtype="float32")
    gpu32, _, w1 = run(model, ps, 32, device=dev, dtype="float32")
    eager, _, w2 = run(model, ps, 32, device=dev, dtype="float32", enforce_eager=True)
    rows.append((name, "fp32 GPU vs CPU", agreement(gpu32, cpu), w1))
    rows.append((name, "CUDA graphs vs eager (fp32)", agreement(gpu32, eager), w2))
    if skip_bf16:
        return
    long_ps = prompts(32, 16, 512, 512, seed=1)
    ref, _, _ = run(model, long_ps, 256, logprobs=5, device=dev, dtype="float32")
    bf, _, w3 = run(model, long_ps, 256, logprobs=5, device=dev, dtype="bfloat16")
    passed, before = logprobs_close(bf, ref)
    rows.append((name, "bf16 vs fp32, 256 tokens: position-wise", agreement([t for t, _ in bf], [t for t, _ in ref]), w3))
    rows.append((name, "bf16 vs fp32, 256 tokens: requests logprob-close", passed, w3))
    rows.append((name, "bf16 vs fp32, 256 tokens: tokens before 1st divergence", before, w3))


SHORT = {"tensor_parallel_size": "tp", "prefill_context_parallel_size": "pcp",
         "data_parallel_size": "dp", "enable_expert_parallel": "ep", "enable_dbo": "dbo",
         "decode_context_parallel_size": "dcp", "cp_kv_cache_interleave_size": "interleave"}


def parallel_checks(name, layouts, rows, dev, eager_check, skip_bf16=False):
    """Each layout against one GPU: fp32 tokens, and bf16 by position and logprob-close."""
    model = f"builtin:{name}"
    ps, long_ps = prompts(16, 5, 300, 512), prompts(32, 16, 512, 512, seed=1)
    kw = dict(device=dev, max_num_seqs=32)
    one32, _, _ = run(model, ps, 32, dtype="float32", **kw)
    one16 = None if skip_bf16 else run(model, long_ps, 256, logprobs=5, dtype="bfloat16", **kw)[0]
    for par in layouts:
        tag = ",".join(f"{SHORT.get(k, k)}={v}" for k, v in par.items())
        par32, _, w1 = run(model, ps, 32, dtype="float32", **kw, **par)
        rows.append((name, f"{tag} vs 1 GPU, fp32", agreement(par32, one32), w1))
        print(rows[-1], flush=True)
        if eager_check:
            eager, _, w2 = run(model, ps, 32, dtype="float32", enforce_eager=True, **kw, **par)
            rows.append((name, f"{tag}: CUDA graphs vs eager (fp32)", agreement(par32, eager), w2))
            print(rows[-1], flush=True)
        if skip_bf16:
            continue
        par16, _, w3 = run(model, long_ps, 256, logprobs=5, dtype="bfloat16", **kw, **par)
        passed, before = logprobs_close(par16, one16)
        rows.append((name, f"{tag} vs 1 GPU, bf16 256 tokens: position-wise",
                     agreement([t for t, _ in par16], [t for t, _ in one16]), w3))
        rows.append((name, f"{tag} vs 1 GPU, bf16: requests logprob-close", passed, w3))
        rows.append((name, f"{tag} vs 1 GPU, bf16: tokens before 1st divergence", before, w3))
        print(rows[-3:], flush=True)


def old_merge(out, lse, g, scatter_heads):
    """The path the exchange replaced: LSE all-gather, rescale, all-reduce or reduce-scatter."""
    lses = g.all_gather(lse[None].contiguous(), 0)
    glob = torch.logsumexp(lses, 0)
    x = out.float() * torch.exp(lse - glob).nan_to_num(0.0)[..., None]
    return g.reduce_scatter(x, 1) if scatter_heads else g.all_reduce(x)


def graphed(fn):
    """fn captured in a CUDA graph (after a warm-up); returns a replay that gives its output."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = fn()
    return lambda: (graph.replay(), res)[1]


def timed_us(fn, n=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def cp_merge_kernel_check(rows):
    """One GPU: merge_partials_triton vs the torch reference and the old formula, with empty
    shards (-inf) and a row empty on every shard; eager and in a CUDA graph."""
    from longserve.attention.triton_kernels import merge_partials_triton
    for W, dtype in [(2, torch.float32), (4, torch.bfloat16), (8, torch.bfloat16)]:
        parts = torch.randn(W, 64, 32, 129, device="cuda")
        parts[..., -1] *= 4
        parts[0, :8, :, -1] = float("-inf")
        parts[:, 9, :, -1] = float("-inf")
        ref, ref_lse = merge_partials(parts.double(), torch.float64)
        lses = parts[..., -1]
        glob = torch.logsumexp(lses, 0)
        old = (parts[..., :-1] * torch.exp(lses - glob).nan_to_num(0.0)[..., None]).sum(0)
        out, lse = merge_partials_triton(parts, dtype)
        replay = graphed(lambda: merge_partials_triton(parts, dtype))
        parts.copy_(parts.flip(0))  # new values, same shapes: the replay must follow them
        g_out, _ = replay()
        g_ref = merge_partials(parts.double(), torch.float64)[0]
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        ok = all(torch.allclose(a.double(), b, atol=tol, rtol=tol)
                 for a, b in [(out, ref), (out, old.double()), (g_out, g_ref)])
        ok = ok and torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse.float()))
        rows.append(("cp-merge", f"Triton merge, {W} shards, {dtype}: eager, old formula, graph", float(ok), True))


def _cp_merge_rank(rank, world, port, results):
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.cuda.set_device(rank)
    g = GroupCoordinator(list(range(world)), rank, dist.group.WORLD)
    gen = torch.Generator(device="cuda").manual_seed(rank)
    out = torch.randn(8, 32 * world, 128, device="cuda", generator=gen, dtype=torch.bfloat16)
    lse = torch.randn(8, 32 * world, device="cuda", generator=gen) * 4
    if rank == world - 1:
        lse.fill_(float("-inf"))  # an empty shard
    res = {}
    for tag, dcp, scatter in [("dcp", world, True), ("pcp", 1, False)]:
        new = lambda: merge_partials(exchange_partials(pack_partial(out, lse), g, dcp), torch.float32)[0]  # noqa: E731
        old = lambda: old_merge(out, lse, g, scatter)  # noqa: E731
        err = (new() - old()).abs().max().item()
        graph_err = (graphed(new)() - old()).abs().max().item()
        res[tag] = (err, graph_err, timed_us(old), timed_us(new))
    results.put((rank, res))
    dist.destroy_process_group()


def cp_merge_collective_check(rows):
    """All GPUs as one CP group: one all-to-all + merge equals the old three-collective path."""
    world = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = 29500 + os.getpid() % 1000
    procs = [ctx.Process(target=_cp_merge_rank, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    for tag, (err, graph_err, old_us, new_us) in got[0].items():
        rows.append(("cp-merge", f"{tag}={world} all-to-all vs old path (max err {err:.1e}, graph "
                     f"{graph_err:.1e}; old {old_us:.0f} us, new {new_us:.0f} us)",
                     float(max(err, graph_err) < 1e-4), True))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--parallel", default="[]",
                    help="JSON list of layouts (LLM kwargs) to compare with one GPU, e.g. "
                         '\'[{"tensor_parallel_size": 2}]\'')
    ap.add_argument("--models", default="llama-tiny,qwen2-tiny,qwen3-tiny")
    ap.add_argument("--skip-bf16", action="store_true")
    ap.add_argument("--eager-check", action="store_true", help="also CUDA graphs vs eager per layout")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cp-merge", action="store_true", help="only the CP merge checks (item 4)")
    args = ap.parse_args()
    layouts = json.loads(args.parallel)
    rows = []
    if args.cp_merge:
        cp_merge_kernel_check(rows)
        if torch.cuda.device_count() > 1:
            cp_merge_collective_check(rows)
        args.models = ""
    for name in filter(None, args.models.split(",")):
        if layouts:
            parallel_checks(name, layouts, rows, args.device, args.eager_check, args.skip_bf16)
        else:
            single_gpu_checks(name, rows, args.skip_bf16, args.device)
    dev = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    n = torch.cuda.device_count() if args.device == "cuda" else 0
    print(f"\n### GPU correctness ({dev}, {n} GPU(s))\n")
    print("| model | check | agreement | pool whole |\n| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {100 * r[2]:.2f}% | {r[3]} |")


if __name__ == "__main__":
    main()
