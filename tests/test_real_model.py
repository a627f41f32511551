"""SmolLM2-135M-Instruct, a real trained model (Q4_1 GGUF, Llama architecture, 9 heads, 3 KV
heads): one rank's greedy tokens equal HF transformers loading the same file (CPU, float32),
for plain and chat prompts; every parallel layout gives one rank's tokens."""
import pytest
import torch

from longserve import LLM, SamplingParams

PLAIN = ["The capital of France is",
         "Alice was beginning to get very tired of sitting by her sister on the bank, and of"]
CHAT = ["What is the capital of France?", "Write a haiku about the sea."]  # 37, 38 tokens
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def one_rank(smollm2_gguf):
    llm = LLM(smollm2_gguf, device="cpu")
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def prompt_ids(one_rank):
    tok = one_rank.get_tokenizer()
    return ([tok.encode(p).ids for p in PLAIN] +
            [one_rank.engine.encode_chat([{"role": "user", "content": q}])["prompt_token_ids"]
             for q in CHAT])


def greedy(llm, prompt_ids):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    chosen = [[step[t] for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, torch.tensor(chosen)


@pytest.fixture(scope="module")
def reference(one_rank, prompt_ids):
    return greedy(one_rank, prompt_ids)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int):
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, chosen = [], []
    for _ in range(n):
        logprobs = torch.log_softmax(out.logits[0, -1].float(), -1)
        tokens.append(int(logprobs.argmax()))
        chosen.append(float(logprobs[tokens[-1]]))
        out = model(torch.tensor([tokens[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, chosen


def test_one_rank_matches_hf_transformers(hf_smollm2, prompt_ids, reference):
    """HF dequantizes the GGUF itself (and undoes llama.cpp's q/k permutation its own way)."""
    tokens, chosen = reference
    for p, ours, ours_lp in zip(prompt_ids, tokens, chosen):
        ref, ref_lp = hf_greedy(hf_smollm2, p, MAX_TOKENS)
        assert ours == ref
        assert torch.allclose(ours_lp, torch.tensor(ref_lp), atol=1e-4, rtol=0)


def test_tokenizer_matches_hf_transformers(hf_smollm2_tokenizer, one_rank):
    hf = hf_smollm2_tokenizer
    tok = one_rank.get_tokenizer()
    chats = [one_rank.engine.encode_chat([{"role": "user", "content": q}])["prompt"] for q in CHAT]
    for text in PLAIN + CHAT + chats + ["3.14159 apples,\n\n\tand 🤖 ünïcødé  "]:
        assert tok.encode(text).ids == hf(text)["input_ids"]


def test_chat_answers(one_rank, pool_whole):
    """The README's first command: a sensible answer, ended by the model's own <|im_end|>."""
    outs = one_rank.chat([[{"role": "user", "content": q}] for q in CHAT[:1]],
                         SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    assert outs[0].outputs[0].text == "The capital of France is Paris."
    assert outs[0].outputs[0].finish_reason == "stop"
    assert outs[0].prompt.startswith("<|im_start|>system\n") and outs[0].prompt.endswith(
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    pool_whole(one_rank)


def assert_same(got, reference):
    tokens, chosen = got
    assert tokens == reference[0]
    assert torch.allclose(chosen, reference[1], atol=1e-4, rtol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["tp3", "tp3-dcp3"])
def test_tensor_parallel_matches_one_rank(smollm2_gguf, prompt_ids, reference, layout, pool_whole):
    """9 query heads and 3 KV heads over 3 ranks; with dcp=3 the 3 ranks share the KV heads and
    split the tokens."""
    llm = LLM(smollm2_gguf, device="cpu", tensor_parallel_size=3,
              decode_context_parallel_size=3 if layout == "tp3-dcp3" else 1)
    try:
        assert_same(greedy(llm, prompt_ids), reference)
        pool_whole(llm)
    finally:
        llm.shutdown()


@pytest.mark.timeout(300)
def test_pcp2_chunked_prefill_and_prefix_hits(smollm2_gguf, prompt_ids, reference, pool_whole):
    """pcp=2: the chat prompts span several 32-token steps; the second round hits the sharded
    prefix cache (virtual blocks of 4 x 2 tokens)."""
    llm = LLM(smollm2_gguf, device="cpu", prefill_context_parallel_size=2, block_size=4,
              max_num_batched_tokens=32)
    try:
        assert_same(greedy(llm, prompt_ids), reference)
        hits = llm.engine.core.kv.num_cached_tokens_hit
        assert_same(greedy(llm, prompt_ids), reference)
        assert llm.engine.core.kv.num_cached_tokens_hit - hits >= sum(len(p) // 8 * 8 - 8 for p in prompt_ids)
        pool_whole(llm)
    finally:
        llm.shutdown()
