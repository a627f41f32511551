"""The front end: the door (`make_request` tokenizes and validates, raising ValueError / TypeError
naming the field), the engine cores' client (DP coordinator) and every request's outputs;
shared by `LLM` and the API server (docs/architecture.md, 'Engine cores and the front end')."""
from __future__ import annotations

import contextlib
import itertools
import logging
import os
import queue
import time

from longserve.config import EngineConfig, refuse
from longserve.distributed.parallel_state import launched_by_torchrun
from longserve.engine.core_client import FrontEnd, InprocClient, MPClient
from longserve.engine.dp_coordinator import DPCoordinator
from longserve.engine.messages import EngineCoreOutputs, EngineCoreRequest
from longserve.engine.output_processor import (EngineDeadError, EngineOverloadedError,
                                               OutputProcessor, RequestStream)
from longserve.engine.scheduler import check_request_fits
from longserve.inputs import parse_prompt
from longserve.sampling_params import SamplingParams
from longserve.startup import critical_path, describe, use_kernel_cache
from longserve.tokenizer import load_tokenizer, render_chat

logger = logging.getLogger("longserve.engine")
MULTIPROCESSING = "LONGSERVE_ENABLE_MULTIPROCESSING"


def use_multiprocessing(config: EngineConfig) -> bool:
    """Engine cores in processes of their own, unless asked not to (one core only) or under torchrun."""
    return config.parallel.data_parallel_size > 1 or (
        os.environ.get(MULTIPROCESSING, "1") != "0" and not launched_by_torchrun())


