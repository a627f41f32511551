"""The prompt forms `generate` accepts, in vLLM's shapes, checked and made plain: a string,
`{"prompt": str}`, `{"prompt_token_ids": ids}` (optionally with a "prompt" text kept for the
output), or the ids directly (a list of integers, a 1-D integer numpy array or torch tensor)."""
from __future__ import annotations

import numbers

from longserve.sampling_params import as_int

PROMPT_KEYS = ("prompt", "prompt_token_ids")


def as_token_ids(value, name: str = "prompt_token_ids") -> list[int]:
    """Token ids as Python ints; floats, bools and nested lists are refused (never truncated)."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of integers, got {type(value).__name__}")
    if getattr(value, "ndim", 1) != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    if hasattr(value, "dtype") and hasattr(value, "tolist"):  # numpy array / torch tensor
        kind = str(value.dtype)
        if "int" not in kind or "bool" in kind:
            raise ValueError(f"{name} must hold integers, got dtype {kind}")
        value = value.tolist()
    if type(value) is list and all(type(t) is int for t in value):  # the common case, fast
        return list(value)
    return [as_int(t, f"{name}[{i}]") for i, t in enumerate(value)]


def is_token_list(value) -> bool:
    """One prompt given as ids (not a batch of prompts): numbers (floats too, refused later
    with a message naming the entry) or a 1-D array / tensor."""
    if hasattr(value, "dtype") and hasattr(value, "ndim"):
        return value.ndim == 1
    return (isinstance(value, (list, tuple)) and len(value) > 0
            and all(isinstance(t, numbers.Number) or getattr(t, "ndim", None) == 0 for t in value))


def parse_prompt(prompt, encode) -> tuple[list[int], str | None]:
    """(token ids, text) of one prompt; `encode(text)` tokenizes."""
    if isinstance(prompt, str):
        return encode(prompt), prompt
    if isinstance(prompt, dict):
        unknown = sorted(map(str, set(prompt) - set(PROMPT_KEYS)))
        if unknown:
            raise ValueError(f"unknown prompt keys {unknown}; a prompt dict has 'prompt' (text) "
                             "or 'prompt_token_ids'")
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
        if "prompt_token_ids" in prompt:
            return as_token_ids(prompt["prompt_token_ids"]), text
        if text is None:
            raise ValueError("a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")
        return encode(text), text
    if isinstance(prompt, (list, tuple)) or hasattr(prompt, "dtype"):  # ids, array, tensor
        return as_token_ids(prompt), None
    raise TypeError(f"a prompt is a string, a dict with 'prompt' or 'prompt_token_ids', or a list "
                    f"of token ids; got {type(prompt).__name__}")
