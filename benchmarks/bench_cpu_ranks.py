"""CPU time of `generate` with several ranks on one host: threads per rank matter.

Each rank runs torch's intra-op pool; left alone every rank takes a thread per core and
tp=2 on N cores runs 2N threads. The engine gives each rank cores // local ranks threads
(unless OMP_NUM_THREADS is set). Run with and without OMP_NUM_THREADS=<cores> to compare:

    python benchmarks/bench_cpu_ranks.py --tp 2
    OMP_NUM_THREADS=$(nproc) python benchmarks/bench_cpu_ranks.py --tp 2   # oversubscribed
"""
import argparse
import time

import numpy as np
import torch

from longserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:qwen3-0.6b-shape")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    with LLM(args.model, device="cpu", load_format="dummy", tensor_parallel_size=args.tp,
             max_model_len=args.input_len + args.output_len + 16, cpu_kv_cache_gb=0.5) as llm:
        vocab = llm.config.model.vocab_size
        rng = np.random.default_rng(0)
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
        times = []
        for r in range(args.repeats + 1):  # the first run warms up
            prompts = [{"prompt_token_ids": rng.integers(100, vocab - 100, args.input_len).tolist()}
                       for _ in range(args.num_prompts)]
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t)
    print(f"{args.model} tp={args.tp} {args.num_prompts} x ({args.input_len} + {args.output_len}): "
          f"generate {min(times[1:]):.2f} s (best of {args.repeats}); driver threads "
          f"{torch.get_num_threads()} after shutdown")


if __name__ == "__main__":
    main()
