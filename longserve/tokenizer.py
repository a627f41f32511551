"""The model's tokenizer and chat template: from a HF folder, a GGUF file's metadata, or a
`tokenizer=` folder overriding both; `render_chat` runs its Jinja2 as HF's `apply_chat_template`."""
from __future__ import annotations

import os
from dataclasses import dataclass

from longserve.config import ModelConfig, read_json
from longserve.models.gguf_loader import gguf_metadata, is_gguf


@dataclass
class TokenizerInfo:
    tokenizer: object | None  # tokenizers.Tokenizer
    chat_template: str | None
    bos_token: str
    eos_token: str


def load_tokenizer(cfg: ModelConfig) -> TokenizerInfo:
    source = cfg.tokenizer or cfg.path
    if is_gguf(source):
        from longserve.models.gguf_tokenizer import gguf_tokenizer
        meta = gguf_metadata(source)
        tok, template = gguf_tokenizer(meta, source), meta.get("tokenizer.chat_template")
        extra = {}
    else:
        tok, template, extra = folder_tokenizer(source)
    def token(key, token_id):
        value = extra.get(key)
        value = value.get("content") if isinstance(value, dict) else value
        if value is None and tok is not None and token_id is not None:
            value = tok.id_to_token(token_id)
        return value or ""
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else None
    return TokenizerInfo(tok, template, token("bos_token", cfg.bos_token_id), token("eos_token", eos))


def folder_tokenizer(path: str):
    """(Tokenizer or None, chat template or None, tokenizer_config dict) of a HF folder."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer folder {path!r} does not exist")
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        return None, None, {}
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(file)
    except Exception as e:  # the Rust side raises a bare Exception for a corrupt file
        raise ValueError(f"cannot read the tokenizer {file}: {e}") from None
    config_file = os.path.join(path, "tokenizer_config.json")
    extra = read_json(config_file) if os.path.isfile(config_file) else {}
    extra = extra if isinstance(extra, dict) else {}
    template = extra.get("chat_template")
    jinja_file = os.path.join(path, "chat_template.jinja")
    if template is None and os.path.isfile(jinja_file):
        with open(jinja_file) as f:
            template = f.read()
    return tok, template, extra


def render_chat(info: TokenizerInfo, messages: list[dict], add_generation_prompt: bool = True,
                chat_template: str | None = None) -> str:
    template = chat_template or info.chat_template
    if template is None:
        raise ValueError("the model has no chat template; pass chat_template=... or use generate()")
    check_messages(messages)
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=info.bos_token, eos_token=info.eos_token)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from None


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError("a conversation is a non-empty list of {'role': ..., 'content': ...}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content', "
                            f"got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"messages[{i}][{key!r}] must be a string, got {m.get(key)!r}")
