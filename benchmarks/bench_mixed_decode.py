"""One long prompt decoding beside many short ones, end to end on one GPU (issue 44/45's stall):
the mean decode step from two runs that differ only in output length (the same prefill in both).

    python benchmarks/bench_mixed_decode.py                  # Llama-3-8B shape, 1 x 32K + 64 x 1K
    python benchmarks/bench_mixed_decode.py --long 0         # the short ones alone
"""
import argparse
import time

import torch

from longserve import LLM, SamplingParams


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="builtin:llama3-8b-shape")
    ap.add_argument("--long", type=int, default=32768, help="the long prompt's tokens (0: none)")
    ap.add_argument("--short", type=int, default=1024)
    ap.add_argument("--num-short", type=int, default=64)
    ap.add_argument("--steps", type=int, default=128)
    args = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(10, 30000, (n,), generator=g).tolist()  # noqa: E731
    prompts = [{"prompt_token_ids": ids(n)} for n in [args.long] * bool(args.long) + [args.short] * args.num_short]
    llm = LLM(args.model, load_format="dummy", dtype="bfloat16", max_num_seqs=max(128, len(prompts)),
              max_model_len=max(args.long, args.short) + args.steps + 1024, enable_prefix_caching=False)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    best = {}
    for n in (1, args.steps + 1) * 2:
        t = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        best[n] = min(best.get(n, 1e9), time.perf_counter() - t)
    step = (best[args.steps + 1] - best[1]) / args.steps * 1e3
    whole = all(s["num_free_blocks"] == s["num_blocks"] for s in llm.engine.pool_states())
    print(f"{torch.cuda.get_device_name()}: {len(prompts)} requests, prefill + 1 token {best[1]:.2f} s, "
          f"mean decode step {step:.2f} ms, pools whole: {whole}")
    llm.shutdown()


if __name__ == "__main__":
    main()
