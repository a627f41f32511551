"""Data parallelism, expert parallelism and dual-batch overlap: offline throughput on 2 GPUs.

  dense: a dense model (default qwen3-0.6b-shape, dummy weights) at dp=1 on one GPU with N
         prompts, then dp=2 on two GPUs with 2N prompts: the ratio of output tokens/s is the
         DP scaling (target >= 1.9 of 2 x dp=1).
  moe:   the MoE shape (default qwen3-30b-a3b-shape; --num-layers cuts layers so it loads
         fast) at several batch sizes, decode throughput (decode-only steps: tokens / time in
         the step) for each layout: tp=2; dp=2 + expert parallelism; the same with
         dual-batch overlap. The crossovers (smallest batch where dp2+EP beats tp2, where DBO
         beats no DBO) are printed. Each row has its bytes floor (what one GPU must read in
         a decode step at --bw bytes/s: the experts the batch hits, the dense weights, the KV
         at the mean context) and step / floor.

`--tp N --dp M [--ep] [--dbo]` runs that one layout instead (four GPUs: `--tp 4`, `--dp 4 --ep`,
`--dp 2 --tp 2 --ep`); host_busy is printed per row as for the others.

Prints a markdown table and one JSON line per measurement. On a CPU (tiny models) it only
checks that everything runs:
  python benchmarks/bench_dp.py --mode moe --model builtin:qwen3-moe-tiny --device cpu \
      --batches 4 8 --input-len 16 --output-len 8
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np

from longserve import LLM, SamplingParams
from longserve.models.builtin import resolve_model


def prompts(vocab: int, n: int, length: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(100, vocab - 100, length).tolist()} for _ in range(n)]


def model_folder(model: str, num_layers: int | None) -> str:
    """The model's folder; with num_layers, a config-only copy with that many layers."""
    path = resolve_model(model)
    if not num_layers:
        return path
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["num_hidden_layers"] = num_layers
    cfg["mlp_only_layers"] = [i for i in cfg.get("mlp_only_layers", []) if i < num_layers]
    out = os.path.join(tempfile.gettempdir(), f"longserve-bench-{os.path.basename(path)}-{num_layers}l")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


def decode_steps(llm, since: list[int] | None = None) -> list[list]:
    """Each engine core's decode-only steps, (tokens, seconds), after the `since` counts."""
    cores = range(llm.engine.coordinator.num_cores)
    since = since or [0] * len(cores)
    return [llm.engine.call("decode_step_log", since[c], core=c) for c in cores]


