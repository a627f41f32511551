"""The engine core: the step loop on a thread of its own, taking requests at any time.

Any thread (an HTTP server's event loop, a script) validates a request at the door
(`make_request`, which raises ValueError/TypeError naming the field), hands it over with
`add_request` and reads its `RequestStream`: deltas of token ids, detokenized text that
never splits a character, logprobs, and at the end the finish reason. `abort` drops a
request wherever it is and returns its KV blocks. The loop thread alone touches the
scheduler: commands reach it through a queue. An exception inside a step is fatal: every
request in flight gets `EngineDeadError` and no new one is taken. The core knows nothing
of HTTP; it counts what it serves in `stats` for whoever exports metrics.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, replace

from longserve.engine.detokenizer import IncrementalDetokenizer
from longserve.engine.llm_engine import LLMEngine
from longserve.engine.request import Request
from longserve.engine.stats import EngineStats
from longserve.sampling_params import SamplingParams

logger = logging.getLogger("longserve.engine")


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

    def merged(self, later: "StreamOutput") -> "StreamOutput":
        logprobs = None if self.logprobs is None else self.logprobs + (later.logprobs or [])
        return replace(later, token_ids=self.token_ids + later.token_ids, text=self.text + later.text,
                       logprobs=logprobs)


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
class _Tracked:
    """The core's view of a request it streams."""
    request: Request
    stream: RequestStream
    holdback: int  # chars kept back while a stop string could still begin in them
    num_sent: int = 0  # output tokens already streamed
    text_sent: int = 0  # characters already streamed
    last_time: float | None = None


