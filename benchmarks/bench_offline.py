"""Offline batch throughput on one GPU: LongServe vs HF transformers `generate`, same GPU, same run.

Workloads (`--workload`):
  fixed  N prompts x (input-len in + output-len out), as in performance.md (default 256 x
         (1024 + 256)).
  nano   the workload nano-vllm publishes: N = 256 sequences, input and output lengths each
         uniform in [100, 1024] (numpy default_rng(0); `--nano-min-len/--nano-max-len` shrink
         it for CPU checks), random token ids, ignore_eos, greedy.
Random weights at the named built-in shapes. Throughput = output tokens asked for / wall time
(as nano-vllm reports it), wall time between two device synchronisations.

HF baseline (the same prompts, the same device, in the same run): HF `generate` has one
max_new_tokens per batch and no continuous batching, so with uneven lengths it runs static
batches, left-padded to the batch's longest prompt (attention mask), every row to the batch's
longest output (min_new_tokens = max_new_tokens: no row stops at EOS). Only the tokens each
sequence asked for are counted, so HF pays for its padding and for rows that run past their
length: that is what `generate` costs for this job. `--hf-groups G` sorts the sequences by
output length into G batches (less waste per row, G times fewer rows a step, more steps);
default 1, one batch of everything. The fixed workload has nothing to pad.

The bytes floor (docs/benchmarks.md): every step reads the weights once (bytes per parameter x
parameters) plus every scheduled sequence's KV (context tokens x KV bytes per token); the run's
floor is the sum over the steps the engine actually ran (recorded by wrapping the executor's
step launch, `execute_async`) over the memory bandwidth (`--bw`, TB/s; 4.2 on H200).
Parameters and KV bytes per token come from the model config. The full-batch decode step is timed over a window of
consecutive full-batch steps (device synchronised at both ends; not execute's wall time, which
asynchronous scheduling makes return before the GPU is done) against the same floor of those
steps.

`--profile`: a window of mixed prefill+decode steps and one of decode-only steps, under
torch.profiler (CUDA activity): GPU busy = union of kernel / memcpy / memset intervals over the
window's GPU span (first to last GPU activity), idle = 1 - busy; and a per-step host-time
split from perf_counter timers wrapped around the engine's functions (see HOST_PARTS).
`--profile-run`: the same over the whole workload, run once more on other token ids.

CPU check: `--models qwen3-tiny --device cpu --workload nano --num-prompts 8 --nano-min-len 8
--nano-max-len 32 --max-num-batched-tokens 64 --hf qwen3-tiny --profile`.
"""
import argparse
import contextlib
import importlib
import json
import os
import sys
import tempfile
import time
from collections import namedtuple
from dataclasses import dataclass

import numpy as np
import torch

# the step timers and profiler windows step the engine core themselves: it runs in this process
os.environ.setdefault("LONGSERVE_ENABLE_MULTIPROCESSING", "0")

from longserve import LLM, SamplingParams  # noqa: E402
from longserve.engine.messages import EngineCoreRequest  # noqa: E402
from longserve.models.builtin import model_config, resolve_model  # noqa: E402

# one model step as the executor received it: decode rows, prefill tokens, seconds inside
# execute (host time under asynchronous scheduling), sequences, context tokens summed over them
StepRecord = namedtuple("StepRecord", "decode_rows prefill_tokens seconds num_seqs context_tokens")


# ---- workloads ---------------------------------------------------------------------------------
@dataclass
class Workload:
    name: str
    prompts: list[list[int]]  # token ids
    out_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.out_lens)


def fixed_workload(n: int, inp: int, out: int, vocab: int, seed: int = 0) -> Workload:
    rng = np.random.default_rng(seed)
    return Workload("fixed", [rng.integers(100, vocab - 100, inp).tolist() for _ in range(n)], [out] * n)


def nano_workload(n: int, vocab: int, lo: int = 100, hi: int = 1024, seed: int = 0,
                  token_seed: int | None = None) -> Workload:
    """nano-vllm's benchmark: lengths uniform in [lo, hi] (inclusive), token ids in
    [0, 10000] (within the vocabulary). token_seed: other ids, the same lengths."""
    rng = np.random.default_rng(seed)
    in_lens, out_lens = rng.integers(lo, hi + 1, n), rng.integers(lo, hi + 1, n)
    tok = rng if token_seed is None else np.random.default_rng(token_seed)
    top = min(10001, vocab)
    return Workload("nano", [tok.integers(0, top, int(k)).tolist() for k in in_lens],
                    [int(k) for k in out_lens])


