"""Small random HF transformers models (odd sizes) saved as HF folders, and HF greedy decoding."""
import torch

VOCAB = 311


def hf_config(arch: str):
    import transformers as tf
    common = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    if arch == "llama":
        return tf.LlamaConfig(**common, tie_word_embeddings=False, rope_scaling=dict(
            rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64), rope_theta=500000.0)
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True, rope_theta=1e6)
    moe = dict(common, num_experts_per_tok=2, num_hidden_layers=3)
    if arch == "qwen3_moe":  # layer 1 dense; 8 experts of width 20 (4 ranks: 2 each, or 5 wide)
        return tf.Qwen3MoeConfig(**moe, head_dim=16, moe_intermediate_size=20, num_experts=8,
                                 norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[1],
                                 tie_word_embeddings=False, rope_theta=1e6)
    if arch == "mixtral":
        return tf.MixtralConfig(**dict(moe, intermediate_size=20), num_local_experts=8,
                                tie_word_embeddings=False, rope_theta=1e6)
    raise ValueError(arch)


def make_hf_model(arch: str, path: str, seed: int = 0):
    import transformers as tf
    torch.manual_seed(seed)
    cls = {"llama": tf.LlamaForCausalLM, "qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM,
           "qwen3_moe": tf.Qwen3MoeForCausalLM, "mixtral": tf.MixtralForCausalLM}[arch]
    model = cls(hf_config(arch)).float().eval()
    with torch.no_grad():  # larger weights than the default init: peaked, stable distributions
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    model.save_pretrained(path)
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int):
    """Greedy tokens and the log-softmax of each step, recomputing the full sequence each time."""
    ids, tokens, logprobs = list(prompt), [], []
    for _ in range(n):
        logits = model(torch.tensor([ids])).logits[0, -1].float()
        logprobs.append(torch.log_softmax(logits, -1))
        tokens.append(int(logits.argmax()))
        ids.append(tokens[-1])
    return tokens, logprobs