class LLMEngine:
    def __init__(self, config: EngineConfig, max_waiting: int | None = None,
                 front_end: FrontEnd | None = None, started_at: float | None = None):
        """front_end: one of several API servers, on another process's cores; started_at: t0."""
        t0 = started_at or time.time()
        use_kernel_cache()
        self.config, self.max_waiting = config, max_waiting
        self.tokenizer_info = load_tokenizer(config.model)
        self.tokenizer = self.tokenizer_info.tokenizer
        self.output = OutputProcessor(self.tokenizer)
        self.error: str | None = None  # set when no core can serve any more
        self.log_requests = False  # an INFO line per request (the server's --enable-log-requests)
        self._closed = False
        self._ids = itertools.count()
        self._id_prefix = f"{front_end.index}-" if front_end else ""  # unique over front ends
        self.coordinator = DPCoordinator(config.parallel.data_parallel_size, config.dp_lockstep,
                                         *((front_end.index, len(front_end.addresses.inputs))
                                           if front_end else (0, 1)))
        if front_end is not None or use_multiprocessing(config):
            self.client = MPClient(config, self._on_outputs, self._on_dead, front_end)
            self.client.start()
        else:
            self.client = InprocClient(config, self._on_outputs, self._on_dead)
        self.infos = self.client.infos
        self.num_blocks = min(info["num_gpu_blocks"] for info in self.infos)
        self.tokens_per_block = self.infos[0]["tokens_per_block"]
        self._grammars = None  # GrammarCompiler, built at the first structured request
        core = self.infos[0]["startup"]  # the first core's phases: the others' run beside them
        if front_end is not None:  # cores another process started: from their start
            t0 = min(t0, core["start"])
        self.startup_phases = critical_path(t0, core, time.time())
        self.startup = describe(self.startup_phases, core["ranks"])
        logger.info("engine %s", self.startup)

    def encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        refuse(self.tokenizer is None, f"{self.config.model.path!r} has no tokenizer (tokenizer.json); "
               "pass {'prompt_token_ids': [...]} instead of text")
        # the _batch calls let go of the GIL while they work: a long prompt tokenized on a
        # server's thread leaves its event loop running (encode holds it throughout)
        return self.tokenizer.encode_batch([prompt], add_special_tokens=add_special_tokens)[0].ids

    def encode_chat(self, messages: list[dict], chat_template: str | None = None,
                    add_generation_prompt: bool = True) -> dict:
        """A conversation -> {"prompt": text, "prompt_token_ids": ...}; the template writes any BOS itself."""
        refuse(self.tokenizer is None, f"{self.config.model.path!r} has no tokenizer; chat needs one")
        text = render_chat(self.tokenizer_info, messages, add_generation_prompt, chat_template)
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}

    def decode(self, token_ids: list[int]) -> str:
        return self.output.decode(token_ids)

    def make_request(self, prompt, params: SamplingParams,
                     data_parallel_rank: int | None = None) -> EngineCoreRequest:
        """A request from a validated prompt (inputs.py) and params; data_parallel_rank pins it."""
        check_dp_rank(data_parallel_rank, self.config.parallel.data_parallel_size)
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params = params.canonical()  # plain and validated: it always serializes to the core
        ids, text = parse_prompt(prompt, self.encode)
        self.check_prompt(ids)
        self.check_params(params, len(ids))
        kv_params = (params.extra_args or {}).get("kv_transfer_params")
        refuse(kv_params is not None and not isinstance(kv_params, dict),
               f"kv_transfer_params must be a dict, got {type(kv_params).__name__}")
        req = EngineCoreRequest(f"{self._id_prefix}{next(self._ids)}", ids, params, self.config.model.eos_token_ids,
                                time.perf_counter(), data_parallel_rank, kv_params or None, text)
        if kv_params:
            refuse(params.prompt_logprobs is not None, "prompt_logprobs cannot be combined with "
                   "kv_transfer_params: the prompt's KV is loaded, not computed (ask the producer for them)")
            refuse(self.config.kv_transfer.kv_role is None, "kv_transfer_params need an instance "
                   "started with a kv_role (kv_transfer_config={'kv_role': 'kv_consumer'})")
            from longserve.kv_transfer.p2p import validate_kv_transfer_params
            validate_kv_transfer_params(self.config, kv_params, ids)
        return req

    def check_prompt(self, ids: list[int]) -> None:
        max_len, vocab = self.config.scheduler.max_model_len, self.config.model.vocab_size
        refuse(not ids, "the prompt is empty")
        refuse(len(ids) >= max_len, f"the prompt has {len(ids)} tokens; max_model_len is {max_len}, which "
               "leaves no room for output (raise max_model_len or shorten the prompt)")
        bad = [t for t in ids if not 0 <= t < vocab]
        refuse(bad, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def check_params(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Checks that need the model or the pool (the request must fit the pool alone)."""
        vocab, max_seqs = self.config.model.vocab_size, self.config.scheduler.max_num_seqs
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            refuse(k is not None and k > vocab, f"{name} must be in [0, {vocab}] (the vocabulary), got {k}")
        refuse(params.n > max_seqs, f"n must be at most max_num_seqs={max_seqs} (the choices run together), "
               f"got {params.n}")
        refuse(params.n > 1 and self.config.kv_transfer.kv_role in ("kv_producer", "kv_both"),
               "n must be 1 on a KV producer instance (it hands one prompt's KV to a decode instance; "
               "ask that one for several choices)")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias or ())):
            bad = [t for t in ids if t >= vocab]
            refuse(bad, f"{name} {bad[:5]} are outside the vocabulary [0, {vocab})")
        check_request_fits(num_prompt_tokens, params.max_tokens, self.config.scheduler.max_model_len,
                           self.num_blocks, self.tokens_per_block)
        if params.structured_outputs is not None:
            self.check_structured_outputs(params.structured_outputs)

    def check_structured_outputs(self, so) -> None:
        """Compile the grammar (cached) to refuse what xgrammar cannot compile."""
        if self._grammars is None:
            from longserve.engine.structured_output import GrammarCompiler
            m = self.config.model
            self._grammars = GrammarCompiler(self.tokenizer, m.vocab_size, m.eos_token_ids)
        self._grammars.compile(*so.key)

    def add_request(self, request: EngineCoreRequest, loop=None,
                    sink: queue.SimpleQueue | None = None) -> RequestStream | queue.SimpleQueue:
        """Queue a validated request: its deltas go to a new RequestStream (read by a thread, or by
        `loop`), or with `sink` its final RequestOutput goes there."""
        if self.error is not None or self._closed:
            raise EngineDeadError(self.error or "the engine is shutting down")
        # (the count is racy: as last reported; read only when admission is bounded)
        if self.max_waiting is not None and (waiting := self.coordinator.num_waiting()) >= self.max_waiting:
            raise EngineOverloadedError(f"{waiting} requests are waiting "
                                        f"(--max-waiting {self.max_waiting}); try again later")
        core = self.coordinator.choose(request.data_parallel_rank)
        if core in self.coordinator.dead:
            raise EngineDeadError(self.client.dead.get(core, f"engine core {core} is dead"))
        if self.log_requests:
            logger.info("request %s: %d prompt tokens, %s", request.request_id,
                        request.num_prompt_tokens, request.sampling_params)
        sink = sink if sink is not None else RequestStream(request.request_id, loop,
                                                           request.sampling_params.n)
        self.output.add(request, sink, core)
        wave = self.coordinator.on_send(core)
        self.client.add_request(core, request)
        if wave is not None:
            self.client.start_wave(wave)
        return sink

    def abort(self, request_id: str) -> None:
        """End a request, every choice of it."""
        core, choice_ids = self.output.abort(request_id)
        with contextlib.suppress(RuntimeError):  # its core is gone: nothing of it is left to free
            if choice_ids:  # else it had ended
                self.client.abort(core, choice_ids)

    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        """On the client's reader thread: one core's step."""
        if msg.stats is not None:
            self.coordinator.on_stats(msg.engine_index, msg.stats)
        if msg.outputs or msg.token_ids:
            stopped = self.output.process(msg)
            if stopped:  # a stop string ended them here: their core frees their blocks
                self.client.abort(msg.engine_index, stopped)
        if msg.wave_started is not None:
            wave = self.coordinator.on_wave_started(msg.wave_started)
            if wave is not None:
                self.client.start_wave(wave)
        if msg.wave_finished is not None:
            self.coordinator.on_wave_finished(msg.wave_finished)

    def _on_dead(self, core: int, reason: str) -> None:
        """A core died: its requests fail (all, for expert models: their cores step together)."""
        logger.error(reason)
        self.coordinator.dead.add(core)
        if self.config.dp_lockstep or len(self.coordinator.dead) == self.coordinator.num_cores:
            self.error = reason
            self.output.fail(EngineDeadError(reason))
        else:
            self.output.fail(EngineDeadError(reason), core)

    @property
    def healthy(self) -> bool:
        """Every core alive (a dead one makes /health answer 503, even if others serve)."""
        return self.error is None and not self._closed and not self.coordinator.dead

    def info(self) -> dict:
        """What the engine holds (the server's start-up banner)."""
        c = self.config
        sizes = {k: getattr(c.parallel, k) for k in ("tensor_parallel_size", "prefill_context_parallel_size",
                                                     "decode_context_parallel_size", "data_parallel_size")}
        return dict(model=c.model.path, dtype=str(c.dtype).removeprefix("torch."), device=c.device,
                    device_names=[n for i in self.infos for n in i["device_names"]], **sizes,
                    num_gpu_blocks=self.num_blocks, tokens_per_block=self.tokens_per_block,
                    max_model_len=c.scheduler.max_model_len, cudagraph_capture_s=self.infos[0]["cudagraph_capture_s"],
                    load_s=max(i["load_s"] for i in self.infos), startup=self.startup)

    @property
    def core(self):
        """The EngineCore itself, when it runs in this process (tests and debugging)."""
        if not isinstance(self.client, InprocClient):
            raise RuntimeError(f"the engine cores run in processes of their own; use "
                               f"engine.call(...) or {MULTIPROCESSING}=0")
        return self.client.core

    def call(self, method: str, *args, core: int = 0, timeout: float = 60.0):
        """EngineCore.<method>(*args) in one core (tests, benchmarks)."""
        return self.client.call(core, method, *args, timeout=timeout)

    def core_stats(self) -> dict:
        """The cores' counters (prompt tokens computed, prefix hits, KV loads...), summed."""
        total: dict = {}
        for core in range(self.coordinator.num_cores):
            for k, v in self.call("stats", core=core).items():  # (None: not counted where it runs)
                total[k] = None if v is None else total.get(k, 0) + v
        return total

    def pool_states(self) -> list[dict]:
        return [self.call("pool_state", core=c) for c in self.coordinator.live()]

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort what is in flight, stop the cores (and their workers). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.client.shutdown(timeout)
        self.output.fail(EngineDeadError("the engine is shutting down"))


def check_dp_rank(rank, dp_size: int) -> None:
    refuse(rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < dp_size),
           f"data_parallel_rank must be an integer in [0, {dp_size}), got {rank!r}")