def make_workload(args, vocab: int, token_seed: int | None = None) -> Workload:
    if args.workload == "nano":
        return nano_workload(args.num_prompts, vocab, args.nano_min_len, args.nano_max_len, 0, token_seed)
    return fixed_workload(args.num_prompts, args.input_len, args.output_len, vocab,
                          0 if token_seed is None else token_seed)


_bench_ids = iter(range(1 << 62))


def add_requests(eng, wl: Workload, max_tokens: list[int] | int) -> None:
    """Straight into the engine core (`eng`: the paused in-process core the caller steps)."""
    outs = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(wl.prompts)
    for p, m in zip(wl.prompts, outs):
        eng.add_request(EngineCoreRequest(f"bench-{next(_bench_ids)}", list(p), SamplingParams(
            temperature=0, max_tokens=m, ignore_eos=True)))


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- the bytes floor -----------------------------------------------------------------------------
def weight_params(m) -> int:
    """Parameters of a dense or MoE decoder (ModelConfig): embeddings, attention, MLPs, norms."""
    h, d = m.hidden_size, m.head_dim
    attn = h * d * (2 * m.num_heads + 2 * m.num_kv_heads) + 2 * h  # q, k, v, o; two norms
    attn += 2 * d if m.qk_norm else 0
    attn += (m.num_heads + 2 * m.num_kv_heads) * d if m.attention_bias else 0
    moe = set(m.moe_layers)
    mlp = [h * m.num_experts + m.num_experts * 3 * h * m.moe_intermediate_size if i in moe
           else 3 * h * m.intermediate_size for i in range(m.num_layers)]
    embed = m.vocab_size * h * (1 if m.tie_word_embeddings else 2)
    return embed + m.num_layers * attn + sum(mlp) + h


def kv_bytes_per_token(m, dtype: torch.dtype) -> int:
    """K and V of every layer (layers that share another's cache still read it)."""
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * dtype.itemsize


def step_floor_bytes(context_tokens: int, weight_bytes: int, kv_per_tok: int) -> int:
    return weight_bytes + kv_per_tok * context_tokens


def run_floor_s(steps, weight_bytes: int, kv_per_tok: int, bw_tb_s: float) -> float:
    """Sum over the steps of (weights + every scheduled sequence's KV) / bandwidth."""
    return sum(step_floor_bytes(s.context_tokens, weight_bytes, kv_per_tok) for s in steps) / (bw_tb_s * 1e12)


def plan_requests(plan) -> list:
    """The ScheduledRequests of a step plan (its decode rows included)."""
    return plan.all_requests()


def step_record(plan, seconds: float) -> StepRecord:
    reqs = plan_requests(plan)
    dec = sum(1 for r in reqs if r.num_computed_tokens > 0 and len(r.token_ids) == 1)
    tokens = sum(len(r.token_ids) for r in reqs)
    ctx = sum(r.num_computed_tokens + len(r.token_ids) for r in reqs)
    return StepRecord(dec, tokens - dec, seconds, len(reqs), ctx)


@contextlib.contextmanager
def record_steps(llm):
    """Wrap the executor's step launch (`execute_async`, which `execute` also goes through;
    `execute` where there is none): one StepRecord per step that runs the model (plans with
    requests); the wrapper is removed on exit."""
    ex, log = llm.engine.core.executor, []
    name = "execute_async" if hasattr(ex, "execute_async") else "execute"
    had, inner = name in vars(ex), getattr(ex, name)

    def recorded(plan, *a, **kw):
        t = time.perf_counter()
        res = inner(plan, *a, **kw)
        if plan_requests(plan):
            log.append(step_record(plan, time.perf_counter() - t))
        return res
    setattr(ex, name, recorded)
    try:
        yield log
    finally:
        if had:
            setattr(ex, name, inner)
        else:
            delattr(ex, name)


# ---- LongServe ---------------------------------------------------------------------------------
DECODE_WINDOW = 32  # full-batch decode steps timed
PROFILE_WINDOW = 4  # steps in each profiled window


