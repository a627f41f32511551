"""Teacher-forced precision against HF transformers float32 on the CPU (the reference).

Greedy sequences of two numerics diverge after the first near-tie, so position-wise greedy
agreement is the wrong yardstick. Here every engine sees the *same* token sequences: a prompt
(plain and chat) plus the reference's own greedy continuation, and at every position its
next-token distribution is compared with the reference's:

- top-1: the argmax agrees with the reference's;
- KL(ref || engine), nats, mean over positions. The engines return their top-k log-probs (k =
  --logprobs-k; 0: the whole vocabulary), so the KL is taken over those k tokens plus one bucket
  for the rest of the vocabulary: the exact KL of the two distributions coarse-grained that way,
  a lower bound of the full KL that equals it with k = vocab;
- |d logprob| of the reference token (the one the sequence continues with), max and mean.

Rows: HF bf16 on the GPU (the peer), LongServe bf16 eager, bf16 decode with CUDA graphs,
pcp=2, float32 (no TF32 anywhere), and the FP8 KV cache (`fp8kv`) in bf16 and float32. LongServe scores positions with `prompt_logprobs` (one
prefill of the whole sequence), except the `decode` rows: they prefill the prompt and then
force the reference continuation through decode steps (CUDA graphs when not eager), reading
each step's `logprobs` -- prefill never runs a graph, so only that path measures them. The
prefill attends to its own new K/V before they are stored, so an FP8 cache shows in the
decode rows' continuation columns ("cont."): there every K and V is read back from the cache.

    python benchmarks/bench_precision.py --model smollm2            # or a .gguf path / HF folder
    python benchmarks/bench_precision.py --model builtin:llama-tiny --device cpu --num-prompts 4 \
        --continuation-len 8                                          # a quick CPU check
"""
from __future__ import annotations

import argparse
import copy
import gc
import json
import math
import os
import time

import torch

# teacher forcing steps the engine core itself: in this process, on the caller's thread
os.environ.setdefault("LONGSERVE_ENABLE_MULTIPROCESSING", "0")

ROWS = {  # name -> how it runs (LongServe rows: mode prefill = prompt_logprobs of the whole sequence)
    "hf-bf16": dict(engine="hf", dtype="bfloat16"),
    "hf-fp32": dict(engine="hf", dtype="float32"),
    "longserve-bf16-eager": dict(engine="longserve", dtype="bfloat16", eager=True, mode="prefill"),
    "longserve-bf16-eager-decode": dict(engine="longserve", dtype="bfloat16", eager=True, mode="decode"),
    "longserve-bf16-graphs-decode": dict(engine="longserve", dtype="bfloat16", eager=False,
                                         mode="decode"),
    "longserve-bf16-pcp2": dict(engine="longserve", dtype="bfloat16", eager=True, mode="prefill",
                                parallel=dict(prefill_context_parallel_size=2)),
    # two GPUs: tp=2 decode graphs (in the core's process), and an expert model's dp=2 + EP
    # (engine cores in processes of their own: scored by prompt_logprobs)
    "longserve-bf16-tp2-graphs-decode": dict(engine="longserve", dtype="bfloat16", eager=False,
                                             mode="decode", parallel=dict(tensor_parallel_size=2)),
    "longserve-bf16-dp2-ep": dict(engine="longserve", dtype="bfloat16", eager=False, mode="prefill",
                                  parallel=dict(data_parallel_size=2, enable_expert_parallel=True)),
    "longserve-fp32": dict(engine="longserve", dtype="float32", eager=True, mode="prefill"),
    "longserve-fp32-graphs-decode": dict(engine="longserve", dtype="float32", eager=False,
                                         mode="decode"),
    # FP8 KV cache: only the continuation (decode steps) reads every K/V through the cache,
    # so compare its "(cont.)" columns with the same row without fp8kv
    "longserve-bf16-fp8kv-eager-decode": dict(engine="longserve", dtype="bfloat16", eager=True,
                                              mode="decode", kv_cache_dtype="fp8"),
    "longserve-bf16-fp8kv-graphs-decode": dict(engine="longserve", dtype="bfloat16", eager=False,
                                               mode="decode", kv_cache_dtype="fp8"),
    "longserve-fp32-fp8kv-graphs-decode": dict(engine="longserve", dtype="float32", eager=False,
                                               mode="decode", kv_cache_dtype="fp8"),
    # the FP8 cache over parallel layouts, float32 elsewhere (runs on CPU ranks): the reduction
    # order differs by layout, the cache's rounding should not (FP8_LAYOUTS' spread)
    **{f"longserve-fp32-fp8kv-eager-decode{tag}": dict(engine="longserve", dtype="float32", eager=True,
                                                       mode="decode", kv_cache_dtype="fp8", parallel=par)
       for tag, par in [("", {}), ("-tp3", dict(tensor_parallel_size=3)),
                        ("-tp3-dcp3", dict(tensor_parallel_size=3, decode_context_parallel_size=3)),
                        ("-pcp2", dict(prefill_context_parallel_size=2))]},
}
FP8_LAYOUTS = [name for name in ROWS if name.startswith("longserve-fp32-fp8kv-eager-decode")]

