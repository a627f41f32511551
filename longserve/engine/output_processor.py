"""The front end's side of every request: token ids from the cores become text, stop strings are
found (the request then aborted in its core), and each reader gets a delta per step
(`RequestStream`) or one final `RequestOutput`; a dead core fails its requests (EngineDeadError)."""
from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

from longserve.engine.detokenizer import IncrementalDetokenizer, decode, find_stop
from longserve.engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from longserve.engine.request import CompletionOutput, RequestOutput

PLAIN = EngineCoreOutput("", [])  # what a column entry says besides its token: nothing


class EngineDeadError(RuntimeError):
    """The engine failed (or is shutting down): the request cannot be served."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; try again later."""


@dataclass(slots=True)
class StreamOutput:
    """What one choice of a request produced since its previous output (a delta)."""
    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[dict[int, float]] | None
    num_prompt_tokens: int
    num_output_tokens: int  # in total so far
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: dict | None = None  # at the end, for a disaggregated decode instance
    error: str | None = None  # at the end: why the request failed alone (finish_reason "error")
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with choice 0's first delta
    prompt_ranks: list[int | None] | None = None  # and each prompt token's rank (1 = likeliest)
    index: int = 0  # the choice (SamplingParams.n)

    def merged(self, later: "StreamOutput") -> "StreamOutput":
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return replace(later, token_ids=self.token_ids + later.token_ids, text=self.text + later.text,
                       logprobs=logprobs, prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
                       prompt_ranks=self.prompt_ranks or later.prompt_ranks)


