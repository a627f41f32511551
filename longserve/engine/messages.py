"""What the front end and the engine cores say to each other (msgspec). To a core (frames: kind,
payload): ADD (EngineCoreRequest), ABORT (ids), UTILITY (call id, method, args), WAVE, SHUTDOWN.
From a core: one EngineCoreOutputs a step, also alone as heartbeat, utility answer or wave event."""
from __future__ import annotations

import pickle

import msgspec

from longserve.sampling_params import SamplingParams

ADD, ABORT, UTILITY, WAVE, SHUTDOWN = b"add", b"abort", b"utility", b"wave", b"shutdown"


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int] = []
    arrival_time: float = 0.0
    data_parallel_rank: int | None = None
    kv_transfer_params: dict | None = None
    prompt: str | None = None  # the text, when the prompt came as text (front end only)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def choice_ids(self) -> list[str]:
        """The core's request id of each choice (SamplingParams.n of them)."""
        n = self.sampling_params.n
        return [self.request_id] if n == 1 else [f"{self.request_id}-{i}" for i in range(n)]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What one request gained in a step. `prompt_logprobs` come with the first token."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[tuple[int, dict[int, float]]] | None = None  # positions 1..: (rank, entry)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: dict | None = None
    error: str | None = None
    num_preemptions: int = 0


class SchedulerStats(msgspec.Struct, array_like=True):
    """A core's load and pool, for the balancer and /metrics."""
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_blocks: int = 1
    prefix_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_hits: int = 0
    # requests the core has taken from each front end (API server), ever: a front end's
    # requests not counted here yet are still on their way (the balancer's in-flight count)
    num_added: tuple[int, ...] = ()


class UtilityResult(msgspec.Struct, array_like=True):
    call_id: int
    result: bytes = b""  # pickled
    error: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    engine_index: int
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    utility: UtilityResult | None = None
    wave_started: int | None = None  # this core began wave N (the others must join)
    wave_finished: int | None = None  # every core ended wave N together (DP rank 0 says so)
    failed: str | None = None  # the core is going down: why
    # requests that gained one token and nothing else (no logprobs, not ended), as two columns:
    # most of a decode step, without a struct (and its Python) a request
    token_req_ids: list[str] = []
    token_ids: list[int] = []

    def add(self, other: EngineCoreOutputs) -> EngineCoreOutputs:
        """Join another part of the same step's outputs (columns first, then `outputs`)."""
        self.token_req_ids += other.token_req_ids
        self.token_ids += other.token_ids
        self.outputs += other.outputs
        return self


encode = msgspec.msgpack.Encoder().encode
decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
decode_any = msgspec.msgpack.Decoder().decode
_decode_request = msgspec.msgpack.Decoder(EngineCoreRequest).decode
_decode_ids = msgspec.msgpack.Decoder(list[str]).decode


def decode_command(kind: bytes, payload: bytes):
    if kind == ADD:
        return _decode_request(payload)
    if kind == ABORT:
        return _decode_ids(payload)
    return decode_any(payload)


def pack_result(value) -> bytes:
    return pickle.dumps(value, protocol=5)


def unpack_result(data: bytes):
    return pickle.loads(data)