PLAIN = [
    "The capital of France is", "Water boils at a temperature of", "The three primary colors are",
    "Once upon a time, in a small village by the sea,", "The theory of relativity states that",
    "def fibonacci(n):\n    ", "The largest planet in our solar system is",
    "A good breakfast usually includes", "The history of the Roman Empire began",
    "Photosynthesis is the process by which", "In mathematics, a prime number is",
    "The best way to learn a new language is", "The Great Wall of China was built",
    "import numpy as np\n\n# compute the mean of", "My favourite season of the year is",
    "The human heart has four chambers:",
]
CHAT = [
    "What is the capital of France?", "Explain what a black hole is in two sentences.",
    "Write a haiku about autumn.", "How do I reverse a list in Python?",
    "Give me three tips for better sleep.", "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet.", "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.", "What are the benefits of exercise?",
    "Name five fruits that are red.", "What does a CPU do?",
    "Tell me a fun fact about octopuses.", "How many continents are there? List them.",
    "What is the difference between weather and climate?", "Suggest a name for a pet turtle.",
]


def disable_tf32() -> None:
    """float32 means float32: no TF32 in cuBLAS or cuDNN (LongServe's Triton dots use 'ieee' in
    float32; spawned workers keep PyTorch's default, which has TF32 off for matmuls)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")


def resolve(model: str) -> str:
    """A .gguf file or an HF folder (`smollm2` and `builtin:<name>` through LongServe's names)."""
    if os.path.exists(model):
        return model
    from longserve.models.builtin import resolve_model
    return resolve_model(model)


def hf_from_pretrained(cls, path: str, **kw):
    if path.endswith(".gguf"):
        return cls.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                   gguf_file=os.path.basename(path), **kw)
    return cls.from_pretrained(path, **kw)


