"""POST /tokenize and /detokenize, in vLLM's shape: text or chat messages to token ids and back."""
from __future__ import annotations

from longserve.entrypoints.openai.protocol import DetokenizeRequest, OpenAIError, TokenizeRequest
from longserve.entrypoints.openai.serving_chat import OpenAIServingChat
from longserve.entrypoints.openai.serving_engine import check_model


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat, served_names: list[str]):
        self.core, self.chat, self.served_names = chat.core, chat, served_names

    def tokenize(self, body: TokenizeRequest) -> dict:
        check_model(body.model, self.served_names)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give either prompt or messages", param="prompt")
        try:
            if body.messages is None:
                ids = self.core.encode(body.prompt, body.add_special_tokens is not False)
            else:  # rendered by the chat template, which writes the special tokens itself
                rendered = self.chat.render(body)
                ids = (self.core.encode(rendered["prompt"]) if body.add_special_tokens
                       else rendered["prompt_token_ids"])
        except ValueError as e:
            raise OpenAIError(str(e), param="prompt") from None
        return {"tokens": ids, "count": len(ids), "max_model_len": self.core.config.scheduler.max_model_len}

    def detokenize(self, body: DetokenizeRequest) -> dict:
        check_model(body.model, self.served_names)
        try:
            self.core.check_prompt(body.tokens)  # in the vocabulary
        except ValueError as e:
            raise OpenAIError(str(e), param="tokens") from None
        return {"prompt": self.core.tokenizer.decode_batch([body.tokens], skip_special_tokens=False)[0]}