class RequestStream:
    """One request's outputs, read by a thread (`for out in stream`) or a loop (`batches()`) until all
    its `n` choices end; a choice's deltas that queued up while the reader was busy come merged."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None, n: int = 1):
        self.request_id, self.loop, self.n = request_id, loop, n
        self.queue = asyncio.Queue() if loop is not None else queue.SimpleQueue()

    def _take(self, first):
        """`first` and what queued up behind it: (one merged StreamOutput per choice, an error or None)."""
        items = [first]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        merged: dict[int, StreamOutput] = {}
        for out in items:
            if isinstance(out, StreamOutput):
                merged[out.index] = merged[out.index].merged(out) if out.index in merged else out
        return list(merged.values()), next((i for i in items if isinstance(i, BaseException)), None)

    def __iter__(self):
        left = self.n
        while left:
            outs, error = self._take(self.queue.get())
            yield from outs
            left -= sum(o.finished for o in outs)
            if left and error is not None:
                raise error

    async def batches(self):
        """On a loop: lists of what queued up since the last (one merged delta per choice)."""
        left = self.n
        while left:
            outs, error = self._take(await self.queue.get())
            yield outs
            left -= sum(o.finished for o in outs)
            if left and error is not None:
                raise error


@dataclass(slots=True)
class Choice:
    """One choice of a request: its tokens, text and end."""
    index: int
    detokenizer: IncrementalDetokenizer | None  # streams and stop strings
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str | None = None  # set when a stop string cut the text
    stop_string: str | None = None  # the stop string that ended it here
    num_sent: int = 0  # tokens already streamed
    text_sent: int = 0  # characters already streamed
    last_time: float | None = None
    output: CompletionOutput | None = None  # at its end


@dataclass(slots=True)
class RequestState:
    request: EngineCoreRequest
    sink: RequestStream | queue.SimpleQueue  # a stream of deltas, or a queue of final outputs
    engine_index: int
    holdback: int  # chars kept back while a stop string could still begin in them
    choices: list[Choice]
    streams: bool  # the sink takes deltas (a RequestStream)
    prompt_logprobs: list | None = None
    prompt_ranks: list | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    kv_transfer_params: dict | None = None
    error: str | None = None


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer  # a tokenizers.Tokenizer, or None (token ids only)
        self.metrics = None  # the server's counters (entrypoints/openai/metrics.py: ServerMetrics)
        self._states: dict[str, RequestState] = {}
        self._choices: dict[str, tuple[RequestState, Choice]] = {}  # by the core's choice id
        self._lock = threading.Lock()

    @property
    def num_unfinished(self) -> int:
        return len(self._states)

    def add(self, request: EngineCoreRequest, sink, engine_index: int) -> None:
        stops = request.sampling_params.stop
        streams = isinstance(sink, RequestStream)
        choices = [Choice(i, IncrementalDetokenizer(self.tokenizer) if streams or stops else None)
                   for i in range(request.sampling_params.n)]
        state = RequestState(request, sink, engine_index, max(map(len, stops)) - 1 if stops else 0,
                             choices, streams)
        with self._lock:
            self._states[request.request_id] = state
            self._choices.update((cid, (state, c)) for cid, c in zip(request.choice_ids, choices))

    def decode(self, token_ids: list[int]) -> str:
        return decode(self.tokenizer, token_ids)

    def process(self, msg: EngineCoreOutputs) -> list[str]:
        """Apply one step's outputs of a core; returns the choices a stop string ended here (to abort)."""
        now, deliveries, stopped = time.perf_counter(), [], []
        num_new, gaps = 0, []  # the metrics' new tokens and their inter-token gaps
        entries = [(rid, (t,), PLAIN) for rid, t in zip(msg.token_req_ids, msg.token_ids)]
        with self._lock:
            for rid, new, o in entries + [(o.request_id, o.new_token_ids, o) for o in msg.outputs]:
                state, choice = self._choices.get(rid, (None, None))
                if state is None:
                    continue  # ended here already (stop string, abort)
                num_new += len(new)
                if self._update(state, choice, new, o, now, gaps):
                    if o.finish_reason is None:
                        stopped.append(rid)
                    deliveries.append(self._finish(state, choice, o, now))
                elif state.streams and choice.num_sent < len(choice.output_token_ids):
                    text, upto = choice.detokenizer.text, len(choice.detokenizer.text) - state.holdback
                    deliveries.append((state.sink, self._stream_output(
                        state, choice, text[choice.text_sent:upto] if upto > choice.text_sent else "")))
            if self.metrics is not None and num_new:  # once a call, not once a request
                self.metrics.tokens(num_new, gaps)
        _deliver([d for d in deliveries if d[1] is not None])
        return stopped

    def _update(self, state: RequestState, choice: Choice, new_ids: list[int], o: EngineCoreOutput,
                now: float, gaps: list[float]) -> bool:
        """Take the new tokens in; True when the choice ended (in its core or by a stop string)."""
        choice.output_token_ids += new_ids
        if o.new_logprobs:
            choice.logprobs += o.new_logprobs
        if o.prompt_logprobs is not None:
            state.prompt_ranks = [None] + [rank for rank, _ in o.prompt_logprobs]
            state.prompt_logprobs = [None] + [entry for _, entry in o.prompt_logprobs]
        self._count_tokens(state, choice, len(new_ids), now, gaps)
        if choice.detokenizer is None:
            return o.finish_reason is not None
        new = choice.detokenizer.update(choice.output_token_ids)
        params = state.request.sampling_params
        if (new and params.stop and o.finish_reason != "stop"
                and len(choice.output_token_ids) >= params.min_tokens):
            hit = find_stop(choice.detokenizer.text, len(new), params.stop)
            if hit is not None:
                at, stop = hit
                keep = at + len(stop) if params.include_stop_str_in_output else at
                choice.text, choice.stop_string = choice.detokenizer.text[:keep], stop
                return True
        return o.finish_reason is not None

    def _stream_output(self, state: RequestState, choice: Choice, text: str) -> StreamOutput:
        params, n = state.request.sampling_params, len(choice.output_token_ids)
        out = StreamOutput(state.request.request_id, choice.output_token_ids[choice.num_sent:], text,
                           choice.logprobs[choice.num_sent:n] if params.logprobs is not None else None,
                           state.request.num_prompt_tokens, n, index=choice.index)
        if choice.num_sent == 0 and choice.index == 0:
            out.prompt_logprobs, out.prompt_ranks = state.prompt_logprobs, state.prompt_ranks
        choice.num_sent, choice.text_sent = n, choice.text_sent + len(text)
        return out

    def _finish(self, state: RequestState, choice: Choice, o: EngineCoreOutput, now: float) -> tuple:
        """The end of a choice: its last delta; the request's RequestOutput once all ended."""
        del self._choices[state.request.choice_ids[choice.index]]
        reason, stop_reason = o.finish_reason, o.stop_reason
        if choice.stop_string is not None:  # ended by a stop string (maybe as its core ended it)
            reason, stop_reason = "stop", choice.stop_string
        state.num_preemptions += o.num_preemptions
        state.kv_transfer_params = state.kv_transfer_params or o.kv_transfer_params
        state.error = state.error or o.error
        if self.metrics is not None:
            self.metrics.finished(reason)
        text = choice.text if choice.text is not None else self.decode(choice.output_token_ids)
        choice.output = CompletionOutput(choice.index, text, choice.output_token_ids, reason,
                                         stop_reason, choice.logprobs or None)
        done = all(c.output is not None for c in state.choices)
        if done:
            del self._states[state.request.request_id]
            if self.metrics is not None:
                self.metrics.request_done(state.num_preemptions, now - state.request.arrival_time)
        if state.streams:
            out = self._stream_output(state, choice, text[choice.text_sent:])
            out.finished, out.finish_reason, out.stop_reason = True, reason, stop_reason
            out.kv_transfer_params, out.error = o.kv_transfer_params, o.error
            return state.sink, out
        return state.sink, self._request_output(state) if done else None

    def _request_output(self, state: RequestState) -> RequestOutput:
        r = state.request
        ttft = None if state.first_token_time is None else state.first_token_time - r.arrival_time
        return RequestOutput(
            request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
            outputs=[c.output for c in state.choices], finished=True,
            metrics={"time_to_first_token": ttft, "num_preemptions": state.num_preemptions},
            kv_transfer_params=state.kv_transfer_params, error=state.error,
            prompt_logprobs=state.prompt_logprobs if r.sampling_params.prompt_logprobs is not None
            else None)

    def abort(self, request_id: str) -> tuple[int | None, list[str]]:
        """Ended by the front end (client gone): its core and its choices' core ids ([]: ended)."""
        with self._lock:
            state = self._states.get(request_id)
            if state is None:
                return None, []
            now, ends = time.perf_counter(), []
            for cid, c in zip(state.request.choice_ids, state.choices):
                if c.output is None:
                    ends.append(self._finish(state, c, EngineCoreOutput(cid, [], finish_reason="abort"), now))
        _deliver([e for e in ends if e[1] is not None])
        return state.engine_index, state.request.choice_ids

    def fail(self, error: EngineDeadError, engine_index: int | None = None) -> None:
        """Fail every request of one core (or of all cores)."""
        with self._lock:
            dead = [s for s in self._states.values()
                    if engine_index is None or s.engine_index == engine_index]
            for s in dead:
                del self._states[s.request.request_id]
                for cid in s.request.choice_ids:
                    self._choices.pop(cid, None)
        _deliver([(s.sink, error) for s in dead])

    def _count_tokens(self, state: RequestState, choice: Choice, n_new: int, now: float,
                      gaps: list[float]) -> None:
        if n_new == 0:
            return
        if state.first_token_time is None:
            state.first_token_time = now
            if self.metrics is not None:
                self.metrics.first_token(state.request.num_prompt_tokens, now - state.request.arrival_time)
        elif self.metrics is not None and choice.last_time is not None:  # together: a shared gap
            gaps += [(now - choice.last_time) / n_new] * n_new
        choice.last_time = now


def _deliver(batch: list[tuple[object, object]]) -> None:
    """Hand outputs to their readers: one wake-up per event loop per call."""
    by_loop = defaultdict(list)
    for sink, item in batch:
        if isinstance(sink, RequestStream) and sink.loop is not None:
            by_loop[sink.loop].append((sink, item))
        else:
            (sink.queue if isinstance(sink, RequestStream) else sink).put(item)
    for loop, items in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is reading
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
