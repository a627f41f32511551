"""Prefill/decode disaggregation: a producer instance computes the prompt and holds its blocks
under a lease; a consumer instance pulls positions [local hit, prompt - 1) and decodes. Lease,
release key and failure policy: docs/architecture.md, 'KV transfer'."""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from longserve.kv_transfer.topology import KVLayout, check_kv_dtype, plan_kv_pieces
from longserve.kv_transfer.transfer import PieceRange, pack_piece, payload_shape, unpack_piece
from longserve.kv_transfer.transport import (PairGroups, connect_store, next_message, post_pull,
                                             release_key, reply_key, take_reply, td)

log = logging.getLogger(__name__)
GONE, HELD, SCALES_DIFFER = 0, 1, 2  # a pull's status word
PARAM_KEYS = ("do_remote_prefill", "remote_engine_id", "remote_host", "remote_port",
              "remote_request_id", "remote_block_ids", "remote_layout", "num_prompt_tokens",
              "prompt_hash", "num_layers", "head_dim")


def layout_of(config) -> KVLayout:
    p = config.parallel
    return KVLayout(config.model.num_kv_heads, config.cache.block_size, p.tensor_parallel_size,
                    p.prefill_context_parallel_size, p.decode_context_parallel_size,
                    p.cp_kv_cache_interleave_size, config.kv_transfer.kv_buffer_layout,
                    str(config.kv_dtype).removeprefix("torch."))


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha1(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()


def host_store(config):
    """A producer's TCP store (control messages), hosted by its engine process; picks the
    port and engine id into the config before the workers copy it."""
    import torch.distributed as dist
    kvt = config.kv_transfer
    kvt.engine_id = kvt.engine_id or uuid.uuid4().hex[:12]
    if kvt.kv_role not in ("kv_producer", "kv_both"):
        return None
    store = dist.TCPStore(kvt.kv_ip, kvt.kv_port, is_master=True, wait_for_workers=False,
                          timeout=td(kvt.kv_transfer_timeout_s))
    kvt.kv_port = store.port
    # what a consumer that connects at start (kv_connect) needs to build its pair groups
    store.set("engine_info", json.dumps(dict(engine_id=kvt.engine_id, layout=asdict(layout_of(config)))))
    return store


def validate_kv_transfer_params(config, p, prompt_token_ids: list[int]) -> None:
    """At the door: a consumer's params must come from a producer of this model and prompt."""
    if not p.get("do_remote_prefill"):  # (a dict: the door checked)
        return
    role = config.kv_transfer.kv_role
    if role not in ("kv_consumer", "kv_both"):
        raise ValueError(f"kv_transfer_params with do_remote_prefill need kv_role kv_consumer "
                         f"or kv_both; this instance is {role}")
    missing = [k for k in PARAM_KEYS if k not in p]
    if missing:
        raise ValueError(f"kv_transfer_params lacks {missing}")
    if p["prompt_hash"] != prompt_hash(prompt_token_ids):
        raise ValueError("kv_transfer_params were made for a different prompt")
    remote, model = KVLayout(**p["remote_layout"]), config.model
    if (remote.num_kv_heads, p["num_layers"], p["head_dim"]) != \
            (model.num_kv_heads, model.num_layers, model.head_dim):
        raise ValueError("kv_transfer_params come from an instance of a different model shape")
    check_kv_dtype(layout_of(config), remote)


@dataclass
class LoadSpec:
    req_id: str
    params: dict
    block_ids: list[int]
    start: int
    end: int


@dataclass
class P2pMeta:
    loads: list[LoadSpec] = field(default_factory=list)
    new_holds: dict[str, tuple[list[int], float]] = field(default_factory=dict)  # id -> blocks, deadline
    tokens_per_block: int = 1

    @property
    def filled_block_ids(self) -> list[int]:
        return [b for s in self.loads for b in s.block_ids[s.start // self.tokens_per_block:]]


class P2pConnectorScheduler:
    def __init__(self, config, kv_manager, store):
        kvt = config.kv_transfer
        self.config, self.kvt, self.store = config, kvt, store
        self.produces = kvt.kv_role in ("kv_producer", "kv_both")
        self.consumes = kvt.kv_role in ("kv_consumer", "kv_both")
        self.failure_policy = kvt.kv_load_failure_policy
        self.layout, self.tokens_per_block = layout_of(config), kv_manager.tokens_per_block
        self.meta = P2pMeta(tokens_per_block=self.tokens_per_block)
        self.held: dict[str, float] = {}  # producer: request id -> lease deadline
        self.loading: dict[str, dict] = {}  # consumer: request id -> the producer's params
        self._stores: dict[tuple[str, int], object] = {}
        self.num_loaded_tokens = 0

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        p = request.kv_transfer_params
        if not (self.consumes and isinstance(p, dict) and p.get("do_remote_prefill")):
            return 0, False
        external = max(0, p["num_prompt_tokens"] - 1 - num_computed_tokens)
        if external == 0:  # a full local hit: nothing to pull, but the producer may let go
            p["do_remote_prefill"] = False
            self._release(p)
        return external, external > 0

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        p = request.kv_transfer_params
        p["do_remote_prefill"] = False  # one attempt: a failed load recomputes
        start = request.num_computed_tokens
        self.meta.loads.append(LoadSpec(request.request_id, dict(p), list(block_ids), start,
                                        start + num_external_tokens))
        self.loading[request.request_id] = p
        self.num_loaded_tokens += num_external_tokens

    def _release(self, p: dict) -> None:
        """Tell the producer it may free the request's blocks (best effort: a dead producer's are gone)."""
        addr = (p["remote_host"], int(p["remote_port"]))
        try:
            if addr not in self._stores:
                self._stores[addr] = connect_store(*addr, timeout_s=2.0)
            self._stores[addr].set(release_key(p["remote_engine_id"], p["remote_request_id"]), "1")
        except Exception as e:  # noqa: BLE001
            self._stores.pop(addr, None)
            log.warning("could not release request %s on %s: %s", p["remote_request_id"], addr, e)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        mine = request.kv_transfer_params
        wanted = not isinstance(mine, dict) or mine.get("do_remote_decode", True)
        if not self.produces or request.finish_reason == "abort" or not wanted or not block_ids:
            return False, None
        deadline = time.time() + self.kvt.kv_lease_s
        self.held[request.request_id] = deadline
        self.meta.new_holds[request.request_id] = (list(block_ids), deadline)
        return True, dict(
            do_remote_prefill=True, remote_engine_id=self.kvt.engine_id,
            remote_host=self.kvt.kv_ip, remote_port=self.kvt.kv_port,
            remote_request_id=request.request_id, remote_block_ids=list(block_ids),
            remote_layout=asdict(self.layout), num_prompt_tokens=request.num_prompt_tokens,
            prompt_hash=prompt_hash(request.prompt_token_ids), num_layers=self.config.model.num_layers,
            head_dim=self.config.model.head_dim, lease_deadline=deadline)

    def build_connector_meta(self, scheduler_output) -> P2pMeta | None:
        meta, self.meta = self.meta, P2pMeta(tokens_per_block=self.tokens_per_block)
        return meta if meta.loads or meta.new_holds else None

    def update_connector_output(self, kv_out) -> None:
        for req_id in kv_out.finished_recving:
            p = self.loading.pop(req_id, None)
            if p is not None:
                self._release(p)
        for req_id in kv_out.finished_sending:
            if self.held.pop(req_id, None) is not None and self.store is not None:
                self.store.delete_key(release_key(self.kvt.engine_id, req_id))

    def has_pending(self) -> bool:
        return bool(self.held)

    def close(self) -> None:
        self._stores.clear()


@dataclass
class Held:
    block_ids: list[int]
    deadline: float
    readers: int = 0  # pulls reading its blocks now


class P2pConnectorWorker:
    def __init__(self, config, ps, device: torch.device):
        kvt = config.kv_transfer
        self.kvt, self.device = kvt, device
        self.rank, self.layout = ps.model.rank_in_group, layout_of(config)
        self.groups = PairGroups(device, kvt.kv_transfer_timeout_s)
        self.caches: list[torch.Tensor] = []  # as words (as_words), one per cache
        self.scales: list[torch.Tensor] = []  # FP8: [2, Hkv] scales of each cache, on the host
        self.lock = threading.Lock()
        self.hold_added = threading.Condition(self.lock)
        self.held: dict[str, Held] = {}
        self.let_go: set[str] = set()  # held once, let go since: a pull for them is refused
        self.done: dict[str, bool] = {}  # consumer: request id -> load succeeded
        self.failed_blocks: set[int] = set()
        self.stores: dict[tuple[str, int], object] = {}
        self.epochs: dict[str, int] = defaultdict(int)
        self.pair_locks: dict[str, threading.Lock] = {}  # one pull per pair at a time
        self.timings: dict[str, dict] = {}  # consumer: request id -> where its load's time went
        self.stopping = threading.Event()
        self.progress = threading.Event()  # a load ended or a pull was served: the engine looks now
        self.store, self.server = None, None
        if kvt.kv_role in ("kv_producer", "kv_both"):
            self.store = connect_store(kvt.kv_ip, kvt.kv_port, kvt.kv_transfer_timeout_s)
            # the serving thread's own clients (a blocked client blocks its other users): one
            # blocks on the queue (close() wakes it with a stop message), one builds pair groups
            stores = (connect_store(kvt.kv_ip, kvt.kv_port, 7 * 24 * 3600),
                      connect_store(kvt.kv_ip, kvt.kv_port, kvt.kv_transfer_timeout_s))
            self.server = threading.Thread(target=self._serve_loop, args=stores, daemon=True)
            self.server.start()
        if kvt.kv_connect:
            threading.Thread(target=self._connect_all, args=(list(kvt.kv_connect),), daemon=True).start()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor],
                           kv_scales: dict[str, torch.Tensor] | None = None) -> None:
        """kv_scales: an FP8 cache's per-head scales by layer (None: the model's dtype)."""
        seen = set()
        for name, cache in kv_caches.items():  # layer order; a shared cache is moved once
            if cache.data_ptr() not in seen:
                seen.add(cache.data_ptr())
                self.caches.append(as_words(cache))
                if kv_scales is not None:
                    self.scales.append(kv_scales[name].cpu())

    def _piece_scales(self, first_head: int, num_heads: int) -> torch.Tensor | None:
        """[L, 2, num_heads] FP8 scales of this rank's heads [first_head, +num_heads)."""
        return (torch.stack([s[:, first_head:first_head + num_heads] for s in self.scales])
                if self.scales else None)

    def _same_scales(self, msg: dict) -> bool:
        """Whether the consumer dequantizes the pieces' heads with this producer's scales."""
        theirs = msg.get("kv_scales") or [None] * len(msg["pieces"])
        mine = [self._piece_scales(p.remote_head, p.num_heads) for p in msg["pieces"]]
        return all((a is None) == (b is None) and (a is None or torch.equal(a, b))
                   for a, b in zip(mine, theirs))

    def start_load_kv(self, meta: P2pMeta | None) -> None:
        if meta is None:
            return
        with self.lock:
            for req_id, (blocks, deadline) in meta.new_holds.items():
                self.held[req_id] = Held(blocks, deadline)
            self.hold_added.notify_all()
        for spec in meta.loads:  # the blocks the pull does not fill whole (new blocks are zeros)
            self._zero_blocks(spec.block_ids[spec.end // self.layout.tokens_per_block:])
            # on the step's stream: the pull's writes come after
            zeroed = torch.cuda.current_stream().record_event() if self.device.type == "cuda" else None
            threading.Thread(target=self._load, args=(spec, zeroed), daemon=True).start()

    def wait_for_save(self) -> None:
        pass  # a producer's blocks are read on demand, while the scheduler holds them

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        with self.lock:
            recving = set(self.done)
            self.done.clear()
            sending = {r for r, h in self.held.items() if h.readers == 0 and self._let_go(r, h)}
            for r in sending:
                del self.held[r]
            if len(self.let_go) > 100_000:  # a pull that late waits out its timeout instead
                self.let_go.clear()
            self.let_go.update(sending)
        return sending, recving

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self.lock:
            blocks, self.failed_blocks = self.failed_blocks, set()
        return blocks

    def close(self) -> None:
        self.stopping.set()
        if self.server is not None:
            with contextlib.suppress(Exception):  # the store is gone: the thread has ended
                post_pull(self.store, self.kvt.engine_id, self.rank, {"stop": True})
            self.server.join(timeout=self.kvt.kv_transfer_timeout_s + 5)
        self.groups.close()

    def _let_go(self, req_id: str, h: Held) -> bool:
        if time.time() >= h.deadline:
            return True
        try:
            return self.store.check([release_key(self.kvt.engine_id, req_id)])
        except Exception:  # noqa: BLE001 - our own store is gone: the engine is shutting down
            return True

    @contextlib.contextmanager
    def _side_stream(self):
        """This thread's CUDA work (NCCL calls, packing, unpacking) on a stream of its own (None on
        CPU): on the steps' stream a pull queued behind a whole step, and the steps behind it."""
        if self.device.type != "cuda":
            yield None
            return
        torch.cuda.set_device(self.device)  # this thread's allocations and NCCL calls
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(stream):
            yield stream

    def _serve_loop(self, queue_store, store) -> None:
        with self._side_stream():
            while not self.stopping.is_set():
                try:
                    msg = next_message(queue_store, self.kvt.engine_id, self.rank)
                except Exception:  # noqa: BLE001 - the store is gone: the engine is shutting down
                    return
                if msg.get("stop"):
                    return
                try:
                    if msg.get("connect"):  # a consumer builds the pair's group at its start
                        store.set(msg["reply"], str(HELD))
                        self.groups.get(store, msg["pair"], 0)
                    else:
                        self._serve(msg, store)
                except Exception as e:  # noqa: BLE001 - the consumer side failed: it recomputes
                    log.warning("serving a KV pull of request %s failed: %s", msg.get("req_id"), e)
                    self.groups.drop(msg["pair"])

    def _take_reader(self, req_id: str) -> Held | None:
        """The held request, counted as read; a pull may come before the step plan that
        announces the hold reaches this rank, so wait for it (not for one already let go)."""
        deadline = time.monotonic() + self.kvt.kv_transfer_timeout_s
        with self.hold_added:
            while True:
                h = self.held.get(req_id)
                if h is not None and time.time() < h.deadline:
                    h.readers += 1
                    return h
                if h is not None or req_id in self.let_go or time.monotonic() > deadline:
                    return None
                self.hold_added.wait(min(0.05, max(0.0, deadline - time.monotonic())))

    def _serve(self, msg: dict, store) -> None:
        """The status word under the consumer's reply key, then the payloads (tags 0, 1, ...) over
        the pair's group. Neither side posts an op of the pair before the status is out (an early
        receive deadlocked: docs/architecture.md, 'KV transfer'). The blocks are read only while
        packing; no send outlasts the lease."""
        same_scales = self._same_scales(msg)
        h = self._take_reader(msg["req_id"]) if same_scales else None
        word = HELD if h is not None else GONE if same_scales else SCALES_DIFFER
        try:
            store.set(msg["reply"], str(word))
            if h is None:
                return
            group = self.groups.get(store, msg["pair"], 0)
            rng = PieceRange(msg["start"], msg["end"], tuple(h.block_ids), ())
            receiver = KVLayout(**msg["receiver"])
            self.groups.send_all(group, self._payloads(msg, rng, receiver), h.deadline)
        finally:
            if h is not None:
                with self.lock:
                    h.readers -= 1
                self.progress.set()

    def _payloads(self, msg: dict, rng: PieceRange, receiver: KVLayout):
        parts = _payload_parts(msg["pieces"], self.layout, receiver, rng, len(self.caches),
                               msg["layers_per_chunk"])
        for i, (piece, layers) in enumerate(parts):
            yield pack_piece(self.caches[layers], piece, self.layout, receiver, rng)
            if i == 0:
                _test_fault("die", "drop", groups=self.groups, pair=msg["pair"])

    def _zero_blocks(self, block_ids: list[int]) -> None:  # all-zero bits = 0.0
        if not block_ids:
            return
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for c in self.caches:
            c.view(2, -1, self.layout.block_size, *c.shape[-2:]).index_fill_(1, idx, 0)

    def _load(self, spec: LoadSpec, zeroed) -> None:
        t0, times, ok = time.perf_counter(), defaultdict(float), False
        with self._side_stream() as stream:
            if zeroed is not None:
                stream.wait_event(zeroed)
            try:
                self._pull_all(spec, times)
                ok = True
            except Exception as e:  # noqa: BLE001 - any failure: the request is recomputed
                log.warning("loading the KV of request %s failed: %s", spec.req_id, e)
            if stream is not None:
                stream.synchronize()
        with self.lock:
            self.timings[spec.req_id] = dict(times, start=t0, end=time.perf_counter(), ok=ok)
            if len(self.timings) > 1000:
                self.timings.pop(next(iter(self.timings)))
            self.done[spec.req_id] = ok
            if not ok:
                self.failed_blocks.update(spec.block_ids[spec.start // self.layout.tokens_per_block:])
        self.progress.set()

    def _connect_all(self, addrs: list[str]) -> None:
        """kv_connect: build (and warm) the pair groups with each producer's ranks this rank
        pulls from, before any request; a pull of the pair waits for it (the pair's lock)."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        for addr in addrs:
            host, _, port = addr.rpartition(":")
            try:
                store = self._store_at(host, int(port))
                info = json.loads(store.get("engine_info"))
                remote = KVLayout(**info["layout"])
                ranks = {p.remote_rank for p in plan_kv_pieces(self.layout, remote, self.rank)}
                for remote_rank in sorted(ranks):
                    with self._pair(info["engine_id"], remote_rank) as pair:
                        reply = reply_key(pair)
                        post_pull(store, info["engine_id"], remote_rank, {"connect": True, "pair": pair,
                                                                         "reply": reply})
                        take_reply(store, reply)
                        self.groups.get(store, pair, 1)
            except Exception as e:  # noqa: BLE001 - the first pull builds them instead
                log.warning("could not connect to the producer at %s: %s", addr, e)

    @contextlib.contextmanager
    def _pair(self, engine_id: str, remote_rank: int):
        """The pair's group name, held (a pair's tags carry one pull at a time); a failure
        drops its group, and the next use starts afresh under a new epoch."""
        pair_id = f"{engine_id}/{remote_rank}/{self.kvt.engine_id}/{self.rank}"
        with self.pair_locks.setdefault(pair_id, threading.Lock()):
            pair = f"{pair_id}/{self.epochs[pair_id]}"
            try:
                yield pair
            except Exception:
                self.groups.drop(pair)
                self.epochs[pair_id] += 1
                raise

    def _store_at(self, host: str, port: int):
        if (host, port) not in self.stores:
            self.stores[(host, port)] = connect_store(host, port, timeout_s=self.kvt.kv_transfer_timeout_s)
        return self.stores[(host, port)]

    def _pull_all(self, spec: LoadSpec, times: dict) -> None:
        p = spec.params
        remote = KVLayout(**p["remote_layout"])
        store = self._store_at(p["remote_host"], int(p["remote_port"]))
        by_rank = defaultdict(list)
        for piece in plan_kv_pieces(self.layout, remote, self.rank):
            by_rank[piece.remote_rank].append(piece)
        rng = PieceRange(spec.start, spec.end, tuple(p["remote_block_ids"]), tuple(spec.block_ids))
        for remote_rank, mine in sorted(by_rank.items()):
            with self._pair(p["remote_engine_id"], remote_rank) as pair:
                held = self._pull(store, p, remote_rank, pair, mine, remote, rng, times)
            if not held:
                raise RuntimeError("gone: the producer no longer holds the request's KV")

    def _pull(self, store, p: dict, remote_rank: int, pair: str, pieces: list, remote: KVLayout,
              rng: PieceRange, times: dict) -> bool:
        """Whether the producer still held the request (then its pieces are in place); adds to `times`
        the seconds in group set-up, control (post, status) and payloads."""
        chunk = max(1, len(self.caches) // 4)
        t0, reply = time.perf_counter(), reply_key(pair)
        post_pull(store, p["remote_engine_id"], remote_rank, dict(
            req_id=p["remote_request_id"], pair=pair, reply=reply, pieces=pieces, start=rng.start,
            end=rng.end, receiver=asdict(self.layout), layers_per_chunk=chunk,
            kv_scales=[self._piece_scales(q.local_head, q.num_heads) for q in pieces]))
        t1 = time.perf_counter()
        status = take_reply(store, reply)  # (the store's wait: kv_transfer_timeout_s)
        t2 = time.perf_counter()
        if status == SCALES_DIFFER:
            raise RuntimeError("refused: the producer's FP8 KV cache scales differ from this "
                               "instance's (not the same weights?)")
        group = self.groups.get(store, pair, 1) if status == HELD else None
        t3 = time.perf_counter()
        if group is not None:
            self._recv_pieces(group, pieces, remote, rng, chunk)
        times["post_s"] += t1 - t0  # the pull message's store round trip
        times["status_s"] += t2 - t1  # the producer taking it up and its status word
        times["setup_s"] += t3 - t2
        times["pull_s"] += time.perf_counter() - t3
        return status == HELD

    def _recv_pieces(self, group, pieces: list, remote: KVLayout, rng: PieceRange, chunk: int) -> None:
        row = self.caches[0].shape[-1]  # one head's row of one token, in words
        parts = _payload_parts(pieces, remote, self.layout, rng, len(self.caches), chunk)

        def buffer(piece, layers):
            shape = payload_shape(piece, remote, self.layout, rng, layers.stop - layers.start, row)
            return lambda: torch.empty(shape, dtype=self.caches[0].dtype, device=self.device)

        def consume(i, buf):
            piece, layers = parts[i]
            unpack_piece(self.caches[layers], piece, remote, self.layout, rng, buf)
            _test_fault("consumer_die")

        _test_fault("consumer_stall")
        # (the last unpack may still run on this thread's stream: _load waits for it)
        self.groups.recv_all(group, [buffer(*part) for part in parts], consume)


def as_words(cache: torch.Tensor) -> torch.Tensor:
    """The cache's bytes as the widest integers that tile a head's row: any dtype packs, lands and
    travels alike (float8 has no gloo type), and the index kernels move 8 bytes an element, not 1."""
    raw = cache.view(torch.uint8)
    size = next(n for n in (8, 4, 2, 1) if raw.data_ptr() % n == 0
                and all(d % n == 0 for d in (raw.shape[-1], *raw.stride()[:-1])))
    return raw.view({8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}[size])


def _test_fault(*here: str, groups: PairGroups | None = None, pair: str = "") -> None:
    """Test hook (LONGSERVE_TEST_KV_FAULT) at points of a pull: after the producer's first payload
    "die" (its process ends) or "drop" (it closes the pair's connection); after the consumer's first
    "consumer_die"; before the consumer takes any, "consumer_stall" (4 s: past the tests' lease)."""
    fault = os.environ.get("LONGSERVE_TEST_KV_FAULT")
    if fault not in here:
        return
    if fault.endswith("die"):
        os._exit(9)
    if fault == "consumer_stall":
        time.sleep(4.0)
        return
    groups.drop(pair)
    raise ConnectionError("test: the pair's connection was dropped")


def _payload_parts(pieces, sender: KVLayout, receiver: KVLayout, rng, num_layers: int, per_chunk: int):
    """The (piece, layer slice) of each payload, in the order both sides use; a piece with no
    positions in the range moves nothing (both sides skip it)."""
    chunks = [slice(i, min(i + per_chunk, num_layers)) for i in range(0, num_layers, per_chunk)]
    return [(p, c) for p in pieces if 0 not in payload_shape(p, sender, receiver, rng, 1, 1) for c in chunks]
