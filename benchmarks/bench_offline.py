"""Offline batch throughput on one GPU: LongServe vs HF transformers `generate`, same GPU, same run.

Workload (performance.md): N prompts x (1024 in + 256 out), greedy, random weights at the
Qwen3-0.6B and Llama-3-8B shapes. Also the decode step time against the bytes floor
(weights + KV read per step at 4.2 TB/s on H200; pass --bw for the GPU at hand).
"""
import argparse
import json
import time

import numpy as np
import torch

from longserve import LLM, SamplingParams

SHAPES = {"qwen3-0.6b-shape": dict(params=0.596e9, kv_per_tok=28 * 2 * 8 * 128 * 2),
          "llama3-8b-shape": dict(params=8.03e9, kv_per_tok=32 * 2 * 8 * 128 * 2)}


def ours(model, n, inp, out, **kw):
    llm = LLM(f"builtin:{model}", load_format="dummy", dtype="bfloat16", max_model_len=inp + out + 16,
              max_num_seqs=n, **kw)
    rng = np.random.default_rng(0)
    vocab = llm.config.model.vocab_size
    ps = [{"prompt_token_ids": rng.integers(100, vocab - 100, inp).tolist()} for _ in range(n)]
    # warm-up over the same mix of batch shapes (Triton compiles each kernel variant once)
    llm.generate(ps, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True), use_tqdm=False)
    torch.cuda.synchronize()
    total = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == out for o in outs)
    step = decode_step_time(llm, n, inp)
    llm.shutdown()
    del llm
    torch.cuda.empty_cache()
    return total, step


def decode_step_time(llm, n, ctx):
    """Median time of a full-batch decode step at context ~ctx (timed through the engine)."""
    rng = np.random.default_rng(1)
    vocab = llm.config.model.vocab_size
    ps = [{"prompt_token_ids": rng.integers(100, vocab - 100, ctx).tolist()} for _ in range(n)]
    eng = llm.engine
    reqs = [eng.make_request(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in ps]
    for r in reqs:
        eng.add_request(r)
    times = []
    while eng.has_unfinished():
        plan_is_decode = all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs)
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        if plan_is_decode:
            times.append(time.perf_counter() - t)
    return float(np.median(times[5:]))


def hf(model, n, inp, out):
    import transformers as T
    cfg = dict(json.load(open(__import__("longserve.models.builtin", fromlist=["x"]).resolve_model(f"builtin:{model}") + "/config.json")))
    cls = T.Qwen3ForCausalLM if "qwen3" in model else T.LlamaForCausalLM
    conf = (T.Qwen3Config if "qwen3" in model else T.LlamaConfig)(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    with torch.device("cuda"):
        m = cls(conf).to(torch.bfloat16).eval()
    ids = torch.randint(100, conf.vocab_size - 100, (n, inp), device="cuda")
    m.generate(ids[:2], attention_mask=torch.ones_like(ids[:2]), max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    t = time.perf_counter()
    m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=out, min_new_tokens=out, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    del m
    torch.cuda.empty_cache()
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="qwen3-0.6b-shape,llama3-8b-shape")
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--hf", default="qwen3-0.6b-shape", help="models to also run through HF generate")
    ap.add_argument("--bw", type=float, default=None, help="memory bandwidth for the floor, TB/s")
    args = ap.parse_args()
    dev = torch.cuda.get_device_name()
    bw = args.bw or (4.2 if "H200" in dev else 3.0)
    n, inp, out = args.num_prompts, args.input_len, args.output_len
    rows = []
    for model in args.models.split(","):
        total, step = ours(model, n, inp, out)
        hf_t = hf(model, n, inp, out) if model in args.hf.split(",") else None
        s = SHAPES[model]
        floor_step = (2 * s["params"] + s["kv_per_tok"] * n * (inp + 20)) / (bw * 1e12)
        rows.append(dict(model=model, ours_s=round(total, 2), out_tok_s=round(n * out / total, 1),
                         hf_s=None if hf_t is None else round(hf_t, 2),
                         speedup=None if hf_t is None else round(hf_t / total, 2),
                         decode_step_ms=round(1e3 * step, 2), floor_step_ms=round(1e3 * floor_step, 2),
                         step_over_floor=round(step / floor_step, 2)))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n### Offline batch, {n} x ({inp} in + {out} out), greedy, bf16 ({dev}, floor at {bw} TB/s)\n")
    print("| model | LongServe (s) | output tok/s | HF generate (s) | speed-up | decode step (ms) | bytes floor (ms) | step / floor |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['ours_s']} | {r['out_tok_s']} | {r['hf_s']} | {r['speedup']} | "
              f"{r['decode_step_ms']} | {r['floor_step_ms']} | {r['step_over_floor']} |")


if __name__ == "__main__":
    main()