def load_hf(path: str, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM
    return hf_from_pretrained(AutoModelForCausalLM, path, dtype=dtype).to(device).eval()


def load_tokenizer(path: str, tokenizer: str | None):
    """An HF tokenizer (from --tokenizer, the .gguf or the folder), or None (random token ids)."""
    from transformers import AutoTokenizer
    try:
        if tokenizer:
            return AutoTokenizer.from_pretrained(tokenizer)
        return hf_from_pretrained(AutoTokenizer, path)
    except Exception as e:  # a folder without tokenizer files
        print(f"no HF tokenizer ({type(e).__name__}); using random token ids")
        return None


def make_prompts(tok, n: int, vocab: int) -> list[tuple[str, list[int]]]:
    """n prompts, half plain text and half chat (the chat template when the tokenizer has one)."""
    if tok is None:
        g = torch.Generator().manual_seed(0)
        return [("random", torch.randint(3, vocab, (int(torch.randint(8, 40, (1,), generator=g)),),
                                         generator=g).tolist()) for _ in range(n)]
    out = []
    for i in range(n):
        text = (PLAIN if i % 2 == 0 else CHAT)[(i // 2) % len(PLAIN)]
        if i % 2 and getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
            out.append(("chat", tok(text, add_special_tokens=False).input_ids))
        else:
            out.append(("plain" if i % 2 == 0 else "chat-as-text", tok(text).input_ids))
    return out


@torch.no_grad()
def greedy_continuation(model, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    out = model(torch.tensor([prompt]), use_cache=True)
    past, cont = out.past_key_values, []
    for _ in range(n):
        nxt = int(out.logits[0, -1].argmax())
        cont.append(nxt)
        if nxt in eos:
            break
        out = model(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return cont


@torch.no_grad()
def hf_logprobs(model, seq: list[int], device: str, dtype=torch.float64) -> torch.Tensor:
    """[len - 1, vocab]: row t - 1 is the distribution of seq[t] given seq[:t] (the reference
    in float64; a peer row in float32, as LongServe's log-softmax)."""
    logits = model(torch.tensor([seq], device=device)).logits[0, :-1]
    return torch.log_softmax(logits.to(dtype), -1).cpu()


def to_entries(logprobs: torch.Tensor, targets: list[int], k: int) -> list[dict[int, float]]:
    """What LongServe's prompt_logprobs gives: {target: logprob} plus the top-k, per row."""
    top = logprobs.topk(k)
    chosen = logprobs.gather(1, torch.tensor(targets)[:, None])[:, 0].tolist()
    return [{t: c, **dict(zip(ids, vals))}
            for t, c, ids, vals in zip(targets, chosen, top.indices.tolist(), top.values.tolist())]


def run_hf(ref_model, seqs, row, args, k):
    """The reference model's weights (loaded once: dequantizing a GGUF is slow), cast and moved."""
    model = copy.deepcopy(ref_model).to(device=args.device, dtype=getattr(torch, row["dtype"]))
    entries = [to_entries(hf_logprobs(model, s, args.device, torch.float32), s[1:], k) for s in seqs]
    del model
    return entries


def run_longserve(path, seqs, prompt_lens, row, args, k):
    from longserve import LLM, SamplingParams
    llm = LLM(path, dtype=row["dtype"], device=args.device, enforce_eager=row["eager"],
              max_model_len=args.max_model_len, max_num_seqs=max(len(seqs), 8),  # fewer graphs
              async_scheduling=False,  # teacher forcing rewrites each step's token before the next
              kv_cache_dtype=row.get("kv_cache_dtype", "auto"), **row.get("parallel", {}))
    try:
        if row["mode"] == "prefill":
            params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
            outs = llm.generate([{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False)
            return [o.prompt_logprobs[1:] for o in outs]
        return teacher_forced_decode(llm.engine, seqs, prompt_lens, k)
    finally:
        llm.shutdown()


def teacher_forced_decode(engine, seqs, prompt_lens, k):
    """Prefill each prompt, then decode its reference continuation token by token: after each
    step the sampled token is replaced by the reference's, which the next decode step reads.
    The prompt's positions come from prompt_logprobs, the continuation's from each step's
    logprobs (the prefill scores the first, decode steps -- CUDA graphs -- the rest)."""
    from longserve import SamplingParams
    with engine.client.paused() as core:  # this thread steps the core
        reqs = []
        for s, n in zip(seqs, prompt_lens):
            params = SamplingParams(temperature=0, max_tokens=len(s) - n, ignore_eos=True,
                                    logprobs=k, prompt_logprobs=k)
            req = engine.make_request({"prompt_token_ids": s[:n]}, params)
            core.add_request(req)
            reqs.append(core.scheduler.requests[req.request_id])
        while core.has_work():
            core.step()
            for r, s, n in zip(reqs, seqs, prompt_lens):
                if r.output_token_ids:
                    j = len(r.output_token_ids) - 1
                    r.output_token_ids[j] = s[n + j]
    # positions 1...: prompt entries are (rank, top-k dict)
    return [[e for _, e in r.prompt_logprobs] + list(r.logprobs) for r in reqs]


def compare(ref: torch.Tensor, targets: list[int], entries: list[dict[int, float]]) -> dict:
    """Per-position top-1 agreement, coarse-grained KL(ref || engine) and |d logprob| of the
    reference token (nan where the engine's top-k lacks it: a decode row's forced token).

    The KL is written as sum p log(p/q) - p + q over the engine's tokens plus the rest bucket:
    equal to the KL, but first-order blind to float32 rounding of q's normalisation."""
    width = max(len(e) for e in entries)
    ids = torch.zeros(len(entries), width, dtype=torch.long)
    vals = torch.full((len(entries), width), -math.inf, dtype=torch.float64)
    for i, e in enumerate(entries):
        ids[i, :len(e)] = torch.tensor(list(e.keys()))
        vals[i, :len(e)] = torch.tensor(list(e.values()), dtype=torch.float64)
    have = vals > -math.inf
    logp = ref.gather(1, ids)
    p, q = logp.exp() * have, vals.exp()
    kl = (p * (logp - vals) - p + q).where(have, 0.0).sum(1)
    covered = torch.zeros_like(ref).scatter_add(1, ids, have.double()) > 0  # pads point at id 0
    p_rest = ref.exp().where(~covered, 0.0).sum(1)
    q_rest = (1 - q.sum(1)).clamp(min=1e-30)
    rest = p_rest * (p_rest.clamp(min=1e-300).log() - q_rest.log()) - p_rest + q_rest
    kl += torch.where(covered.all(1), 0.0, rest)  # no bucket when the engine gave every token
    t = torch.tensor(targets)
    target_lp = torch.tensor([e.get(tok, math.nan) for e, tok in zip(entries, targets)], dtype=torch.float64)
    # top-1 agrees when the reference's argmax is one of the engine's (bf16 logits tie often)
    best = ref.argmax(1)
    at_best = torch.tensor([e.get(b, -math.inf) for e, b in zip(entries, best.tolist())], dtype=torch.float64)
    return dict(top1=(at_best == vals.max(1).values).double(),
                kl=kl,
                dlp=(target_lp - ref.gather(1, t[:, None])[:, 0]).abs())


def summarize(parts: list[dict], cont_masks: list[torch.Tensor]) -> dict:
    cat = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    cont = torch.cat(cont_masks)
    dlp = cat["dlp"]
    per_seq = torch.stack([p["kl"].mean() for p in parts])  # the noise: sequences, not positions
    return dict(positions=len(dlp), top1=cat["top1"].mean().item(), kl_mean=cat["kl"].mean().item(),
                kl_seq_se=(per_seq.std() / len(parts) ** 0.5).item(),
                dlp_max=dlp.nan_to_num(0).max().item(), dlp_mean=dlp[~dlp.isnan()].mean().item(),
                dlp_missing=int(dlp.isnan().sum()), top1_cont=cat["top1"][cont].mean().item(),
                kl_mean_cont=cat["kl"][cont].mean().item())


def device_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    n = torch.cuda.device_count()
    return f"{n} x {torch.cuda.get_device_name()}"


def markdown(results: dict, meta: dict) -> str:
    lines = [f"model `{meta['model']}`, {meta['num_sequences']} sequences ({meta['num_positions']} "
             f"positions, continuations of <= {meta['continuation_len']}), device {meta['device_name']}, "
             f"KL over top-{meta['k']} + rest", "",
             "| row | top-1 agree | mean KL | max abs d logprob | mean abs d logprob | top-1 (cont.) "
             "| KL (cont.) | s |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:80]} | | | | | | |")
            continue
        miss = f" ({r['dlp_missing']} not in top-k)" if r["dlp_missing"] else ""
        lines.append(f"| {name} | {r['top1']:.4f} | {r['kl_mean']:.2e} | {r['dlp_max']:.2e}{miss} | "
                     f"{r['dlp_mean']:.2e} | {r['top1_cont']:.4f} | {r['kl_mean_cont']:.2e} | "
                     f"{r['seconds']:.1f} |")
    return "\n".join(lines)


def fp8_layout_spread(results: dict) -> str:
    """The FP8 cache's KL over layouts: their largest / smallest mean, and the noise (the
    standard error over sequences) to judge it by; they should agree (ratio < 1.5)."""
    rows = {n: results[n] for n in FP8_LAYOUTS if n in results and "error" not in results[n]}
    if len(rows) < 2:
        return ""
    kl = {n: r["kl_mean"] for n, r in rows.items()}
    se = max(r["kl_seq_se"] for r in rows.values())
    return (f"\n\nFP8 cache over layouts ({len(rows)} rows): mean KL {min(kl.values()):.2e} .. "
            f"{max(kl.values()):.2e}, max / min {max(kl.values()) / min(kl.values()):.2f}; "
            f"standard error over sequences <= {se:.1e}")


class Reference:
    """HF float32 on the CPU: the prompts, its greedy continuations and its log-probs, kept in
    --reference-cache when given (the GGUF's dequantization and the CPU decoding then run once
    for several invocations); the model itself is loaded only when a row needs it."""

    def __init__(self, path: str, args):
        self.path, self._model = path, None
        cache = args.reference_cache
        if cache and os.path.isfile(cache):
            saved = torch.load(cache)
            if saved["key"] == self.key(args):
                self.prompts, self.seqs, self.logprobs = saved["prompts"], saved["seqs"], saved["logprobs"]
                return
        self.build(args)
        if cache:
            torch.save(dict(key=self.key(args), prompts=self.prompts, seqs=self.seqs,
                            logprobs=self.logprobs), cache)

    def key(self, args) -> list:
        return [os.path.abspath(self.path), args.tokenizer, args.num_prompts, args.continuation_len]

    @property
    def model(self):
        if self._model is None:
            self._model = load_hf(self.path, torch.float32, "cpu")
        return self._model

    def build(self, args) -> None:
        tok = load_tokenizer(self.path, args.tokenizer)
        eos = self.model.generation_config.eos_token_id
        eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.prompts = make_prompts(tok, args.num_prompts, self.model.config.vocab_size)
        self.seqs = [p + greedy_continuation(self.model, p, args.continuation_len, eos)
                     for _, p in self.prompts]
        self.logprobs = [hf_logprobs(self.model, s, "cpu") for s in self.seqs]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2", help="a .gguf file, an HF folder, smollm2, builtin:<name>")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: the model's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of {list(ROWS)}")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--continuation-len", type=int, default=64)
    p.add_argument("--logprobs-k", type=int, default=1000, help="top-k per position (0: whole vocab)")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--out", default="benchmarks/results/precision.json")
    p.add_argument("--reference-cache", default=None, help="a .pt file to keep the reference in")
    p.add_argument("--append", action="store_true", help="keep the other rows already in --out")
    args = p.parse_args()
    disable_tf32()
    path = resolve(args.model)
    t = time.perf_counter()
    ref = Reference(path, args)
    prompts, seqs, refs = ref.prompts, ref.seqs, ref.logprobs
    print(f"reference (HF float32, CPU): {len(seqs)} sequences in {time.perf_counter() - t:.1f} s")
    vocab = refs[0].shape[1]
    k = args.logprobs_k if 0 < args.logprobs_k < vocab else vocab
    prompt_lens = [len(q) for _, q in prompts]
    cont_masks = [torch.arange(1, len(s)) >= n for s, n in zip(seqs, prompt_lens)]
    results = {}
    if args.append and os.path.isfile(args.out):
        with open(args.out) as f:
            results = json.load(f)["results"]
    for name in args.rows.split(","):
        row = ROWS[name]
        t = time.perf_counter()
        try:
            entries = (run_hf(ref.model, seqs, row, args, k) if row["engine"] == "hf"
                       else run_longserve(path, seqs, prompt_lens, row, args, k))
        except Exception as e:  # e.g. pcp=2 on one GPU: report it and go on
            results[name] = dict(error=f"{type(e).__name__}: {e}")
            print(f"{name}: {results[name]['error']}")
            continue
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        parts = [compare(r, s[1:], e) for r, s, e in zip(refs, seqs, entries)]
        results[name] = dict(summarize(parts, cont_masks), seconds=time.perf_counter() - t,
                             device_name=device_name(args.device), **row)
        print(f"{name}: {results[name]}")
    meta = dict(model=args.model, path=path, num_sequences=len(seqs), continuation_len=args.continuation_len,
                num_positions=sum(len(s) - 1 for s in seqs), k=k, vocab=vocab, device=args.device,
                device_name=", ".join(sorted({r.get("device_name", "?") for r in results.values()})),
                torch=torch.__version__, kinds=[kind for kind, _ in prompts],
                tf32=dict(matmul=torch.backends.cuda.matmul.allow_tf32,
                          cudnn=torch.backends.cudnn.allow_tf32))
    table = markdown(results, meta) + fp8_layout_spread(results)
    print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, results=results, table=table), f, indent=1)
    print(f"saved {args.out}")


if __name__ == "__main__":
    main()