def build_llm(model: str, args, wl: Workload) -> LLM:
    """max_model_len fits the workload and the longer requests of the decode-step and
    profile windows."""
    budget = args.max_num_batched_tokens or max(8192, len(wl.prompts))
    window = max_prefill_steps(budget, wl) + DECODE_WINDOW + 8
    longest = max(len(p) + max(o, window) for p, o in zip(wl.prompts, wl.out_lens))
    kw = dict(load_format="dummy", dtype=args.dtype, device=args.device, max_model_len=longest + 16,
              max_num_seqs=len(wl.prompts), block_size=args.block_size)
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.device == "cpu":
        kw["cpu_kv_cache_gb"] = args.cpu_kv_cache_gb
    if args.async_scheduling != "auto":
        kw["async_scheduling"] = args.async_scheduling == "on"
    return LLM(f"builtin:{model}", **kw)


def timed_run(llm, wl: Workload, device: str):
    """Warm up on other token ids (the same batch shapes; no prefix-cache hits in the timed
    run), then generate the workload; (seconds, step log)."""
    with llm.engine.client.paused() as eng:
        add_requests(eng, Workload(wl.name, make_token_variant(wl, 7), wl.out_lens), 8)
        drain(eng)
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in wl.out_lens]
    with record_steps(llm) as log:
        sync(device)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in wl.prompts], params, use_tqdm=False)
        sync(device)
        total = time.perf_counter() - t
    assert [len(o.outputs[0].token_ids) for o in outs] == wl.out_lens
    return total, log


def make_token_variant(wl: Workload, seed: int) -> list[list[int]]:
    """The same prompt lengths, other token ids (from the range the workload's ids span)."""
    rng, top = np.random.default_rng(seed), max(max(p) for p in wl.prompts) + 1
    return [rng.integers(0, top, len(p)).tolist() for p in wl.prompts]


def print_step_breakdown(log, total):
    mixed = [x for x in log if x.prefill_tokens > 0]
    dec = [x for x in log if x.prefill_tokens == 0]
    ex = sum(x.seconds for x in log)
    print(f"  steps {len(log)}: {len(mixed)} with prefill ({sum(x.seconds for x in mixed):.2f} s, "
          f"{sum(x.prefill_tokens for x in mixed)} prefill tokens), {len(dec)} decode-only "
          f"({sum(x.seconds for x in dec):.2f} s, median "
          f"{1e3 * np.median([x.seconds for x in dec] or [0]):.2f} ms); execute {ex:.2f} s of "
          f"{total:.2f} s (host time inside execute: with asynchronous scheduling not GPU time)",
          flush=True)
    for x in sorted(log, key=lambda x: -x.seconds)[:5]:
        print(f"    slow step: {x.decode_rows} decode rows + {x.prefill_tokens} prefill tokens: "
              f"{1e3 * x.seconds:.1f} ms", flush=True)


