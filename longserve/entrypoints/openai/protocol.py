"""Requests of the OpenAI HTTP API (the fields LongServe supports), as pydantic models, and the
model list; responses and stream chunks are plain dicts (serving_engine.py), encoded by msgspec."""
from __future__ import annotations

import time
import uuid
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIError(Exception):
    """An error that the server answers with {"error": {message, type, param, code}}."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class StreamOptions(BaseModel):
    include_usage: bool = False


# Fields of OpenAI's and vLLM's APIs that this server knows and cannot honour, with the values
# that ask for nothing (None always does): any other value is a 400 naming the field.
UNSUPPORTED = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
               "min_p": (0,), "use_beam_search": (False,), "length_penalty": (1,),
               "allowed_token_ids": (), "bad_words": ([],), "truncate_prompt_tokens": (),
               "logits_processors": (), "skip_special_tokens": (True,), "priority": (0,),
               "spaces_between_special_tokens": (True,), "cache_salt": (), "request_id": (),
               "vllm_xargs": (), "mm_processor_kwargs": ()}
HARMLESS = {"user", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    """Fields that completions and chat share (OpenAI's, plus vLLM's top_k, ignore_eos, ...); unknown
    fields are kept (`model_extra`): `unsupported()` refuses the known ones, the rest are logged once."""
    model_config = ConfigDict(extra="allow")
    unsupported_here: ClassVar[dict] = {}
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1)
    best_of: int | None = None  # refused above 1 (n gives several choices)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> bias added to its logit
    prompt_logprobs: int | None = Field(None, ge=0, le=20)  # vLLM's
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:<id>"
    return_token_ids: bool = False  # vLLM's: choices carry the output token ids (a chunk per step)
    kv_transfer_params: dict | None = None  # prefill/decode disaggregation (longserve proxy)
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def unsupported(self) -> tuple[str | None, list[str]]:
        """(the first field set that this server cannot honour, the unknown fields)."""
        refused, unknown = None, []
        for name, value in (self.model_extra or {}).items():
            ok = {**UNSUPPORTED, **self.unsupported_here}.get(name)
            if ok is not None and value is not None and value not in ok:
                refused = refused or name
            elif ok is None and name not in HARMLESS:
                unknown.append(name)
        return refused, unknown


class CompletionRequest(SamplingFields):
    unsupported_here: ClassVar[dict] = {"suffix": ("",), "add_special_tokens": (True,)}
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: score the prompt (with echo or prompt_logprobs)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]  # OpenAI's (chat templates know them)
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingFields):
    # no tool parser exists for any chat format yet: tools are refused, tool_choice "none" is fine
    unsupported_here: ClassVar[dict] = {
        "tools": ([],), "tool_choice": ("none",), "parallel_tool_calls": (), "functions": ([],),
        "function_call": ("none",), "echo": (False,), "continue_final_message": (False,),
        "add_special_tokens": (False,), "documents": (), "chat_template": (), "chat_template_kwargs": ({},),
        "store": (False,), "prediction": (), "audio": (), "modalities": (["text"],),
        "reasoning_effort": (), "web_search_options": (), "verbosity": ()}
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


# responses (completions and chat: plain dicts, serving_engine.response_body)
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "longserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(BaseModel):  # vLLM's: a prompt, or messages rendered by the chat template
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
