"""Incremental detokenization and stop strings; how deltas come out: docs/architecture.md, 'Engine
cores and the front end' (Deltas)."""
from __future__ import annotations


def decode(tokenizer, token_ids: list[int]) -> str:
    """The text of `token_ids`, special tokens skipped ("" with no tokenizer)."""
    return "" if tokenizer is None else tokenizer.decode_batch([token_ids])[0]


class IncrementalDetokenizer:
    """A choice's text as its tokens come, by `tokenizers`' DecodeStream: it decodes a window of the
    last few tokens in Rust (~1.4 us a token, half our Python window's) and holds back a character
    split over tokens until it is whole."""

    def __init__(self, tokenizer):
        from tokenizers.decoders import DecodeStream
        self.tokenizer, self.stream = tokenizer, DecodeStream(skip_special_tokens=True)
        self.text, self.num_read = "", 0

    def update(self, token_ids: list[int]) -> str:
        """Bring `text` up to date with `token_ids`; returns the text added."""
        new = ""
        if self.tokenizer is not None:
            for t in token_ids[self.num_read:]:
                new += self.stream.step(self.tokenizer, t) or ""
        self.num_read = len(token_ids)
        self.text += new
        return new


def find_stop(text: str, num_new_chars: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends within the last `num_new_chars` characters of `text`."""
    start = max(0, len(text) - num_new_chars - max(map(len, stops)) + 1)
    if len(stops) == 1:  # the usual case, once per request a step: no list to build
        at = text.find(stops[0], start)
        return None if at < 0 else (at, stops[0])
    hits = [(at, s) for s in stops if (at := text.find(s, start)) >= 0]
    return min(hits) if hits else None