def max_prefill_steps(budget: int, wl: Workload) -> int:
    """Steps the prompts need at most: each step's token budget less one token per running
    decode (a request decodes from the step after its last chunk on)."""
    return -(-sum(len(p) for p in wl.prompts) // max(budget - len(wl.prompts), 1))


def steps_until(eng, log, done, limit: int = 100_000) -> None:
    """Step until done(log) holds for the plans executed so far (or nothing is left)."""
    for _ in range(limit):
        if done(log) or not eng.has_work():
            return
        eng.step()


def drain(eng) -> None:
    while eng.has_work():
        eng.step()


def decode_step_time(llm, wl: Workload, weight_bytes, kv_per_tok, bw, device, steps=DECODE_WINDOW):
    """Mean time of consecutive decode steps that hold every request (host work included;
    synchronised at both ends of the window) and the mean floor of those same steps.
    Requests run long enough that the steps after the last prefill still hold the batch."""
    n = len(wl.prompts)
    with llm.engine.client.paused() as eng, record_steps(llm) as log:
        add_requests(eng, Workload(wl.name, make_token_variant(wl, 1), wl.out_lens),
                     max_prefill_steps(llm.config.scheduler.max_num_batched_tokens, wl) + steps + 8)
        steps_until(eng, log, lambda lg: lg and lg[-1].decode_rows == n and lg[-1].prefill_tokens == 0)
        start, calls = len(log), 0
        sync(device)
        t = time.perf_counter()
        while calls < steps and eng.has_work():
            eng.step()
            calls += 1
        sync(device)
        dt = time.perf_counter() - t
        window = log[start:]
        drain(eng)
    full = sum(1 for x in window if x.decode_rows == n and x.prefill_tokens == 0)
    if full < len(window):
        print(f"  note: {len(window) - full} of {len(window)} timed decode steps did not hold all "
              f"{n} requests", flush=True)
    floor = float(np.mean([step_floor_bytes(x.context_tokens, weight_bytes, kv_per_tok)
                           for x in window])) / (bw * 1e12) if window else float("nan")
    return dt / max(calls, 1), floor, f"{full}/{len(window)}"


def ours(model, args, wl: Workload, bw):
    """One model: the timed run, its floor, the profile, the decode step."""
    llm = build_llm(model, args, wl)
    m = llm.config.model
    weight_bytes = weight_params(m) * llm.config.dtype.itemsize
    kv_per_tok = kv_bytes_per_token(m, llm.config.dtype)
    total, log = timed_run(llm, wl, args.device)
    print_step_breakdown(log, total)
    if not log:
        print("  note: no step went through the executor's execute: no floor", flush=True)
    floor = run_floor_s(log, weight_bytes, kv_per_tok, bw)
    windows = profile_windows(llm, wl, args.device) if args.profile else []
    windows += [profile_run(llm, wl, args.device)] if args.profile_run else []
    print_profile(model, windows)
    step, step_floor, full = decode_step_time(llm, wl, weight_bytes, kv_per_tok, bw, args.device)
    mode = getattr(llm.config.scheduler, "async_scheduling", False)
    llm.shutdown()
    del llm
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return dict(total=total, floor=floor, steps=len(log), step=step, step_floor=step_floor,
                full=full, async_scheduling=mode, params=weight_params(m), kv_per_tok=kv_per_tok,
                profile=[window_summary(w) for w in windows])


# ---- profile: GPU busy fraction and the host-time split ------------------------------------------
# (label, where, name): where is "scheduler" / "runner" / "engine" (the live object's class:
# a subclass's override is what gets timed), a module imported by name, or "module:Class"
HOST_PARTS = [("schedule", "scheduler", "schedule"),
              ("prepare_step", "longserve.worker.model_runner", "prepare_step"),
              ("run_model", "runner", "run_model"),
              ("sample", "longserve.worker.step_sampler:StepSampler", "sample"),
              # waiting for the sampled ids (their copy to the host): with asynchronous
              # scheduling the only wait for the device in a step
              ("token_wait", "longserve.worker.step_sampler:ModelRunnerOutput", "resolve"),
              ("update_from_output", "scheduler", "update_from_output"),
              ("outputs", "engine", "_outputs")]


def host_part_owner(eng, where: str):
    if where == "scheduler":
        return type(eng.scheduler)
    if where == "engine":
        return type(eng)
    if where == "runner":
        runner = getattr(getattr(eng.executor, "driver", None), "runner", None)
        return None if runner is None else type(runner)
    module, _, cls = where.partition(":")
    module = sys.modules.get(module) or importlib.import_module(module)
    return getattr(module, cls) if cls else module


@contextlib.contextmanager
def host_timers(eng, parts=HOST_PARTS):
    """Wrap each function with a perf_counter timer; yields ({label: seconds}, {label: calls},
    [missing]). A missing function is skipped (and named); every wrapper is removed on exit."""
    totals, calls, missing, undo = {}, {}, [], []
    for label, where, name in parts:
        try:
            owner = host_part_owner(eng, where)
            fn = getattr(owner, name)
        except (ImportError, AttributeError):
            missing.append(f"{where}.{name}")
            continue
        if not callable(fn):
            missing.append(f"{where}.{name}")
            continue
        totals[label], calls[label] = 0.0, 0
        undo.append((owner, name, vars(owner).get(name), name in vars(owner)))
        setattr(owner, name, timer(fn, label, totals, calls))
    try:
        yield totals, calls, missing
    finally:
        for owner, name, old, had in reversed(undo):
            if had:
                setattr(owner, name, old)
            else:
                delattr(owner, name)


def timer(fn, label, totals, calls):
    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[label] += time.perf_counter() - t
            calls[label] += 1
    return timed


def union_length(intervals) -> float:
    """Total length covered by a set of [start, end) intervals."""
    covered, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        covered += b - max(a, end)
        end = b
    return covered


GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_busy(trace_events) -> tuple[float, float]:
    """(busy, span) in the trace's unit (us) from chrome-trace events: busy = union of kernel,
    memcpy and memset intervals; span = first GPU activity's start to the last one's end."""
    iv = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in trace_events
          if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    if not iv:
        return 0.0, 0.0
    return union_length(iv), max(b for _, b in iv) - min(a for a, _ in iv)


def profiled_steps(eng, num_steps: int, device: str, log) -> dict:
    """Run steps under the host timers (and torch.profiler with CUDA activity on a GPU)."""
    start = len(log)
    prof_cm = contextlib.nullcontext()
    if device == "cuda":
        from torch.profiler import ProfilerActivity, profile
        prof_cm = profile(activities=[ProfilerActivity.CUDA])
    with host_timers(eng) as (parts, called, missing), prof_cm as prof:
        t, steps = time.perf_counter(), 0
        while steps < num_steps and eng.has_work():
            eng.step()
            steps += 1
        sync(device)
        wall = time.perf_counter() - t
    # a function that exists but was never called (moved elsewhere?) is not reported as 0
    missing += [f"{k} (not called)" for k, n in called.items() if n == 0]
    w = dict(steps=steps, wall=wall, parts={k: v for k, v in parts.items() if called[k]},
             missing=missing, plans=log[start:], busy=None, span=None)
    if prof is not None:
        try:
            w["busy"], w["span"] = trace_busy(prof)
        except Exception as e:  # the host split stands on its own
            w["missing"] = w["missing"] + [f"GPU trace ({type(e).__name__}: {e})"]
        w["kernel_table"] = kernel_table(prof)
    return w


def trace_busy(prof) -> tuple[float, float]:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f).get("traceEvents", [])
    finally:
        os.unlink(path)
    busy, span = gpu_busy(events)
    return busy * 1e-6, span * 1e-6


