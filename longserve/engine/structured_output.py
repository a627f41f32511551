"""Structured outputs with xgrammar: compiled grammars, a `GrammarState` per request, the core's
compile thread and the mask thread (docs/architecture.md, 'Structured outputs')."""
from __future__ import annotations

import functools
import json
import re
import sys
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from longserve.config import ModelConfig
from longserve.engine.request import Request
from longserve.step_plan import SchedulerOutput


class GrammarCompiler:
    """xgrammar's compiler for one tokenizer; `compile(kind, spec)` is cached (LRU)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int], cache_size: int = 256):
        if tokenizer is None:
            raise ValueError("structured_outputs need the model's tokenizer (tokenizer.json)")
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
        # xgrammar sees the tokenizer's ids and the stop ids (it scans any id past them on each
        # accept: slow with a padded vocabulary); the sampler masks the model's ids past them
        self.mask_vocab = min(vocab_size, max([tokenizer.get_vocab_size(with_added_tokens=True)]
                                              + [t + 1 for t in eos_token_ids]))
        info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                                  vocab_size=self.mask_vocab,
                                                  stop_token_ids=eos_token_ids or None)
        self.xgr, self.vocab_size = xgr, vocab_size
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.compile = functools.lru_cache(cache_size)(self._compile)

    def _compile(self, kind: str, spec: str):
        c = self.compiler
        try:  # compact JSON: no free whitespace a model could loop on
            if kind in ("json", "json_object"):
                return c.compile_json_schema(spec or '{"type": "object"}', any_whitespace=False)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "choice":
                return c.compile_grammar("root ::= " + " | ".join(map(json.dumps, json.loads(spec))))
            return c.compile_grammar(spec)
        except Exception as e:  # xgrammar's messages start with a time and a C++ source line
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e).strip())
            raise ValueError(f"structured_outputs.{kind}: xgrammar cannot compile it: {reason}") from None


class GrammarState:
    """A request's matcher and the tokens sampled for it not accepted yet (`pending`: appended by the
    step loop, accepted by the mask thread)."""

    def __init__(self, matcher):
        self.matcher, self.stop_ids = matcher, frozenset(matcher.stop_token_ids)
        self.pending: list[int] = []
        self.rejected: int | None = None  # a token the matcher refused (the mask forbids it)


class StructuredOutputManager:
    """The core's side: compiles off the step loop, holds requests until ready, builds bitmasks."""

    def __init__(self, model: ModelConfig):
        self.model = model
        self._compiler: GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-mask")
        self._batch = None  # xgrammar's BatchGrammarMatcher, made with the first compiler
        self.compiling: dict[str, tuple[Request, Future]] = {}

    def compiler(self) -> GrammarCompiler:  # on the pool's thread: the tokenizer loads there
        if self._compiler is None:
            # a short GIL switch interval: the mask thread runs beside the loop (else no overlap)
            sys.setswitchinterval(min(sys.getswitchinterval(), 2e-4))
            from longserve.tokenizer import load_tokenizer
            m = self.model
            self._compiler = GrammarCompiler(load_tokenizer(m).tokenizer, m.vocab_size, m.eos_token_ids)
        return self._compiler

    @property
    def in_use(self) -> bool:
        """Whether any request had a grammar (a plain engine's steps skip looking for one)."""
        return bool(self.compiling) or self._compiler is not None

    def add(self, req: Request) -> None:
        key = req.sampling_params.structured_outputs.key
        self.compiling[req.request_id] = req, self._pool.submit(lambda: self.compiler().compile(*key))

    def abort(self, req_id: str) -> None:
        """A compiling request, or one choice of it."""
        self.compiling.pop(req_id, None)
        for req, _ in self.compiling.values():
            req.children = [c for c in req.children if c.request_id != req_id]

    def ready(self, block: bool) -> list[Request]:
        """Requests whose grammar compiled (a matcher attached) or failed (finished with the error), in
        arrival order; block: wait up to 50 ms for one."""
        if block and self.compiling:
            wait([f for _, f in self.compiling.values()], 0.05, FIRST_COMPLETED)
        out = []
        for req_id, (req, future) in list(self.compiling.items()):
            if future.done():
                del self.compiling[req_id]
                error = future.exception()
                for r in [req] + req.children:  # n > 1: a matcher per choice
                    if error is None:
                        r.grammar = GrammarState(self._compiler.xgr.GrammarMatcher(future.result()))
                    else:
                        r.finish_reason, r.error = "error", str(error)
                out.append(req)
        return out

    def start_bitmask(self, out: SchedulerOutput, requests: dict[str, Request]) -> Future:
        """`bitmask` on the mask thread for the plan's sampling rows with a grammar; nothing may sample
        for them until its result is taken."""
        sampling = [requests.get(rid) for rid in out.sampling_req_ids()]
        rows = [i for i, q in enumerate(sampling) if q is not None and q.grammar is not None]
        work = [(sampling[i].grammar, sampling[i].grammar.pending) for i in rows]
        for g, _ in work:
            g.pending = []
        return self._mask_pool.submit(self.bitmask, rows, work)

    def bitmask(self, rows: list[int], work: list[tuple[GrammarState, list[int]]]
                ) -> tuple[torch.Tensor, list[int]]:
        """Accept each row's tokens; then int32 [R, ceil(V' / 32)] for the rows whose matcher is live, and
        those rows (among the plan's sampling requests); V' = `GrammarCompiler.mask_vocab`."""
        self._accept(work)
        live = [(i, g.matcher) for i, (g, _) in zip(rows, work) if not g.matcher.is_terminated()]
        xgr = self._compiler.xgr
        mask = xgr.allocate_token_bitmask(len(live), self._compiler.mask_vocab)
        # one call for all rows on one thread (xgrammar's threads were slower); it releases the GIL
        self._batch = self._batch or xgr.BatchGrammarMatcher(1)
        self._batch.batch_fill_next_token_bitmask([m for _, m in live], mask)
        tail = self._compiler.mask_vocab % 32  # xgrammar leaves the bits past its ids set
        if tail:
            mask[:, -1] &= (1 << tail) - 1
        return mask, [i for i, _ in live]

    def _accept(self, work: list[tuple[GrammarState, list[int]]]) -> None:
        """Each row's tokens in order: one xgrammar call per position (cheaper than a Python loop
        of accept_token); a matcher that refused one takes no more."""
        accept = self._compiler.xgr.BatchGrammarMatcher.batch_accept_token
        for k in range(max((len(tokens) for _, tokens in work), default=0)):
            batch = [(g, tokens[k]) for g, tokens in work if len(tokens) > k and g.rejected is None]
            for (g, t), ok in zip(batch, accept([g.matcher for g, _ in batch], [t for _, t in batch])):
                if not ok:
                    g.rejected = t

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._mask_pool.shutdown(wait=False, cancel_futures=True)
