"""Capacity and long-context decode: one long prompt, prefilled, then decoded; the decode step
against its bytes floor.

Default: Llama-3-8B shape (random weights, bf16), a 1M-token prompt on 4 GPUs with pcp=4,
chunked prefill over the sharded cache (--chunk tokens a step), then --decode tokens.
Prints the prefill time and TFLOP/s per GPU (FLOPs as in bench_prefill.py), the median decode
step, and its floor: the bytes one rank reads a step (the weights, split by TP and whole on
every PCP / DCP rank, plus its share of the KV) at --bw bytes/s.

--layouts 1,pcp4,tp4,pcp2xtp2,tp4xdcp2 runs each layout in turn and prints a table: TTFT,
efficiency against the one-GPU row, the decode step against its floor, and a decode step's
kernel launches and collective time a layer (rank 0, profiled over 3 steps of 11 or more).

--kv-cache-dtype auto,fp8 runs each in turn (a fresh engine each) and prints the ratio of
their decode steps; --model builtin:llama3-8b-1kv-shape is the shape where DCP should win:

    python benchmarks/bench_capacity.py --tokens 131072 --pcp 1 --decode 48 --kv-cache-dtype auto,fp8
    python benchmarks/bench_capacity.py --tokens 131072 --pcp 1 --tp 2 --dcp 2 --model builtin:llama3-8b-1kv-shape

--load: the --batch prompts in one generate, output tokens/s (FP8 under load).
--batch B decodes B such prompts together: all prefilled first, then run again from the prefix
cache so that they decode together (the steps where all B decode are timed), e.g. the
one-KV-head shape under load: --batch 64 --tokens 32000; --profile N prints where N of those
steps spend rank 0's host and device time (BENCH_TRACE=file.json: the profiled steps' timeline,
read by benchmarks/trace_gaps.py).
"""
import argparse
import gc
import os
import time

import numpy as np
import torch

# the step timer steps the engine core itself: in this process, on this thread
os.environ.setdefault("LONGSERVE_ENABLE_MULTIPROCESSING", "0")

from longserve import LLM, SamplingParams  # noqa: E402

PARAMS, LAYERS, HEADS, HEAD_DIM = 8.03e9, 32, 32, 128


def kv_share(num_kv_heads: int, tp: int, dcp: int, pcp: int) -> float:
    """The share of the KV one rank holds: its KV heads (replicated when fewer than the
    tp / dcp head groups: topology.kv_heads_of_rank) over its CP shard of the tokens."""
    groups = tp // dcp
    heads = num_kv_heads // groups if num_kv_heads >= groups else 1
    return heads / num_kv_heads / (pcp * dcp)


COLLECTIVE_KERNELS = ("nccl", "all_reduce", "allreduce", "all_gather", "reduce_scatter", "alltoall")