def kernel_table(prof) -> str:
    """The kernels by device time (the key's name changed across torch versions)."""
    error = None
    for key in ("device_time_total", "cuda_time_total"):
        try:
            return prof.key_averages().table(sort_by=key, row_limit=15)
        except Exception as e:  # a nicety: the numbers above do not depend on it
            error = e
    return f"(no kernel table: {error})"


def profile_windows(llm, wl: Workload, device: str, num_steps: int = PROFILE_WINDOW) -> list[dict]:
    """A window of mixed prefill+decode steps (after one step, while prompts remain), then one
    of decode-only steps (once the last plan had no prefill), on other token ids."""
    with llm.engine.client.paused() as eng, record_steps(llm) as log:
        add_requests(eng, Workload(wl.name, make_token_variant(wl, 3), wl.out_lens),
                     max_prefill_steps(llm.config.scheduler.max_num_batched_tokens, wl) + 2 * num_steps + 8)
        eng.step()  # the first step: prefill only
        mixed = profiled_steps(eng, num_steps, device, log)
        steps_until(eng, log, lambda lg: lg and lg[-1].prefill_tokens == 0)
        decode = profiled_steps(eng, num_steps, device, log)
        drain(eng)
    mixed["name"], decode["name"] = "mixed", "decode"
    return [mixed, decode]


def profile_run(llm, wl: Workload, device: str) -> dict:
    """The whole workload again (other token ids) under the timers and the profiler."""
    with llm.engine.client.paused() as eng, record_steps(llm) as log:
        add_requests(eng, Workload(wl.name, make_token_variant(wl, 5), wl.out_lens), wl.out_lens)
        w = profiled_steps(eng, 1 << 62, device, log)
    w["name"] = "whole run"
    return w


PART_COLUMNS = [("schedule", ("schedule",)), ("prepare inputs", ("prepare_step",)),
                ("forward", ("run_model",)), ("sampling", ("sample",)), ("token wait", ("token_wait",)),
                ("outputs", ("update_from_output", "stop_strings"))]


def model_steps(w: dict) -> int:
    """The steps that ran the model (with asynchronous scheduling the last engine step of a
    run only collects the one before)."""
    return max(len(w["plans"]) or w["steps"], 1)


def profile_row(model: str, w: dict) -> str:
    ms = lambda s: f"{1e3 * s / model_steps(w):.2f}"  # noqa: E731 (per step)
    plans = w["plans"]
    kinds = (f"{sum(1 for p in plans if p.prefill_tokens)} mixed / "
             f"{sum(1 for p in plans if not p.prefill_tokens)} decode")
    cells = []
    for _, labels in PART_COLUMNS:
        have = [w["parts"][x] for x in labels if x in w["parts"]]
        cells.append(ms(sum(have)) if have else "n/a")
    other = w["wall"] - sum(w["parts"].values())
    gpu = "n/a | n/a" if not w["span"] else \
        f"{ms(w['busy'])} | {100 * (1 - w['busy'] / w['span']):.1f}"
    return (f"| {model} | {w['name']} | {len(w['plans'])} ({kinds}) | {ms(w['wall'])} | "
            f"{' | '.join(cells)} | {ms(other)} | {gpu} |")