def run_one(path: str, args, n: int, **layout) -> dict:
    load_format = "dummy" if not os.path.isfile(os.path.join(path, "model.safetensors")) else "auto"
    t_start = time.perf_counter()
    llm = LLM(path, device=args.device, dtype=args.dtype, load_format=load_format,
              max_model_len=args.input_len + args.output_len + 16,
              max_num_seqs=max(n // layout.get("data_parallel_size", 1), 1),  # per DP rank
              enforce_eager=args.enforce_eager, rank0_own_process=False if args.rank0_in_core else None,
              **layout)
    start_s = time.perf_counter() - t_start
    vocab = llm.config.model.vocab_size
    llm.generate(prompts(vocab, n, args.input_len, 7),  # warm-up at the same batch shapes
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    since = [len(steps) for steps in decode_steps(llm)]
    print(f"# {layout_name(layout)}, batch {n}: measuring", flush=True)  # (for a profiler's window)
    t = time.perf_counter()
    outs = llm.generate(prompts(vocab, n, args.input_len, 0),
                        SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True),
                        use_tqdm=False)
    elapsed = time.perf_counter() - t
    per_core = decode_steps(llm, since)
    model, elem = llm.config.model, llm.config.dtype.itemsize
    t_stop = time.perf_counter()
    llm.shutdown()
    shutdown_s = time.perf_counter() - t_stop
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    dec = [step for steps in per_core for step in steps]
    # the cores step side by side: decode tokens/s is the sum of each core's rate
    dec_tok_s = sum(sum(x[0] for x in steps) / sum(x[1] for x in steps) for steps in per_core if steps)
    row = dict(layout=layout_name(layout), batch=n, elapsed_s=round(elapsed, 3),
               output_tok_s=round(n_out / elapsed, 1),
               decode_tok_s=round(dec_tok_s, 1) if dec else None,
               decode_step_ms=round(1e3 * float(np.median([x[1] for x in dec])), 2) if dec else None,
               # the spread of a run's steps (runs of one layout have been bimodal: 4.2 or 5.5 ms)
               decode_step_p10_p90=([round(1e3 * float(np.percentile([x[1] for x in dec], q)), 2)
                                     for q in (10, 90)] if dec else None),
               # the share of a step the core's host was busy (not waiting for the device):
               # near 1, the host bounds the step
               host_busy=(round(1 - float(np.median([x[2] / x[1] for x in dec])), 2)
                          if dec else None),
               start_s=round(start_s, 1), shutdown_s=round(shutdown_s, 2))
    if model.is_moe:
        floor, hit = bytes_floor(model, layout, n, args.input_len + args.output_len / 2, elem)
        floor_ms = 1e3 * floor / args.bw
        row.update(experts_hit=round(hit, 1), floor_ms=round(floor_ms, 3),
                   step_over_floor=round(row["decode_step_ms"] / floor_ms, 2) if dec else None)
    return row


def bytes_floor(m, layout: dict, n: int, ctx: float, elem: int) -> tuple[float, float]:
    """(bytes one GPU reads in a decode step of n sequences of ctx tokens, experts hit a layer).
    n * top_k routings hit E * (1 - (1 - 1/E)^(n k)) experts, a 1 / (tp * dp) share of them
    on each GPU (EP: whole experts; else a slice of every expert's width); attention and the
    LM head split over TP (whole on each DP rank); the KV of its DP rank's sequences, its heads."""
    tp, dp = layout.get("tensor_parallel_size", 1), layout.get("data_parallel_size", 1)
    e, h = m.num_experts, m.hidden_size
    hit = e * (1 - (1 - 1 / e) ** (n * m.num_experts_per_tok))
    q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
    moe = len(m.moe_layers)
    weights = (moe * hit * 3 * h * m.moe_intermediate_size / (tp * dp)
               + (m.num_layers - moe) * 3 * h * m.intermediate_size / tp
               + m.num_layers * ((2 * h * q + 2 * h * kv) / tp + e * h) + m.vocab_size * h / tp)
    kv_bytes = n / dp * ctx * m.num_layers * 2 * kv / min(tp, m.num_kv_heads)
    return (weights + kv_bytes) * elem, hit


def layout_name(layout: dict) -> str:
    parts = [f"tp={layout.get('tensor_parallel_size', 1)}", f"dp={layout.get('data_parallel_size', 1)}"]
    if layout.get("enable_expert_parallel"):
        parts.append("EP")
    if layout.get("enable_dbo"):
        parts.append("DBO")
    return " ".join(parts)


def bench_dense(args) -> list[dict]:
    path = model_folder(args.model or "builtin:qwen3-0.6b-shape", args.num_layers)
    n = args.batches[0]
    one = run_one(path, args, n)
    dp = args.dp or 2
    two = run_one(path, args, n if args.same_prompts else dp * n, data_parallel_size=dp)
    two["speedup_vs_dp1"] = round(two["output_tok_s"] / one["output_tok_s"], 3)
    return [one, two]


def bench_moe(args) -> list[dict]:
    path = model_folder(args.model or "builtin:qwen3-30b-a3b-shape", args.num_layers)
    dbo = dict(enable_dbo=True, dbo_decode_token_threshold=args.dbo_decode_threshold)
    layouts = {"tp2": dict(tensor_parallel_size=2),
               "dp2ep": dict(data_parallel_size=2, enable_expert_parallel=True),
               "dp2ep-dbo": dict(data_parallel_size=2, enable_expert_parallel=True, **dbo),
               "tp2-dbo": dict(tensor_parallel_size=2, **dbo)}
    layouts = [layouts[name] for name in args.layouts]
    if args.tp or args.dp:  # one layout of any size (four GPUs: --tp 4; --dp 4 --ep; --dp 2 --tp 2 --ep)
        layouts = [dict(tensor_parallel_size=args.tp or 1, data_parallel_size=args.dp or 1,
                        enable_expert_parallel=args.ep, **(dbo if args.dbo else {}))]
    rows = []
    for n in args.batches:
        for layout in layouts:
            if layout.get("enable_dbo") and args.dbo_batches is not None and n not in args.dbo_batches:
                continue
            rows.append(run_one(path, args, n, **layout))
            print(json.dumps(rows[-1]), flush=True)
    return rows


def crossover(rows: list[dict], a: str, b: str) -> int | None:
    """Smallest batch where layout b's decode throughput beats layout a's."""
    by = {(r["layout"], r["batch"]): r["decode_tok_s"] or 0 for r in rows}
    wins = sorted(n for (name, n) in by if name == b and by[(b, n)] > by.get((a, n), float("inf")))
    return wins[0] if wins else None


def print_table(rows: list[dict]) -> None:
    keys = [k for k in rows[0] if any(k in r for r in rows)]
    keys += [k for r in rows for k in r if k not in keys]
    print("| " + " | ".join(keys) + " |")
    print("|" + " --- |" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r.get(k, "")) for k in keys) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["dense", "moe"], required=True)
    p.add_argument("--model", default=None, help="builtin:<name> or a folder (dummy weights "
                   "when it has none)")
    p.add_argument("--num-layers", type=int, default=None, help="cut the model to this many layers")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--rank0-in-core", action="store_true",
                   help="rank 0's worker in the engine core's process (default: its own on a GPU)")
    p.add_argument("--batches", type=int, nargs="+", default=[256],
                   help="dense: prompts per DP rank; moe: batch sizes to sweep")
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--same-prompts", action="store_true",
                   help="dense: dp=2 takes the same prompts as dp=1 (half a rank, as a server's "
                        "balancer splits them), not as many again")
    p.add_argument("--dbo-decode-threshold", type=int, default=32)
    p.add_argument("--bw", type=float, default=3.35e12, help="HBM bytes/s for the floor (H100)")
    p.add_argument("--layouts", nargs="+", default=["tp2", "dp2ep", "dp2ep-dbo"],
                   choices=["tp2", "dp2ep", "dp2ep-dbo", "tp2-dbo"], help="moe: the layouts to run")
    p.add_argument("--tp", type=int, default=None, help="moe: run this layout instead of --layouts")
    p.add_argument("--dp", type=int, default=None, help="moe: as --tp; dense: the DP size (default 2)")
    p.add_argument("--ep", action="store_true", help="with --tp/--dp: expert parallelism")
    p.add_argument("--dbo", action="store_true", help="with --tp/--dp: dual-batch overlap")
    p.add_argument("--dbo-batches", type=int, nargs="*", default=None,
                   help="the batches at which the DBO layouts run (default: all)")
    p.add_argument("--fail-on-compile", action="store_true",
                    help="fail the run when a kernel compiles after the engine is ready")
    args = p.parse_args()
    if args.fail_on_compile:  # the engine's processes inherit it (longserve/stalls.py)
        os.environ["LONGSERVE_FAIL_ON_COMPILE"] = "1"
    rows = bench_dense(args) if args.mode == "dense" else bench_moe(args)
    print_table(rows)
    summary = dict(mode=args.mode, rows=rows)
    if args.mode == "moe":
        summary["crossover_dp2_ep_beats_tp2"] = crossover(rows, "tp=2 dp=1", "tp=1 dp=2 EP")
        summary["crossover_dbo_beats_no_dbo"] = crossover(rows, "tp=1 dp=2 EP", "tp=1 dp=2 EP DBO")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
