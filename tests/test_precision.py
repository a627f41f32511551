"""bfloat16 against float32 on the CPU, by the rule low-precision greedy decoding can keep:
identical tokens up to the first divergence, and there each run's token is among the other's
top-5 log-probabilities (a near-tie flipped by rounding, not a wrong computation)."""
import torch

from longserve import LLM, SamplingParams


def generate(dtype, prompts):
    llm = LLM("builtin:qwen3-tiny", device="cpu", dtype=dtype)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def test_bf16_is_logprob_close_to_fp32():
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (16, 40, 90, 150)]
    ref, low = generate("float32", prompts), generate("bfloat16", prompts)
    agree = 0
    for (ta, la), (tb, lb) in zip(low, ref):
        i = next((j for j, (x, y) in enumerate(zip(ta, tb)) if x != y), None)
        agree += len(ta) if i is None else i
        if i is not None:
            assert ta[i] in lb[i] and tb[i] in la[i]
    assert agree >= 0.25 * sum(len(t) for t, _ in ref)