def window_summary(w: dict) -> dict:
    """A profiled window as JSON: steps, their kinds, ms per step of each part, GPU busy / idle."""
    per = lambda x: round(1e3 * x / model_steps(w), 3)  # noqa: E731
    return dict(window=w["name"], steps=w["steps"],
                mixed_steps=sum(1 for p in w["plans"] if p.prefill_tokens),
                decode_steps=sum(1 for p in w["plans"] if not p.prefill_tokens),
                step_wall_ms=per(w["wall"]), host_ms={k: per(v) for k, v in w["parts"].items()},
                gpu_busy_ms=None if not w["span"] else per(w["busy"]),
                gpu_idle_pct=None if not w["span"] else round(100 * (1 - w["busy"] / w["span"]), 2),
                not_timed=w["missing"])


def print_profile(model: str, windows: list[dict]) -> None:
    if not windows:
        return
    for w in windows:
        if w.get("kernel_table"):
            print(f"  kernels, {w['name']} window:\n{w['kernel_table']}", flush=True)
    missing = sorted({m for w in windows for m in w["missing"]})
    print(f"\n#### Per-step host time and GPU idle, {model} (ms per step)\n")
    print("| model | window | steps | step wall | " + " | ".join(c for c, _ in PART_COLUMNS)
          + " | other | GPU busy | GPU idle % |")
    print("| --- " * (len(PART_COLUMNS) + 7) + "|")
    for w in windows:
        print(profile_row(model, w))
    print("\nHost time inside each function (a function that waits for the GPU, e.g. the sampled "
          "tokens' copy, includes the wait); other = step wall - the parts. GPU busy = union of "
          "kernel/memcpy/memset intervals; idle % over the window's GPU span (first to last GPU "
          "activity)." + (f" Not timed (missing): {', '.join(missing)}." if missing else ""),
          flush=True)


# ---- HF transformers ---------------------------------------------------------------------------
def hf_model(model: str, device: str, dtype: torch.dtype):
    import transformers as T
    with open(os.path.join(resolve_model(f"builtin:{model}"), "config.json")) as f:
        cfg = json.load(f)
    arch = cfg.pop("architectures")[0]
    conf = T.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device(device):
        return getattr(T, arch)(conf).to(dtype).eval()


def hf_batches(wl: Workload, groups: int) -> list[list[int]]:
    """Indices of each static batch: sorted by output length, split into `groups` batches."""
    order = sorted(range(len(wl.prompts)), key=lambda i: wl.out_lens[i])
    return [b.tolist() for b in np.array_split(np.array(order), groups) if len(b)]


def left_padded(prompts: list[list[int]], device: str):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def hf(model: str, wl: Workload, device: str, dtype: torch.dtype, groups: int = 1):
    """Seconds for HF generate over the workload in static batches; (seconds, tokens generated)."""
    m = hf_model(model, device, dtype)
    ids, mask = left_padded(wl.prompts[:2], device)
    m.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    sync(device)
    t, generated = time.perf_counter(), 0
    with torch.no_grad():
        for batch in hf_batches(wl, groups):
            ids, mask = left_padded([wl.prompts[i] for i in batch], device)
            new = max(wl.out_lens[i] for i in batch)
            out = m.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, pad_token_id=0)
            generated += out.numel() - ids.numel()
    sync(device)
    dt = time.perf_counter() - t
    del m
    if device == "cuda":
        torch.cuda.empty_cache()
    return dt, generated


