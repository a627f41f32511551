"""The tokenizer of a GGUF file, rebuilt as a HF `tokenizers` Tokenizer from `tokenizer.ggml.*`
(byte-level BPE, "gpt2"); SentencePiece ("llama") files are not: pass `tokenizer=<HF folder>`."""
from __future__ import annotations

CONTROL, USER_DEFINED = 3, 4

# The split of llama.cpp's pre-tokenizer names: "digits" (each digit alone, then GPT-2's
# split), "gpt2" (GPT-2's split), or a regex (Llama 3 / Qwen 2 style) before byte-level BPE.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = {"default": "gpt2", "gpt2": "gpt2", "smollm": "digits", "starcoder": "digits",
                  "llama-bpe": LLAMA3_SPLIT, "llama3": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT}


def gguf_tokenizer(meta: dict, path: str):
    """A `tokenizers.Tokenizer` equal to the file's (vocabulary, merges, special tokens, pre-tokenizer,
    BOS when `add_bos_token` says so); None if the file has no tokenizer."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise ValueError(f"{path!r}: GGUF tokenizer model {kind!r} is not supported (byte-level "
                         "BPE 'gpt2' is); pass tokenizer=<folder with tokenizer.json>")
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), path)
    tok.decoder = decoders.ByteLevel()
    types = meta.get("tokenizer.ggml.token_type", [])
    tok.add_tokens([AddedToken(tokens[i], special=t == CONTROL, normalized=False)
                    for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)])
    return tok


def pre_tokenizer(name: str, path: str):
    from tokenizers import Regex, pre_tokenizers as pt
    split = PRE_TOKENIZERS.get(name)
    if split is None:
        raise ValueError(f"{path!r}: GGUF pre-tokenizer {name!r} is not supported (one of "
                         f"{sorted(PRE_TOKENIZERS)}); pass tokenizer=<folder with tokenizer.json>")
    byte_level = pt.ByteLevel(add_prefix_space=False, use_regex=split in ("gpt2", "digits"))
    if split == "gpt2":
        return byte_level
    if split == "digits":
        return pt.Sequence([pt.Digits(individual_digits=True), byte_level])
    return pt.Sequence([pt.Split(Regex(split), behavior="isolated", invert=False), byte_level])