def profile_steps(core, steps: int, quiet: bool = False) -> dict:
    """Rank 0's host and device time over `steps` decode steps, by op (torch profiler): the
    device's busy time against the wall time (host-bound or device-bound?), the kernels by
    device time, and the ops by host time (per layer: divide the calls by the layers). Returns
    the step's wall and busy ms, its kernel launches and its collectives' device us."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            core.step()
        torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t) / steps
    if os.environ.get("BENCH_TRACE"):  # a timeline to read: benchmarks/trace_gaps.py
        prof.export_chrome_trace(os.environ["BENCH_TRACE"])
    events = prof.key_averages()
    # the device's own events, as the table's total: CPU ops (record_param_comms) and NCCL's
    # annotations carry their kernels' time again
    kernels = [e for e in events if e.device_type == DeviceType.CUDA and not e.is_user_annotation]
    busy_ms = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    stats = dict(wall_ms=wall_ms, busy_ms=busy_ms, kernels=sum(e.count for e in kernels) / steps,
                 collective_us=sum(e.self_device_time_total for e in kernels
                                   if any(c in e.key.lower() for c in COLLECTIVE_KERNELS)) / steps)
    if not quiet:
        print(f"profile: {wall_ms:.2f} ms a step, the device busy {busy_ms:.2f} ms of it", flush=True)
        print(events.table(sort_by="self_device_time_total", row_limit=25), flush=True)
        print(events.table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    return stats


def prefill_and_decode(engine, core, prompts, decode: int, profile: int = 0, profile_chunk: int = 0):
    """Step the core through the prompts' chunks, then their decode steps; (requests, prefill
    seconds, decode step seconds: the steps where every request decodes). profile: that many
    such steps under the profiler; profile_chunk: the prefill steps from that index under it."""
    reqs = []
    for prompt in prompts:
        req = engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=decode, ignore_eos=True))
        core.add_request(req)
        reqs.append(core.scheduler.requests[req.request_id])
    t0, prefill_s, step_times, stats = time.perf_counter(), None, [], None
    while core.has_work():
        t = time.perf_counter()
        core.step()
        if prefill_s is None and all(r.output_token_ids for r in reqs):
            prefill_s = time.perf_counter() - t0
        elif prefill_s is None:
            print(f"  prefilled {sum(r.num_computed_tokens for r in reqs)} tokens at {t - t0:.1f} s "
                  f"(step {time.perf_counter() - t:.2f} s)", flush=True)
            profile_chunk -= 1
            if profile_chunk == 0:  # three steps: the host's and the device's overlap between them
                profile_steps(core, 3)
        elif all(1 < len(r.output_token_ids) < decode for r in reqs):
            step_times.append(time.perf_counter() - t)
            if len(step_times) == 8:  # a few steps under the profiler: launches and collectives
                stats = profile_steps(core, profile or 3, quiet=not profile)
    return reqs, prefill_s, step_times, stats


def load_run(llm, prompts, args, kv_cache_dtype: str) -> float:
    """--load: the batch as one offline generate (prefill, preemptions and all); output tok/s."""
    t = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.decode, ignore_eos=True), use_tqdm=False)
    dt = time.perf_counter() - t
    toks = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = max(o.metrics["time_to_first_token"] for o in outs)  # every prompt prefilled by then
    print(f"load: {torch.cuda.get_device_name()}, {args.model}, kv_cache_dtype={kv_cache_dtype}, "
          f"{args.batch} x ({args.tokens} + {args.decode}): {dt:.1f} s, {toks / dt:.1f} output tok/s; "
          f"last first token at {ttft:.1f} s, "
          f"{sum(o.metrics['num_preemptions'] for o in outs)} preemptions", flush=True)
    return toks / dt


def run(args, kv_cache_dtype: str):
    """One engine with this KV dtype: --load's output tok/s, else decode_run's row."""
    s = args.tokens
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_num_seqs=args.batch,
              max_model_len=s + args.decode + 64, max_num_batched_tokens=args.chunk,
              enable_prefix_caching=args.batch > 1, prefill_context_parallel_size=args.pcp,
              tensor_parallel_size=args.tp, decode_context_parallel_size=args.dcp,
              rank0_own_process=False,  # rank 0's runner in this process: its weights, the profiler
              enforce_eager=args.enforce_eager, kv_cache_dtype=kv_cache_dtype)
    cfg = llm.config.model
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(100, min(128000, cfg.vocab_size), s).tolist()}
               for _ in range(args.batch)]
    result = (load_run if args.load else decode_run)(llm, prompts, args, kv_cache_dtype)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()  # the next run (another KV dtype) gets the whole device
    return result


def decode_run(llm, prompts, args, kv_cache_dtype: str) -> dict:
    """Prefill, then the decode steps where every request decodes: TTFT, the median step (ms),
    its floor and (from 11 decode steps on) a layer's kernels and collective time."""
    s, cfg = args.tokens, llm.config.model
    with llm.engine.client.paused() as core:  # this thread steps the engine core
        weight_bytes = sum(p.numel() * p.element_size()  # rank 0's share of the weights
                           for p in core.executor.driver.runner.model.parameters())
        pool_tokens = core.kv.num_blocks * core.kv.tokens_per_block
        if args.batch > 1:  # prefill them all first; then each decodes from the prefix cache
            prefill_s = prefill_and_decode(llm.engine, core, prompts, 1)[1]
        reqs, prefill2_s, step_times, stats = prefill_and_decode(llm.engine, core, prompts, args.decode,
                                                                 args.profile, args.profile_chunk)
        prefill_s = prefill2_s if args.batch == 1 else prefill_s
    ranks = args.pcp * args.tp
    flops = args.batch * (2 * PARAMS * s + 2 * s * s * HEADS * HEAD_DIM * LAYERS)
    elem = 1 if kv_cache_dtype == "fp8" else 2
    kv_bytes = args.batch * s * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * elem
    rank_kv = kv_bytes * kv_share(cfg.num_kv_heads, args.tp, args.dcp, args.pcp)
    floor_ms = 1e3 * (weight_bytes + rank_kv) / args.bw
    step_ms = 1e3 * float(np.median(step_times))
    gpu_mem = torch.cuda.get_device_properties(0).total_memory
    print(f"device: {torch.cuda.get_device_name()} x {ranks} (pcp={args.pcp}, tp={args.tp}, "
          f"dcp={args.dcp}), {args.model}, kv_cache_dtype={kv_cache_dtype}, "
          f"{'eager' if args.enforce_eager else 'CUDA graphs'}")
    print(f"{args.batch} prompt(s) of {s} tokens: prefill {prefill_s:.2f} s, {flops / prefill_s / ranks / 1e12:.0f} TFLOP/s per GPU")
    print(f"decode: {len(step_times)} steps of batch {args.batch}, median step {step_ms:.2f} ms; floor {floor_ms:.2f} ms "
          f"({rank_kv / 2**30:.1f} GiB KV + {weight_bytes / 2**30:.1f} GiB weights a rank at "
          f"{args.bw / 1e12:.1f} TB/s): {step_ms / floor_ms:.2f}x")
    print(f"KV of the prompt: {kv_bytes / 2**30:.1f} GiB in all, {rank_kv / 2**30:.1f} GiB per rank; "
          f"one GPU has {gpu_mem / 2**30:.0f} GiB; the pool holds {pool_tokens} tokens")
    row = dict(layout=f"pcp={args.pcp} tp={args.tp} dcp={args.dcp}", gpus=ranks, ttft_s=prefill_s,
               step_ms=step_ms, floor_ms=floor_ms)
    if stats is not None:  # per layer: rank 0's kernel launches and collectives' device time
        row.update(kernels_per_layer=stats["kernels"] / cfg.num_layers,
                   collective_us_per_layer=stats["collective_us"] / cfg.num_layers)
        print(f"a decode step's layer (rank 0): {row['kernels_per_layer']:.1f} kernels, "
              f"{row['collective_us_per_layer']:.1f} us in collectives", flush=True)
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:llama3-8b-shape")
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--pcp", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--dcp", type=int, default=1)
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="requests, each with a --tokens prompt")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--profile", type=int, default=0, help="profile this many decode steps (rank 0)")
    ap.add_argument("--profile-chunk", type=int, default=0, help="profile the prefill step after this one")
    ap.add_argument("--kv-cache-dtype", default="auto", help="a comma list: auto, fp8")
    ap.add_argument("--layouts", default="", help="a comma list run in turn, with efficiency against "
                    "the one-GPU row, e.g. 1,pcp4,tp4,pcp2xtp2,tp4xdcp2 (overrides --pcp/--tp/--dcp)")
    ap.add_argument("--bw", type=float, default=4.2e12, help="HBM bytes/s for the floor (H200: 4.2e12)")
    ap.add_argument("--load", action="store_true",
                    help="output tok/s of the batch in one generate (e.g. --batch 32 --tokens 16384 "
                         "--decode 1024 --pcp 1: FP8 under load)")
    ap.add_argument("--fail-on-compile", action="store_true",
                    help="fail the run when a kernel compiles after the engine is ready")
    args = ap.parse_args()
    if args.fail_on_compile:  # the engine's processes inherit it (longserve/stalls.py)
        os.environ["LONGSERVE_FAIL_ON_COMPILE"] = "1"
    if args.layouts:
        return compare_layouts(args)
    steps = {d: run(args, d) for d in args.kv_cache_dtype.split(",")}
    if {"auto", "fp8"} <= set(steps):
        what = "output tok/s" if args.load else "decode step"
        value = {d: r if args.load else r["step_ms"] for d, r in steps.items()}
        print(f"fp8 / bf16 {what}: {value['fp8'] / value['auto']:.3f}")


