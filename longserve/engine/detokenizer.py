"""Incremental detokenization and stop strings; how the window moves: docs/architecture.md, 'Engine
cores and the front end' (Deltas)."""
from __future__ import annotations

WINDOW = 4  # read tokens the window holds before it moves up (one decode a step, a second then)


class IncrementalDetokenizer:
    def __init__(self, decode):
        self.decode = decode  # token ids -> text
        self.text = ""
        self.prefix_offset = self.read_offset = 0
        self.prefix = ""  # decode(token_ids[prefix_offset:read_offset])

    def update(self, token_ids: list[int]) -> str:
        """Bring `text` up to date with `token_ids`; returns the text added."""
        full = self.decode(token_ids[self.prefix_offset:])
        if len(full) <= len(self.prefix) or full.endswith("\ufffd"):  # (a character split over tokens)
            return ""
        new = full[len(self.prefix):]
        if self.read_offset - self.prefix_offset >= WINDOW:  # (the last read ones: the context)
            self.prefix_offset, full = self.read_offset, self.decode(token_ids[self.read_offset:])
        self.read_offset, self.prefix = len(token_ids), full
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
