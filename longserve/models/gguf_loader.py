"""GGUF checkpoints (llama.cpp's single-file format): the header read here, the metadata as a HF-style
config dict, every tensor dequantized to float32 (by the `gguf` package) under its HF name (loader.py
slices it); llama.cpp's q/k row permutation for GPT-J-style RoPE is undone (ours is Neox style, as HF's)."""
from __future__ import annotations

import functools
import mmap
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass

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


# GGUF's value types (the spec's numbering): fixed-size ones by struct code; 8 string, 9 array
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
STRING, ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order (GGUF lists dimensions fastest-first)
    tensor_type: int  # GGMLQuantizationType
    data: np.ndarray  # its raw bytes, a view of the memory-mapped file


class _Cursor:
    """Reads little-endian GGUF values from a buffer, moving forward."""

    def __init__(self, buf):
        self.buf, self.at = buf, 0

    def scalar(self, code: str):
        (value,) = struct.unpack_from("<" + code, self.buf, self.at)
        self.at += struct.calcsize("<" + code)
        return value

    def string(self) -> str:
        n = self.scalar("Q")
        self.at += n
        return str(self.buf[self.at - n:self.at], "utf-8")

    def value(self, kind: int):
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            return self.scalar(SCALARS[kind])
        kind, n = self.scalar("I"), self.scalar("Q")
        if kind in SCALARS:  # one numpy read, not n struct calls (a vocabulary's scores, types)
            dtype = np.dtype("<" + SCALARS[kind])
            values = np.frombuffer(self.buf, dtype, n, self.at).tolist()
            self.at += n * dtype.itemsize
            return values
        return [self.value(kind) for _ in range(n)]


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> tuple[dict, list[GGUFTensor]]:
    """The file's metadata and tensors, one read per process and file (memory-mapped). Parsed here,
    not by gguf's GGUFReader, which takes seconds on a 49K-token vocabulary (a numpy view a string)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    try:
        with open(path, "rb") as f:
            return _read_gguf(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
    except Exception as e:  # struct errors, bad UTF-8, unknown value types, a short file, ...
        raise ValueError(f"{path!r} is not a readable GGUF file: {type(e).__name__}: {e}") from None


def _read_gguf(buf: mmap.mmap) -> tuple[dict, list[GGUFTensor]]:
    """Header, metadata, tensor infos, then the data at the next multiple of general.alignment."""
    from gguf import GGML_QUANT_SIZES
    c = _Cursor(buf)
    if c.scalar("I") != 0x46554747 or c.scalar("I") not in (2, 3):  # b"GGUF", then the version
        raise ValueError("not GGUF version 2 or 3 (little-endian)")
    num_tensors, num_fields = c.scalar("Q"), c.scalar("Q")
    meta = {c.string(): c.value(c.scalar("I")) for _ in range(num_fields)}
    infos = []
    for _ in range(num_tensors):
        name, dims = c.string(), c.scalar("I")
        infos.append((name, [c.scalar("Q") for _ in range(dims)], c.scalar("I"), c.scalar("Q")))
    align = meta.get("general.alignment", 32)
    start = -(-c.at // align) * align
    tensors = []
    for name, dims, kind, offset in infos:
        block_size, type_size = GGML_QUANT_SIZES[kind]
        size = int(np.prod(dims)) // block_size * type_size
        if start + offset + size > len(buf):
            raise ValueError(f"tensor {name!r} runs past the end of the file")
        tensors.append(GGUFTensor(name, tuple(reversed(dims)), kind,
                                  np.frombuffer(buf, np.uint8, size, start + offset)))
    return meta, tensors


def gguf_metadata(path: str) -> dict:
    return open_gguf(path)[0]


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
    shapes = {t.name: t.shape for t in open_gguf(path)[1]}
    if "rope_freqs.weight" in shapes:
        raise ValueError(f"{path!r} has per-dimension RoPE frequency factors (rope_freqs); "
                         "not supported: load the HF folder instead")
    if "token_embd.weight" not in shapes:
        raise ValueError(f"GGUF file {path!r} has no tensor 'token_embd.weight'")
    eos = [meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta]
    return dict(
        architectures=[ARCHITECTURES[arch]], vocab_size=shapes["token_embd.weight"][0], hidden_size=hidden,
        intermediate_size=get("feed_forward_length"), num_hidden_layers=get("block_count"),
        num_attention_heads=heads, num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim, rms_norm_eps=get("attention.layer_norm_rms_epsilon"),
        rope_theta=get("rope.freq_base", 10000.0), rope_scaling=rope_scaling(meta, arch, path),
        max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in shapes,
        attention_bias="blk.0.attn_q.bias" in shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=sorted(set(eos)),
        torch_dtype="float32")


def rope_scaling(meta: dict, arch: str, path: str) -> dict | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta[f"{arch}.rope.scaling.factor"])}
    raise ValueError(f"{path!r}: RoPE scaling {kind!r} is not supported (none, linear)")


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
    for t in open_gguf(path)[1]:
        name = hf_tensor_name(t.name, path)
        try:
            tensor = dequantize(t.data, t.tensor_type, t.shape)
        except ValueError as e:
            raise ValueError(f"tensor {t.name!r} in {path!r}: {e}") from None
        proj = name.split(".")[-2]
        if llama and proj in heads:
            tensor = unpermute_rotary_rows(tensor, heads[proj])
        yield name, tensor
