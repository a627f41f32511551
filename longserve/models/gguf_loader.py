"""GGUF checkpoints (llama.cpp's single-file format) through the `gguf` package: the metadata as a HF-style
config dict, every tensor dequantized to float32 under its HF name (loader.py slices it); llama.cpp's
q/k row permutation for GPT-J-style RoPE is undone (ours is Neox style, as HF's)."""
from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator

import numpy as np
import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

TOP_LEVEL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf")


@functools.lru_cache(maxsize=2)
def open_gguf(path: str):
    """The file's GGUFReader, one per process and file (memory-mapped; parsing takes a second or two)."""
    from gguf import GGUFReader
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    try:
        return GGUFReader(path)
    except Exception as e:  # the reader raises ValueError, KeyError, struct errors, ...
        raise ValueError(f"{path!r} is not a readable GGUF file: {type(e).__name__}: {e}") from None


def field_value(field):
    """A metadata field's value: str, int, float, bool, or a list of them."""
    from gguf import GGUFValueType as V
    def one(part, kind):
        return bytes(part).decode("utf-8") if kind == V.STRING else part.tolist()[0]
    if field.types[0] == V.ARRAY:
        return [one(field.parts[i], field.types[-1]) for i in field.data]
    return one(field.parts[field.data[0]], field.types[0])


@functools.lru_cache(maxsize=2)
def gguf_metadata(path: str) -> dict:
    return {name: field_value(f) for name, f in open_gguf(path).fields.items()}


def gguf_hf_config(path: str) -> dict:
    """The architecture from the metadata, as the keys of a HF config.json."""
    meta = gguf_metadata(path)
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path!r}; "
                         f"LongServe reads {', '.join(ARCHITECTURES)}")
    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ValueError(f"GGUF file {path!r} lacks the metadata key {arch}.{key}")
        if isinstance(value, list):
            raise ValueError(f"{arch}.{key} in {path!r} varies per layer; not supported")
        return value
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path!r}: partial rotary (rope.dimension_count "
                         f"{get('rope.dimension_count')} < head_dim {head_dim}) is not supported")
    names = {t.name for t in open_gguf(path).tensors}
    if "rope_freqs.weight" in names:
        raise ValueError(f"{path!r} has per-dimension RoPE frequency factors (rope_freqs); "
                         "not supported: load the HF folder instead")
    vocab = int(tensor_shape(path, "token_embd.weight")[0])
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return dict(
        architectures=[ARCHITECTURES[arch]], vocab_size=vocab, hidden_size=hidden,
        intermediate_size=get("feed_forward_length"), num_hidden_layers=get("block_count"),
        num_attention_heads=heads, num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim, rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0), rope_scaling=rope_scaling(meta, arch, path),
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=sorted(set(eos)),
        torch_dtype="float32")


def rope_scaling(meta: dict, arch: str, path: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ValueError(f"{path!r}: RoPE scaling {kind!r} is not supported (none, linear)")


def tensor_shape(path: str, name: str) -> tuple[int, ...]:
    """Torch order: GGUF lists dimensions fastest-first, the reverse of a row-major shape."""
    for t in open_gguf(path).tensors:
        if t.name == name:
            return tuple(int(n) for n in reversed(t.shape.tolist()))
    raise ValueError(f"GGUF file {path!r} has no tensor {name!r}")


def hf_tensor_name(name: str, path: str) -> str:
    """llama.cpp's tensor name -> the HF checkpoint name."""
    base, _, kind = name.rpartition(".")
    if base in TOP_LEVEL_NAMES and kind == "weight":
        return f"{TOP_LEVEL_NAMES[base]}.weight"
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in LAYER_NAMES and kind in ("weight", "bias"):
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{kind}"
    raise ValueError(f"unexpected tensor {name!r} in GGUF file {path!r}")


def unpermute_rotary_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: within each head, rows (0, D/2, 1, D/2+1, ...) back
    to (0, 1, ..., D-1). Its converter does reshape(n, 2, D/2).swapaxes(1, 2)."""
    return w.reshape(n_heads, -1, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_tensors(path: str, hf: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor of the file, dequantized on the fly."""
    from longserve.models.gguf_dequant import dequantize
    llama = hf["architectures"][0] == "LlamaForCausalLM"
    heads = {"q_proj": hf["num_attention_heads"], "k_proj": hf["num_key_value_heads"]}
    for t in open_gguf(path).tensors:
        name = hf_tensor_name(t.name, path)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))
        try:
            tensor = dequantize(np.asarray(t.data), t.tensor_type, shape)
        except ValueError as e:
            raise ValueError(f"tensor {t.name!r} in {path!r}: {e}") from None
        proj = name.split(".")[-2]
        if llama and proj in heads:
            tensor = unpermute_rotary_rows(tensor, heads[proj])
        yield name, tensor
