"""The engine-core process: one per DP rank, the step loop with nothing else on its GIL; input and
output threads, `Owners`, waves: docs/architecture.md, 'Engine cores and the front end'."""
from __future__ import annotations

import logging
import queue
import signal
import threading
import traceback
from dataclasses import dataclass

import msgspec

from longserve.config import EngineConfig
from longserve.engine.core import EngineCore
from longserve.engine.messages import (ABORT, ADD, SHUTDOWN, UTILITY, WAVE, EngineCoreOutputs,
                                       UtilityResult, decode_command, encode, pack_result)
from longserve.stalls import freeze_after_warm_up
from longserve.startup import Timeline
from longserve.worker.launch import WorkerProcs

logger = logging.getLogger("longserve.engine")
HEARTBEAT_S = 1.0


@dataclass
class CoreAddresses:
    inputs: list[str]  # each front end's ROUTER (each core connects a DEALER named by its DP rank)
    outputs: list[str]  # each front end's PULL (each core connects a PUSH), in the same order
    dist_init: str | None = None  # the rendezvous of an expert model's DP world


class Owners:
    """Which front end sent each request (choice ids): set by the input thread, read and
    cleared by the output thread (dict operations are atomic under the GIL)."""

    def __init__(self, num_front_ends: int):
        self.n, self.of = num_front_ends, {}

    def add(self, request_ids: list[str], front_end: int) -> None:
        self.of.update(dict.fromkeys(request_ids, front_end))

    def drop(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.of.pop(rid, None)

    def route(self, msg: EngineCoreOutputs) -> list[EngineCoreOutputs]:
        """One message per front end: its requests' outputs (a request ended in its core is
        forgotten), and the rest of `msg` for all."""
        parts = [([], [], []) for _ in range(self.n)]  # (outputs, token_req_ids, token_ids)
        for o in msg.outputs:
            k = self.of.pop(o.request_id, None) if o.finish_reason else self.of.get(o.request_id)
            if k is not None:  # None: aborted by its front end meanwhile
                parts[k][0].append(o)
        for rid, token in zip(msg.token_req_ids, msg.token_ids):
            if (k := self.of.get(rid)) is not None:
                parts[k][1].append(rid)
                parts[k][2].append(token)
        return [msgspec.structs.replace(msg, outputs=o, token_req_ids=r, token_ids=t) for o, r, t in parts]


# steps between the all-reduces that end a wave (a gloo round trip, too dear every step): <= 31 late
WAVE_CHECK_EVERY = 32


class EngineCoreProc:
    """The busy loop over an EngineCore: commands from `inputs`, outputs to `emit`."""

    def __init__(self, core: EngineCore, inputs: queue.Queue, emit, num_front_ends: int = 1):
        self.core, self.inputs, self.emit = core, inputs, emit
        self.num_added = [0] * num_front_ends  # requests taken from each front end
        self.index, self.lockstep = core.engine_index, core.config.dp_lockstep
        self.wave, self.wave_running = 0, False
        self.wave_steps = 0  # this wave's lockstep iterations: the same count on every core
        self.stopping = self.stop_after_wave = False

    def run(self) -> None:
        while not self.stopping:
            applied = self._handle_inputs(block=not self._busy())
            if self.stopping:
                continue
            if not self._busy():
                if applied:  # e.g. an abort while idle freed blocks: the front end's view
                    self.emit(EngineCoreOutputs(self.index, stats=self._stats()))
                continue
            msg = self.core.step(lockstep=self.lockstep)
            if self.lockstep:
                msg.add(self._end_of_wave_check())
            msg.stats = self._stats()
            self.emit(msg)

    def _stats(self):
        stats = self.core.scheduler_stats()
        stats.num_added = tuple(self.num_added)
        return stats

    def _busy(self) -> bool:
        return self.wave_running if self.lockstep else self.core.has_work()

    def _handle_inputs(self, block: bool) -> int:
        """Apply the queued commands (waiting up to 1 s for one when idle); how many."""
        applied = 0
        try:
            # a bounded wait: a signal (SIGTERM) gets the main thread back at once
            kind, payload = self.inputs.get(timeout=1.0) if block else self.inputs.get_nowait()
            while True:
                self._apply(kind, payload)
                applied += 1
                kind, payload = self.inputs.get_nowait()
        except queue.Empty:
            return applied

    def _apply(self, kind: bytes, payload) -> None:
        if kind == ADD:
            request, front_end = payload
            self.num_added[front_end] += 1  # taken, whatever becomes of it
            self.core.add_request(request)
            if self.lockstep and not self.wave_running:  # the others must join this wave
                self.wave_running = True
                self.emit(EngineCoreOutputs(self.index, wave_started=self.wave))
        elif kind == ABORT:
            self.core.abort_requests(payload)
        elif kind == UTILITY:
            self.emit(EngineCoreOutputs(self.index, utility=self._call(*payload)))
        elif kind == WAVE:
            if payload >= self.wave:  # an older wave already ended here
                self.wave, self.wave_running = payload, True
        elif kind == SHUTDOWN:
            if self.lockstep and self.wave_running:
                # the other cores are inside this wave's collectives: end it with them (every
                # core gets SHUTDOWN, drops its requests, and the wave's end check agrees)
                self.core.abort_requests(list(self.core.scheduler.requests))
                self.stop_after_wave = True
            else:
                self.stopping = True

    def _call(self, call_id: int, method: str, args: list) -> UtilityResult:
        if method.startswith("_") or not callable(getattr(self.core, method, None)):
            return UtilityResult(call_id, error=f"the engine core has no method {method!r}")
        try:
            return UtilityResult(call_id, pack_result(getattr(self.core, method)(*args)))
        except Exception as e:
            return UtilityResult(call_id, error=f"{type(e).__name__}: {e}")

    def _end_of_wave_check(self) -> EngineCoreOutputs:
        """Every WAVE_CHECK_EVERY lockstep iterations: does any DP rank still have work? If not,
        all stop (an idle core meanwhile runs dummy steps, as it would for a busy peer)."""
        self.wave_steps += 1
        if self.wave_steps % WAVE_CHECK_EVERY or self.core.dp_any_unfinished():
            return EngineCoreOutputs(self.index)
        outputs = self.core.drain()  # this iteration's dummy step
        self.wave_running, self.wave, self.wave_steps = False, self.wave + 1, 0
        self.stopping = self.stop_after_wave
        if self.index == 0:
            self.emit(EngineCoreOutputs(self.index, wave_finished=self.wave - 1))
        return outputs


def run_engine_core(config: EngineConfig, engine_index: int, addresses: CoreAddresses,
                    spawned_at: float | None = None, workers: WorkerProcs | None = None) -> None:
    """Entry of an engine-core process (start_core_process: only its GPUs visible)."""
    import zmq
    timeline = Timeline(spawned_at)
    timeline.mark("core process start + imports")

    from longserve.worker.worker import exit_with_parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    signal.signal(signal.SIGTERM, _raise_system_exit)
    exit_with_parent()
    ctx = zmq.Context()
    dealers = [ctx.socket(zmq.DEALER) for _ in addresses.inputs]
    for dealer, address in zip(dealers, addresses.inputs):
        dealer.setsockopt(zmq.IDENTITY, engine_index.to_bytes(2, "big"))
        dealer.setsockopt(zmq.LINGER, 2000)
        dealer.connect(address)
    outputs: queue.Queue = queue.Queue()
    owners = Owners(len(addresses.outputs))
    sender = threading.Thread(target=_send_outputs,
                              args=(ctx, addresses.outputs, outputs, engine_index, owners),
                              name="longserve-core-output", daemon=True)
    sender.start()
    try:
        _serve(config, engine_index, addresses, dealers, outputs, owners, timeline, workers)
    finally:
        outputs.put(None)  # flush what is queued, then stop
        sender.join(timeout=5)
        ctx.term()  # the input thread's poll fails with ETERM and closes the DEALERs


def _serve(config, engine_index: int, addresses: CoreAddresses, dealers: list, outputs: queue.Queue,
           owners: Owners, timeline: Timeline, workers: WorkerProcs | None) -> None:
    try:
        core = EngineCore(config, engine_index, addresses.dist_init, timeline, workers)
    except BaseException as e:
        for dealer in dealers:
            dealer.send_multipart([b"failed", encode(f"{type(e).__name__}: {e}")])
        traceback.print_exc()
        raise SystemExit(1)
    freeze_after_warm_up()
    for dealer in dealers:  # then only the input thread uses them
        dealer.send_multipart([b"ready", encode(core.info())])
    inputs: queue.Queue = queue.Queue()
    threading.Thread(target=_receive_inputs, args=(dealers, inputs, owners), name="longserve-core-input",
                     daemon=True).start()
    proc = EngineCoreProc(core, inputs, outputs.put, len(dealers))
    try:
        proc.run()
    except BaseException as e:  # a fatal error inside a step: say why, then go
        if not isinstance(e, SystemExit):
            traceback.print_exc()
        outputs.put(EngineCoreOutputs(engine_index, failed=core.failure_reason(e)))
        raise
    finally:
        core.shutdown()


def _receive_inputs(dealers: list, inputs: queue.Queue, owners: Owners) -> None:
    import zmq
    poller = zmq.Poller()
    for dealer in dealers:
        poller.register(dealer, zmq.POLLIN)
    try:
        while True:
            for dealer, _ in poller.poll():
                kind, payload = dealer.recv_multipart()
                command = decode_command(kind, payload)
                if kind == ADD:
                    front_end = dealers.index(dealer)
                    owners.add(command.choice_ids, front_end)
                    command = (command, front_end)
                elif kind == ABORT:
                    owners.drop(command)
                inputs.put((kind, command))
                if kind == SHUTDOWN:
                    return
    except zmq.ZMQError:  # the context is ending: the process is going down
        return
    finally:
        for dealer in dealers:
            dealer.close()


def _send_outputs(ctx, addresses: list[str], outputs: queue.Queue, engine_index: int, owners: Owners) -> None:
    import zmq
    pushes = [ctx.socket(zmq.PUSH) for _ in addresses]
    for push, address in zip(pushes, addresses):
        push.setsockopt(zmq.LINGER, 500)  # at exit: the last outputs (a failure's reason) go out
        # no high-water mark: a front end that falls behind (or died, in a group of API
        # servers) never blocks the outputs to the others; what it has not read waits here
        push.setsockopt(zmq.SNDHWM, 0)
        push.connect(address)
    stats = None
    try:
        while True:
            try:
                item = outputs.get(timeout=HEARTBEAT_S)
            except queue.Empty:  # quiet (or a long step): the front ends still hear from us
                item = EngineCoreOutputs(engine_index, stats=stats)
            if item is None:
                return
            stats = item.stats or stats
            for push, part in zip(pushes, owners.route(item)):
                push.send(encode(part), copy=False)
    finally:
        for push in pushes:
            push.close()


def _raise_system_exit(signum, frame):
    raise SystemExit(128 + signum)

