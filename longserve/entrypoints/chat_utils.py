"""Chat templates: messages -> one prompt string, by the model's Jinja template (as HF renders it)."""
from __future__ import annotations

import json
import os
from functools import lru_cache


def load_chat_template(model_path: str, override: str | None = None) -> str | None:
    """`override` (a file or the template itself), else tokenizer_config.json's chat_template."""
    if override:
        if os.path.isfile(override):
            with open(override) as f:
                return f.read()
        return override
    file = os.path.join(model_path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        template = json.load(f).get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return template


def special_tokens(model_path: str) -> dict[str, str]:
    """bos_token / eos_token as the template sees them."""
    file = os.path.join(model_path, "tokenizer_config.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        cfg = json.load(f)
    out = {}
    for key in ("bos_token", "eos_token"):
        value = cfg.get(key)
        out[key] = value.get("content", "") if isinstance(value, dict) else (value or "")
    return out


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True,
                **tokens: str) -> str:
    return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **tokens)


@lru_cache(maxsize=8)
def _compile(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env.from_string(template)
