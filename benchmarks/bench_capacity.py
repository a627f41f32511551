"""Capacity: a prompt whose KV cache does not fit on one GPU, prefilled and decoded with PCP.

Default: Llama-3-8B shape (random weights, bf16), a 1M-token prompt on 4 GPUs with pcp=4,
chunked prefill over the sharded cache (--chunk tokens a step), then --decode tokens.
Prints the prefill time and TFLOP/s per GPU (FLOPs as in bench_prefill.py), the decode step
time, and the KV bytes each rank holds against one GPU's memory.
"""
import argparse
import time

import numpy as np
import torch

from longserve import LLM, SamplingParams

PARAMS, LAYERS, HEADS, HEAD_DIM, KV_BYTES_PER_TOKEN = 8.03e9, 32, 32, 128, 32 * 2 * 8 * 128 * 2


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=1 << 20)
    ap.add_argument("--pcp", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=65536)
    ap.add_argument("--decode", type=int, default=32)
    args = ap.parse_args()
    s = args.tokens
    llm = LLM("builtin:llama3-8b-shape", load_format="dummy", dtype="bfloat16", max_num_seqs=1,
              max_model_len=s + args.decode + 64, max_num_batched_tokens=args.chunk,
              enable_prefix_caching=False, prefill_context_parallel_size=args.pcp)
    prompt = {"prompt_token_ids": np.random.default_rng(0).integers(100, 128000, s).tolist()}
    eng = llm.engine
    req = eng.make_request(prompt, SamplingParams(max_tokens=args.decode, ignore_eos=True))
    eng.add_request(req)
    t0 = time.perf_counter()
    step_times = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        if req.first_token_time is None:
            print(f"  prefilled {req.num_computed_tokens} tokens at {t - t0 + 0:.1f} s "
                  f"(step {time.perf_counter() - t:.2f} s)", flush=True)
        if req.output_token_ids and req.first_token_time is not None and len(req.output_token_ids) > 1:
            step_times.append(time.perf_counter() - t)
    prefill_s = req.first_token_time - t0
    flops = 2 * PARAMS * s + 2 * s * s * HEADS * HEAD_DIM * LAYERS
    gpu_mem = torch.cuda.get_device_properties(0).total_memory
    print(f"device: {torch.cuda.get_device_name()} x {args.pcp} (pcp)")
    print(f"prompt {s} tokens: prefill {prefill_s:.1f} s, {flops / prefill_s / args.pcp / 1e12:.0f} TFLOP/s per GPU")
    print(f"decode: {len(req.output_token_ids)} tokens, median step {1e3 * float(np.median(step_times)):.1f} ms")
    print(f"KV of the prompt: {s * KV_BYTES_PER_TOKEN / 2**30:.0f} GiB in all, "
          f"{s * KV_BYTES_PER_TOKEN / args.pcp / 2**30:.0f} GiB per rank; one GPU has {gpu_mem / 2**30:.0f} GiB")
    llm.shutdown()


if __name__ == "__main__":
    main()