class EngineCore:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None):
        self.engine = engine
        self.max_waiting = max_waiting
        self.stats = EngineStats()
        self.error: str | None = None  # set by a fatal engine error
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # loop thread only
        self._lock = threading.Lock()  # guards _closed and _num_live
        self._closed = False
        self._num_live = 0
        self._thread = threading.Thread(target=self._run, name="longserve-engine-core", daemon=True)
        self._thread.start()

    # ---- any thread -------------------------------------------------------------------
    @property
    def config(self):
        return self.engine.config

    @property
    def healthy(self) -> bool:
        return self.error is None and not self._closed

    @property
    def num_running(self) -> int:
        sched = self.engine.scheduler
        return sum(len(s.running) for s in getattr(sched, "schedulers", [sched]))  # DP: per rank

    @property
    def num_waiting(self) -> int:
        """Requests taken but not running (racy read: for admission control and gauges)."""
        return max(0, self._num_live - self.num_running)

    def kv_cache_usage(self) -> float:
        """Share of KV blocks in use, over every DP rank's pool."""
        managers = self.engine.kv_managers
        return 1.0 - sum(m.num_free_blocks for m in managers) / sum(m.num_blocks for m in managers)

    def prefix_cache_tokens(self) -> tuple[int, int]:
        """(prompt tokens looked up, found) in the prefix cache, over every DP rank."""
        managers = self.engine.kv_managers
        return (sum(m.num_cached_tokens_queried for m in managers),
                sum(m.num_cached_tokens_hit for m in managers))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.encode(prompt, add_special_tokens)

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> dict:
        return self.engine.encode_chat(messages, chat_template, add_generation_prompt)

    def decode(self, token_ids: list[int]) -> str:
        return self.engine.decode(token_ids)

    def make_request(self, prompt, params: SamplingParams,
                     data_parallel_rank: int | None = None) -> Request:
        """Validate at the door: raises ValueError / TypeError naming the bad field."""
        return self.engine.make_request(prompt, params, data_parallel_rank)

    def make_requests(self, prompt, params: SamplingParams,
                      data_parallel_rank: int | None = None) -> list[Request]:
        """One request per choice (SamplingParams.n, when it exists): validated at the door."""
        n = getattr(params, "n", 1)
        if n == 1:
            return [self.make_request(prompt, params, data_parallel_rank)]
        return [self.make_request(prompt, replace(params, n=1, seed=None if params.seed is None
                                                  else params.seed + i), data_parallel_rank)
                for i in range(n)]

    def add_request(self, request: Request, loop: asyncio.AbstractEventLoop | None = None) -> RequestStream:
        stream = RequestStream(request.request_id, loop)
        with self._lock:
            if self._closed:
                raise EngineDeadError(self.error or "the engine is shutting down")
            if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
                raise EngineOverloadedError(f"{self.num_waiting} requests are waiting "
                                            f"(--max-waiting {self.max_waiting}); try again later")
            self._num_live += 1
            self._commands.put(("add", request, stream))
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is in flight, stop the loop, stop the workers."""
        self._commands.put(("stop",))
        self._thread.join(timeout)
        self.engine.shutdown()

    # ---- the loop thread --------------------------------------------------------------
    def _run(self) -> None:
        reason = "the engine is shutting down"
        try:
            while self._handle_commands(block=not self._busy()):
                if self._busy():
                    self.engine.step()
                    self._emit()
        except BaseException as e:  # a fatal error inside a step: the engine cannot go on
            logger.exception("engine core failed")
            self.error = reason = f"the engine failed: {type(e).__name__}: {e}"
        finally:
            self._fail_all(EngineDeadError(reason))

    def _busy(self) -> bool:
        """Requests to step, or KV transfers to serve: a producer's held blocks go back only
        when a step sees the consumer's release or the lease's end, even with no request left."""
        return self.engine.has_unfinished() or self.engine.has_kv_transfers()

    def _handle_commands(self, block: bool) -> bool:
        """Apply queued commands (waiting for one when idle); False on stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
            while True:
                if command[0] == "stop":
                    return False
                if command[0] == "add":
                    self._add(*command[1:])
                else:
                    self._abort(command[1])
                command = self._commands.get_nowait()
        except queue.Empty:
            return True

    def _add(self, request: Request, stream: RequestStream) -> None:
        stops = request.sampling_params.stop
        holdback = max(map(len, stops)) - 1 if stops else 0
        if request.detokenizer is None:  # shared with the engine's stop-string check
            request.detokenizer = IncrementalDetokenizer(self.engine.decode)
        self._tracked[request.request_id] = _Tracked(request, stream, holdback)
        self.engine.add_request(request)

    def _abort(self, request_id: str) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is None:
            return
        self.engine.abort_request(request_id)
        self._deliver([(tracked.stream, self._finish(tracked, time.perf_counter()))])

    def _emit(self) -> None:
        """Stream what each request produced in the step; retire the finished."""
        now, batch = time.perf_counter(), []
        for tracked in list(self._tracked.values()):
            req = tracked.request
            if len(req.output_token_ids) == tracked.num_sent and not req.is_finished:
                continue
            out = self._finish(tracked, now) if req.is_finished else self._delta(tracked, now)
            batch.append((tracked.stream, out))
        self._deliver(batch)

    def _delta(self, tracked: _Tracked, now: float) -> StreamOutput:
        req = tracked.request
        new_ids = req.output_token_ids[tracked.num_sent:]
        self._count_tokens(tracked, len(new_ids), now)
        detok = req.detokenizer
        detok.update(req.output_token_ids)  # a no-op where the stop-string check just did it
        upto = len(detok.text) - tracked.holdback
        text = detok.text[tracked.text_sent:upto] if upto > tracked.text_sent else ""
        return self._output(tracked, new_ids, text)

    def _finish(self, tracked: _Tracked, now: float) -> StreamOutput:
        req = tracked.request
        new_ids = req.output_token_ids[tracked.num_sent:]
        self._count_tokens(tracked, len(new_ids), now)
        final = self.engine.to_output(req)  # what LLM.generate returns
        out = self._output(tracked, new_ids, final.outputs[0].text[tracked.text_sent:])
        out.kv_transfer_params, out.error = final.kv_transfer_params, final.error
        out.finished, out.finish_reason = True, req.finish_reason or "abort"
        out.stop_reason = req.stop_reason
        self.stats.finished[out.finish_reason] += 1
        self.stats.num_preemptions += req.num_preemptions
        self.stats.e2e_request_latency.observe(now - req.arrival)
        del self._tracked[req.request_id]
        with self._lock:
            self._num_live -= 1
        return out

    def _output(self, tracked: _Tracked, new_ids: list[int], text: str) -> StreamOutput:
        req = tracked.request
        logprobs = None
        if req.sampling_params.logprobs is not None:
            logprobs = req.logprobs[tracked.num_sent:tracked.num_sent + len(new_ids)]
        tracked.num_sent += len(new_ids)
        tracked.text_sent += len(text)
        return StreamOutput(req.request_id, list(new_ids), text, logprobs, req.num_prompt_tokens,
                            tracked.num_sent)

    def _count_tokens(self, tracked: _Tracked, n_new: int, now: float) -> None:
        if n_new == 0:
            return
        req, stats = tracked.request, self.stats
        stats.generation_tokens += n_new
        if tracked.num_sent == 0:
            stats.prompt_tokens += req.num_prompt_tokens
            stats.time_to_first_token.observe((req.first_token_time or now) - req.arrival)
        elif tracked.last_time is not None:
            for _ in range(n_new):  # tokens that came out together share the gap
                stats.inter_token_latency.observe((now - tracked.last_time) / n_new)
        tracked.last_time = now

    @staticmethod
    def _deliver(batch: list[tuple[RequestStream, object]]) -> None:
        """Hand outputs to their readers: one wake-up per event loop per step."""
        by_loop = defaultdict(list)
        for stream, item in batch:
            if stream.loop is None:
                stream.queue.put(item)
            else:
                by_loop[stream.loop].append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody is reading
                pass

    def _fail_all(self, error: EngineDeadError) -> None:
        """Close the door, then fail every request in flight or still queued."""
        with self._lock:
            self._closed = True
        failed = [(t.stream, error) for t in self._tracked.values()]
        self._tracked.clear()
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            if command[0] == "add":
                failed.append((command[2], error))
        self._deliver(failed)


def _put_all(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)
