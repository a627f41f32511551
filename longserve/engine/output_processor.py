"""The front end's side of every request: text, stop strings, logprobs, streams and metrics.

Engine cores report token ids (`EngineCoreOutput`); here, off the step loop's process, they
become text (incremental detokenization that never splits a character), stop strings are
found (the request is then finished here and aborted in its core), and each request's
reader gets either a delta per step (`RequestStream`: the server's SSE) or, when it asked
for the end only, one `RequestOutput` (`LLM.generate`). A core that dies fails its requests
with `EngineDeadError`.
"""
from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace

from longserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from longserve.engine.messages import EngineCoreOutput, EngineCoreRequest
from longserve.engine.request import CompletionOutput, RequestOutput
from longserve.engine.stats import EngineStats


class EngineDeadError(RuntimeError):
    """The engine failed (or is shutting down): the request cannot be served."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting; try again later."""


@dataclass
class StreamOutput:
    """What one request produced since its previous output (a delta)."""
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
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with the first delta

    def merged(self, later: "StreamOutput") -> "StreamOutput":
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return replace(later, token_ids=self.token_ids + later.token_ids, text=self.text + later.text,
                       logprobs=logprobs, prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs)


class RequestStream:
    """One request's outputs, read by a thread (`for out in stream`) or a loop (`async for`).

    Deltas that queued up while the reader was busy come merged into one."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop | None = None):
        self.request_id = request_id
        self.loop = loop
        self.queue = asyncio.Queue() if loop is not None else queue.SimpleQueue()

    def _drain(self, first) -> list:
        items = [first]
        while not self.queue.empty():
            items.append(self.queue.get_nowait())
        return items

    @staticmethod
    def _combine(items: list):
        """(one merged StreamOutput or None, an error or None)."""
        outs = [i for i in items if isinstance(i, StreamOutput)]
        errors = [i for i in items if isinstance(i, BaseException)]
        merged = None
        for out in outs:
            merged = out if merged is None else merged.merged(out)
        return merged, (errors[0] if errors else None)

    def __iter__(self):
        while True:
            out, error = self._combine(self._drain(self.queue.get()))
            if out is not None:
                yield out
                if out.finished:
                    return
            if error is not None:
                raise error

    async def __aiter__(self):
        while True:
            out, error = self._combine(self._drain(await self.queue.get()))
            if out is not None:
                yield out
                if out.finished:
                    return
            if error is not None:
                raise error


@dataclass
class RequestState:
    request: EngineCoreRequest
    sink: RequestStream | queue.SimpleQueue  # a stream of deltas, or a queue of final outputs
    engine_index: int
    detokenizer: IncrementalDetokenizer | None  # streams and stop strings
    holdback: int  # chars kept back while a stop string could still begin in them
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list | None = None
    text: str | None = None  # set when a stop string cut the text
    stop_string: str | None = None  # the stop string that ended it here
    num_sent: int = 0  # tokens already streamed
    text_sent: int = 0  # characters already streamed
    first_token_time: float | None = None
    last_time: float | None = None


class OutputProcessor:
    def __init__(self, decode):
        self.decode = decode  # token ids -> text
        self.stats = EngineStats()
        self._states: dict[str, RequestState] = {}
        self._lock = threading.Lock()

    @property
    def num_unfinished(self) -> int:
        return len(self._states)

    def engine_of(self, request_id: str) -> int | None:
        state = self._states.get(request_id)
        return None if state is None else state.engine_index

    def add(self, request: EngineCoreRequest, sink, engine_index: int) -> None:
        stops = request.sampling_params.stop
        streams = isinstance(sink, RequestStream)
        detok = IncrementalDetokenizer(self.decode) if streams or stops else None
        with self._lock:
            self._states[request.request_id] = RequestState(
                request, sink, engine_index, detok, max(map(len, stops)) - 1 if stops else 0)

    def process(self, outputs: list[EngineCoreOutput]) -> list[str]:
        """Apply one step's outputs of a core; returns the requests that a stop string ended
        here (their core must abort them)."""
        now, deliveries, stopped = time.perf_counter(), [], []
        with self._lock:
            for o in outputs:
                state = self._states.get(o.request_id)
                if state is None:
                    continue  # ended here already (stop string, abort)
                finished = self._update(state, o, now)
                if finished and o.finish_reason is None:
                    stopped.append(o.request_id)
                deliveries.append(self._finish(state, o, now) if finished
                                  else (state.sink, self._delta(state)))
        _deliver([d for d in deliveries if d[1] is not None])
        return stopped

    def _update(self, state: RequestState, o: EngineCoreOutput, now: float) -> bool:
        """Take the new tokens in; True when the request ended (in its core or by a stop string)."""
        state.output_token_ids += o.new_token_ids
        if o.new_logprobs:
            state.logprobs += o.new_logprobs
        if o.prompt_logprobs is not None:
            state.prompt_logprobs = [None] + list(o.prompt_logprobs)
        self._count_tokens(state, len(o.new_token_ids), now)
        if state.detokenizer is None:
            return o.finish_reason is not None
        new = state.detokenizer.update(state.output_token_ids)
        params = state.request.sampling_params
        if (new and params.stop and o.finish_reason != "stop"
                and len(state.output_token_ids) >= params.min_tokens):
            hit = find_stop(state.detokenizer.text, len(new), params.stop)
            if hit is not None:
                at, stop = hit
                keep = at + len(stop) if params.include_stop_str_in_output else at
                state.text, state.stop_string = state.detokenizer.text[:keep], stop
                return True
        return o.finish_reason is not None

    def _delta(self, state: RequestState) -> StreamOutput | None:
        if not isinstance(state.sink, RequestStream) or state.num_sent == len(state.output_token_ids):
            return None
        upto = len(state.detokenizer.text) - state.holdback
        text = state.detokenizer.text[state.text_sent:upto] if upto > state.text_sent else ""
        return self._stream_output(state, text)

    def _stream_output(self, state: RequestState, text: str) -> StreamOutput:
        params, n = state.request.sampling_params, len(state.output_token_ids)
        out = StreamOutput(state.request.request_id, state.output_token_ids[state.num_sent:], text,
                           state.logprobs[state.num_sent:n] if params.logprobs is not None else None,
                           state.request.num_prompt_tokens, n)
        if state.num_sent == 0:
            out.prompt_logprobs = state.prompt_logprobs
        state.num_sent, state.text_sent = n, state.text_sent + len(text)
        return out

    def _finish(self, state: RequestState, o: EngineCoreOutput, now: float) -> tuple:
        """The end of a request: its last delta, or its whole RequestOutput."""
        del self._states[state.request.request_id]
        reason, stop_reason = o.finish_reason, o.stop_reason
        if state.stop_string is not None:  # ended by a stop string (maybe as its core ended it)
            reason, stop_reason = "stop", state.stop_string
        self._count_finished(state, reason, o.num_preemptions, now)
        text = state.text if state.text is not None else self.decode(state.output_token_ids)
        if isinstance(state.sink, RequestStream):
            out = self._stream_output(state, text[state.text_sent:])
            out.finished, out.finish_reason, out.stop_reason = True, reason, stop_reason
            out.kv_transfer_params, out.error = o.kv_transfer_params, o.error
            return state.sink, out
        return state.sink, self._request_output(state, text, reason, stop_reason, o)

    def _request_output(self, state: RequestState, text: str, reason: str, stop_reason,
                        o: EngineCoreOutput) -> RequestOutput:
        r = state.request
        ttft = None if state.first_token_time is None else state.first_token_time - r.arrival_time
        return RequestOutput(
            request_id=r.request_id, prompt=r.prompt, prompt_token_ids=r.prompt_token_ids,
            outputs=[CompletionOutput(0, text, state.output_token_ids, reason, stop_reason,
                                      state.logprobs or None)],
            finished=True, metrics={"time_to_first_token": ttft, "num_preemptions": o.num_preemptions},
            kv_transfer_params=o.kv_transfer_params, error=o.error,
            prompt_logprobs=state.prompt_logprobs if r.sampling_params.prompt_logprobs is not None
            else None)

    def abort(self, request_id: str) -> None:
        """Ended by the front end (a client gone, a failed caller): the reader gets the end."""
        with self._lock:
            state = self._states.get(request_id)
            if state is None:
                return
            end = self._finish(state, EngineCoreOutput(request_id, [], finish_reason="abort"),
                               time.perf_counter())
        _deliver([end])

    def fail(self, error: EngineDeadError, engine_index: int | None = None) -> None:
        """Fail every request of one core (or of all cores)."""
        with self._lock:
            dead = [s for s in self._states.values()
                    if engine_index is None or s.engine_index == engine_index]
            for s in dead:
                del self._states[s.request.request_id]
        _deliver([(s.sink, error) for s in dead])

    def _count_tokens(self, state: RequestState, n_new: int, now: float) -> None:
        if n_new == 0:
            return
        stats = self.stats
        stats.generation_tokens += n_new
        if state.first_token_time is None:
            state.first_token_time = now
            stats.prompt_tokens += state.request.num_prompt_tokens
            stats.time_to_first_token.observe(now - state.request.arrival_time)
        elif state.last_time is not None:
            for _ in range(n_new):  # tokens that came out together share the gap
                stats.inter_token_latency.observe((now - state.last_time) / n_new)
        state.last_time = now

    def _count_finished(self, state: RequestState, reason: str, preemptions: int, now: float) -> None:
        self.stats.finished[reason] += 1
        self.stats.num_preemptions += preemptions
        self.stats.e2e_request_latency.observe(now - state.request.arrival_time)


def _deliver(batch: list[tuple[object, object]]) -> None:
    """Hand outputs to their readers: one wake-up per event loop per call."""
    by_loop = defaultdict(list)
    for sink, item in batch:
        if isinstance(sink, RequestStream) and sink.loop is not None:
            by_loop[sink.loop].append((sink, item))
        else:
            (sink.queue if isinstance(sink, RequestStream) else sink).put(item)
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the loop is closed: nobody is reading
            pass


def _put_all(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
