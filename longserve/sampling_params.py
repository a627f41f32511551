"""Per-request sampling settings, in vLLM's shape. `validate()` checks every field (messages name it)
and makes integer-likes Python ints; the engine queues `canonical()`, a plain copy that pickles
whatever subclass the caller used."""
from __future__ import annotations

import dataclasses
import json
import math
import numbers
from dataclasses import dataclass, field

SEED_RANGE = (-(1 << 63), 1 << 64)


def as_int(value, name: str, lo: int | None = None, hi: int | None = None):
    """`value` as a Python int in [lo, hi); bools, floats (even 2.0) and strings are refused."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # 0-d numpy / torch value
        value = value.item()  # an int stays an int; a float or bool is refused below
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {_short(value)}")
    value = int(value)
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        raise ValueError(f"{name} must be in [{lo if lo is not None else '-inf'}, "
                         f"{hi - 1 if hi is not None else 'inf'}], got {value}")
    return value


def as_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {type(value).__name__} {_short(value)}")
    return float(value)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@dataclass
class StructuredOutputsParams:
    """vLLM's structured outputs: exactly one of a JSON schema (dict or str), a regex, a
    list of choices, an EBNF grammar, or json_object=True (any JSON object)."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, "
                             f"grammar, json_object; got {kinds or 'none'}")
        for name, ok in (("json", isinstance(self.json, (dict, str, type(None)))),
                         ("regex", isinstance(self.regex, (str, type(None)))),
                         ("grammar", isinstance(self.grammar, (str, type(None)))),
                         ("json_object", self.json_object in (None, True, False)),
                         ("choice", self.choice is None or (isinstance(self.choice, (list, tuple))
                          and self.choice and all(isinstance(c, str) for c in self.choice)))):
            if not ok:
                raise ValueError(f"structured_outputs.{name} has the wrong type: "
                                 f"{_short(getattr(self, name))}")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): what a grammar is compiled from, and its cache key."""
        if self.json is not None:
            return "json", self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        if self.json_object:
            return "json_object", ""
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar)


@dataclass
class SamplingParams:
    n: int = 1  # choices from one prompt (computed once; the choices share its KV blocks)
    temperature: float = 1.0
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per token (0: only the sampled one)
    # per prompt token (from the second): its logprob given its prefix, plus the top-k (0: only it)
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    extra_args: dict | None = None  # {"kv_transfer_params": {...}}: a consumer loads the prompt's KV
    structured_outputs: StructuredOutputsParams | None = None  # output constrained by a grammar

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Check every field and normalize it in place (numpy ints -> int, stop str -> list)."""
        self.temperature = as_float(self.temperature, "temperature")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        self.top_p = as_float(self.top_p, "top_p")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = max(0, as_int(self.top_k, "top_k (-1 or 0: off)", -1))
        self.n = as_int(self.n, "n", 1)
        if self.seed is not None:  # choice i samples with seed + i
            self.seed = as_int(self.seed, "seed", SEED_RANGE[0], SEED_RANGE[1] - self.n + 1)
        if self.max_tokens is not None:
            self.max_tokens = as_int(self.max_tokens, "max_tokens", 0)  # 0: score the prompt only
        self.min_tokens = as_int(self.min_tokens, "min_tokens", 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                setattr(self, name, as_int(getattr(self, name), name, 0))
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {_short(self.logit_bias)}")
            self.logit_bias = {as_int(int(t) if isinstance(t, str) and t.isdigit() else t,
                                      "logit_bias keys", 0): as_float(b, "logit_bias values")
                               for t, b in self.logit_bias.items()} or None
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {_short(stop)}")
        self.stop = list(stop)
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
            raise ValueError(f"stop_token_ids must be a list of token ids, got {_short(ids)}")
        self.stop_token_ids = [as_int(t, "stop_token_ids entries", 0) for t in ids]
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {_short(getattr(self, name))}")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {_short(so)}")

    def canonical(self) -> "SamplingParams":
        """A validated plain SamplingParams copy (what the engine queues and sends to workers)."""
        self.validate()
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingParams)}
        values = {k: list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
                  for k, v in values.items()}
        if self.structured_outputs is not None:  # plain, the schema as canonical JSON text
            kind, spec = self.structured_outputs.key
            values["structured_outputs"] = StructuredOutputsParams(
                **{kind: json.loads(spec) if kind == "choice" else spec or True})
        return SamplingParams(**values)

    def choice(self, i: int) -> "SamplingParams":
        """Choice i of n, one choice: seeded choices differ (seed + i) and repeat; only choice 0
        scores the prompt (prompt_logprobs)."""
        return dataclasses.replace(self, n=1, seed=None if self.seed is None else self.seed + i,
                                   prompt_logprobs=self.prompt_logprobs if i == 0 else None)

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5