# ---- the run -------------------------------------------------------------------------------------
def parse_args(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b-shape,llama3-8b-shape")
    ap.add_argument("--workload", choices=("fixed", "nano"), default="fixed")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024, help="fixed workload")
    ap.add_argument("--output-len", type=int, default=256, help="fixed workload")
    ap.add_argument("--nano-min-len", type=int, default=100, help="nano workload: shortest length")
    ap.add_argument("--nano-max-len", type=int, default=1024, help="nano workload: longest length")
    ap.add_argument("--hf", default="qwen3-0.6b-shape", help="models to also run through HF generate "
                    "(comma-separated; '' for none)")
    ap.add_argument("--hf-groups", type=int, default=1, help="HF static batches, sorted by output length")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None)
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--cpu-kv-cache-gb", type=float, default=0.25)
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                    help="the engine's asynchronous scheduling (auto: its default)")
    ap.add_argument("--profile", action="store_true",
                    help="GPU idle and the per-step host-time split over mixed and decode windows")
    ap.add_argument("--profile-run", action="store_true",
                    help="also the whole workload once more under the profiler (GPU idle of a run)")
    ap.add_argument("--bw", type=float, default=None, help="memory bandwidth for the floor, TB/s")
    args = ap.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    return args


def device_and_bw(args) -> tuple[str, float]:
    if args.device == "cpu":
        return "CPU", args.bw or 0.02
    dev = torch.cuda.get_device_name()
    return dev, args.bw or (4.2 if "H200" in dev else 3.0)


def run_model(model: str, args, bw: float) -> dict:
    vocab = model_config(resolve_model(f"builtin:{model}")).vocab_size
    wl = make_workload(args, vocab)
    r = ours(model, args, wl, bw)
    total = r["total"]
    hf_t = hf_gen = None
    if model in [x for x in args.hf.split(",") if x]:
        hf_t, hf_gen = hf(model, wl, args.device, getattr(torch, args.dtype), args.hf_groups)
    toks = wl.num_output_tokens
    row = dict(model=model, workload=wl.name, async_scheduling=r["async_scheduling"], ours_s=round(total, 2), out_tok_s=round(toks / total, 1),
               hf_s=None if hf_t is None else round(hf_t, 2),
               hf_tok_s=None if hf_t is None else round(toks / hf_t, 1),
               hf_generated_tokens=hf_gen, speedup=None if hf_t is None else round(hf_t / total, 2),
               steps=r["steps"], run_floor_s=round(r["floor"], 3),
               run_over_floor=round(total / r["floor"], 2) if r["floor"] else None,
               decode_step_ms=round(1e3 * r["step"], 2), floor_step_ms=round(1e3 * r["step_floor"], 2),
               step_over_floor=round(r["step"] / r["step_floor"], 2), decode_steps_full=r["full"],
               profile=r["profile"], params=r["params"],
               kv_bytes_per_token=r["kv_per_tok"], output_tokens=toks)
    print(json.dumps(row), flush=True)
    return row


def print_table(rows, args, dev, bw) -> None:
    if args.workload == "nano":
        what = (f"nano-vllm workload: {args.num_prompts} sequences, input and output lengths uniform "
                f"in [{args.nano_min_len}, {args.nano_max_len}] (seed 0)")
    else:
        what = f"{args.num_prompts} x ({args.input_len} in + {args.output_len} out)"
    mode = "/".join(sorted({"async" if r["async_scheduling"] else "sync" for r in rows}))
    print(f"\n### Offline batch, {what}, greedy, ignore_eos, {args.dtype}, block size "
          f"{args.block_size}, {mode} scheduling ({dev}, floor at {bw} TB/s)\n")
    print("| model | LongServe (s) | output tok/s | HF generate (s) | HF tok/s | speed-up | steps | "
          "run bytes floor (s) | run / floor | full-batch decode step (ms) | its floor (ms) | step / floor |")
    print("| --- " * 12 + "|")
    for r in rows:
        print(f"| {r['model']} | {r['ours_s']} | {r['out_tok_s']} | {r['hf_s']} | {r['hf_tok_s']} | "
              f"{r['speedup']} | {r['steps']} | {r['run_floor_s']} | {r['run_over_floor']} | "
              f"{r['decode_step_ms']} | {r['floor_step_ms']} | {r['step_over_floor']} |")
    if args.workload == "nano" and any(r["hf_s"] is not None for r in rows):
        gen = next(r["hf_generated_tokens"] for r in rows if r["hf_s"] is not None)
        print(f"\nHF: {args.hf_groups} static batch(es) sorted by output length, left-padded, every row "
              f"to its batch's longest output; tok/s counts only the {rows[0]['output_tokens']} "
              f"tokens asked for (HF generated {gen}).")


def main(argv=None):
    args = parse_args(argv)
    dev, bw = device_and_bw(args)
    rows = [run_model(model, args, bw) for model in args.models.split(",")]
    print_table(rows, args, dev, bw)
    return rows


if __name__ == "__main__":
    main()