def parse_layout(name: str) -> dict:
    """'1', 'pcp4', 'tp4', 'pcp2xtp2', 'tp4xdcp2' -> {pcp, tp, dcp}."""
    sizes = dict(pcp=1, tp=1, dcp=1)
    for part in name.split("x"):
        kind = part.rstrip("0123456789")
        if part != "1":
            sizes[kind] = int(part[len(kind):])
    return sizes


def compare_layouts(args) -> None:
    """Each layout in turn on this machine (a fresh engine each): TTFT, efficiency against the
    first one-GPU row (T1 / (GPUs x TN)), the decode step against its floor, and a decode step's
    kernels and collective time a layer."""
    rows = []
    for name in args.layouts.split(","):
        vars(args).update(parse_layout(name))
        rows.append(run(args, args.kv_cache_dtype.split(",")[0]))
    one = next((r["ttft_s"] for r in rows if r["gpus"] == 1), None)
    print(f"\n{args.tokens} tokens, chunk {args.chunk}, {args.model}, {torch.cuda.get_device_name()}\n")
    print("| layout | GPUs | TTFT (s) | efficiency | decode step (ms) | step / floor | kernels a layer "
          "| collectives a layer (us) |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:  # (kernels and collectives: "-" when --decode left fewer than 8 steps to profile)
        eff = f"{one / (r['gpus'] * r['ttft_s']):.2f}" if one else ""
        per_layer = [f"{r[k]:.1f}" if k in r else "-" for k in ("kernels_per_layer", "collective_us_per_layer")]
        print(f"| {r['layout']} | {r['gpus']} | {r['ttft_s']:.2f} | {eff} | {r['step_ms']:.2f} | "
              f"{r['step_ms'] / r['floor_ms']:.2f}x | {' | '.join(per_layer)} |")


if __name__ == "__main__":
    main()
