"""The scheduler is live and its block accounting exact, for any workload.

A hypothesis state machine drives Scheduler + KVCacheManager directly with fake workers
(which sample a fixed token and keep a fake KV cache: each slot holds the token written to
it). Rules: arrivals (with shared prompt prefixes, and sometimes past the door rule),
steps, aborts; pool size, block size, budget, max_num_seqs, chunked prefill, the long-prefill
cap and prefix caching are drawn per run. After every rule: no leak, no double free, reference counts
equal the requests' block lists, free queue and cached map consistent, the workers' block
lists equal the scheduler's, and every prefix-cache hit holds the request's tokens. At the
end, with arrivals stopped, everything finishes within a bound on the steps.

Asynchronous scheduling is drawn per run too: step N+1 is planned (and run by the fake
workers, which fill each PLACEHOLDER with the token they sampled for it last step) before
step N's results are applied.
"""
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from longserve.config import SchedulerConfig
from longserve.engine_args import EngineArgs
from longserve.engine.kv_cache_manager import KVCacheManager
from longserve.engine.request import Request, RequestStatus
from longserve.engine.scheduler import Scheduler
from longserve.sampling_params import SamplingParams
from longserve.step_plan import PLACEHOLDER

FIXED_TOKEN = 7
PREFIXES = [[1, 2, 3, 4, 5, 6, 8, 9], [11, 12, 13, 14, 15, 16], [21, 22, 23]]


class FakeWorkers:
    """What the workers see: block lists from the step plans, and a KV cache of tokens."""

    def __init__(self, tokens_per_block: int):
        self.tpb = tokens_per_block
        self.blocks: dict[str, list[int]] = {}
        self.slots: dict[tuple[int, int], int] = {}
        self.last_sampled: set[str] = set()

    def fill(self, sr) -> list[int]:
        """A placeholder is the token this fake sampled for the request in the last step."""
        if PLACEHOLDER in sr.token_ids:
            assert sr.req_id in self.last_sampled and sr.token_ids[-1] == PLACEHOLDER
            assert sr.token_ids.count(PLACEHOLDER) == 1
        return [FIXED_TOKEN if t == PLACEHOLDER else t for t in sr.token_ids]

    def execute(self, out, requests: dict[str, Request]) -> dict[str, int]:
        for rid in out.finished_req_ids:
            self.blocks.pop(rid, None)
        for b in out.new_block_ids:  # zeroed before use
            for off in range(self.tpb):
                self.slots.pop((b, off), None)
        sampled = {}
        for sr in out.all_requests():
            if sr.new:
                assert sr.req_id not in self.blocks and sr.sampling_params is not None
                self.blocks[sr.req_id] = list(sr.block_ids)
            else:
                self.blocks[sr.req_id].extend(sr.block_ids)
            req, blocks, start = requests[sr.req_id], self.blocks[sr.req_id], sr.num_computed_tokens
            tokens, ids = req.prompt_token_ids + req.output_token_ids, self.fill(sr)
            known = tokens[start:start + len(ids)]
            assert ids[:len(known)] == known and len(ids) - len(known) <= 1
            for pos in range(min(start, len(tokens))):  # the computed prefix (prefix hits
                # included) is in the cache
                assert self.slots.get((blocks[pos // self.tpb], pos % self.tpb)) == tokens[pos]
            for j, tok in enumerate(ids):
                pos = start + j
                self.slots[(blocks[pos // self.tpb], pos % self.tpb)] = tok
            if sr.sample:
                sampled[sr.req_id] = FIXED_TOKEN
        self.last_sampled = set(sampled)
        return sampled


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 24), tpb=st.sampled_from([1, 2, 4]),
                max_num_seqs=st.integers(1, 6), budget=st.integers(1, 48),
                max_model_len=st.integers(6, 40), chunked=st.booleans(), caching=st.booleans(),
                asynchronous=st.booleans(), cap=st.sampled_from([0, 1, 3, 8]))
    def setup(self, num_blocks, tpb, max_num_seqs, budget, max_model_len, chunked, caching,
              asynchronous, cap):
        if not chunked:
            budget = max(budget, max_model_len)
        self.kv = KVCacheManager(num_blocks, tpb, caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, chunked,
                                               long_prefill_token_threshold=cap), self.kv)
        self.workers = FakeWorkers(tpb)
        self.all: dict[str, Request] = {}  # every request ever queued
        self.bypassed: set[str] = set()  # queued without the door rule
        self.n = 0
        self.asynchronous, self.in_flight = asynchronous, None

    @rule(prefix=st.integers(0, len(PREFIXES)), suffix=st.lists(st.integers(30, 60), max_size=12),
          max_tokens=st.one_of(st.none(), st.integers(1, 30)), bypass_door=st.booleans())
    def arrive(self, prefix, suffix, max_tokens, bypass_door):
        prompt = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix
        if not prompt or len(prompt) >= self.sched.config.max_model_len:
            return  # the engine refuses these before the scheduler sees them
        try:
            self.sched.check_fits(len(prompt), max_tokens)
        except ValueError as e:
            assert "KV blocks" in e.args[0]
            if not bypass_door:
                return
            self.bypassed.add(str(self.n))
        req = Request(str(self.n), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        self.n += 1
        self.all[req.request_id] = req
        self.sched.add_request(req)

    @rule()
    def step(self):
        out = self.sched.schedule()
        live = {rid: r for rid, r in self.all.items() if rid in self.sched.requests}
        sampled = self.workers.execute(out, live)
        if self.asynchronous:  # step N+1 is planned and run before N's results are applied
            previous, self.in_flight = self.in_flight, (out, sampled)
            if previous is not None:
                self.sched.update_from_output(*previous)
        else:
            self.sched.update_from_output(out, sampled)
        for sr in out.all_requests():  # what the workers hold equals the scheduler's block lists
            req = self.sched.requests.get(sr.req_id)
            if req is not None and req.status == RequestStatus.RUNNING:
                assert self.workers.blocks[sr.req_id] == req.block_ids

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        self.sched.finish_request(rid, "abort")
        assert self.all[rid].finish_reason == "abort" and not self.all[rid].block_ids

    @invariant()
    def pool_consistent(self):
        kv = self.kv
        live = list(self.sched.running) + list(self.sched.waiting)
        parked = [c for r in live for c in r.children if not c.is_finished]  # choices to fork
        assert len(live) + len(parked) == len(self.sched.requests) == len(set(map(id, live + parked)))
        refs = Counter(b for r in live for b in r.block_ids)
        for r in live:
            assert len(set(r.block_ids)) == len(r.block_ids)  # a block once per request
        assert all(kv.ref_cnt[b] == refs.get(b, 0) for b in range(kv.num_blocks))
        assert set(kv.free_queue) == {b for b in range(kv.num_blocks) if kv.ref_cnt[b] == 0}
        assert {(h, b) for h, b in kv.cached.items()} == \
            {(h, b) for b, h in enumerate(kv.block_hash) if h is not None}
        assert len(self.sched.running) <= self.sched.config.max_num_seqs
        for r in self.sched.waiting:
            assert not r.block_ids and r.status != RequestStatus.RUNNING
        for r in self.sched.running:
            assert len(r.block_ids) == kv.blocks_needed(r.num_computed_tokens)

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # with arrivals stopped, the oldest running request gains a token every step
        bound = sum(r.num_tokens + (r.sampling_params.max_tokens or self.sched.config.max_model_len)
                    for r in self.sched.requests.values()) + 2
        steps = 0
        while self.sched.has_unfinished() or self.in_flight is not None:
            if not self.sched.has_unfinished():
                self.sched.update_from_output(*self.in_flight)
                self.in_flight = None
                continue
            self.step()
            self.pool_consistent()
            steps += 1
            assert steps <= bound, "no progress"
        self.sched.schedule()  # flush the last finished ids to the workers
        assert self.kv.num_free_blocks == self.kv.num_blocks
        for rid, r in self.all.items():
            assert r.is_finished
            if r.finish_reason == "abort":
                continue
            max_len = self.sched.config.max_model_len
            want = min(r.sampling_params.max_tokens or max_len, max_len - r.num_prompt_tokens)
            if rid in self.bypassed:  # outgrew the pool: finished early, never looped
                assert r.finish_reason == "length" and len(r.output_token_ids) <= want
            else:
                assert r.finish_reason == "length" and len(r.output_token_ids) == want


TestSchedulerLiveness = SchedulerMachine.TestCase
TestSchedulerLiveness.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])


def test_long_prefill_cap_lets_the_prompts_behind_start():
    """A long prompt takes at most the cap of a step; a short one behind it starts in the same
    step (without the cap it waits for the long prefill's every chunk)."""
    for cap, short_starts in ((0, 3), (8, 1)):
        kv = KVCacheManager(64, 4)
        sched = Scheduler(SchedulerConfig(4, 16, 64, long_prefill_token_threshold=cap), kv)
        long, short = (Request(r, list(range(1, n + 1)), SamplingParams(max_tokens=2, ignore_eos=True))
                       for r, n in (("long", 40), ("short", 5)))
        sched.add_request(long)
        sched.add_request(short)
        workers, first = FakeWorkers(4), None
        for step in range(1, 8):
            out = sched.schedule()
            chunks = {sr.req_id: len(sr.token_ids) for sr in out.all_requests()}
            assert chunks.get("long", 0) <= (cap or 16)
            first = first or (step if "short" in chunks else None)
            sched.update_from_output(out, workers.execute(out, {"long": long, "short": short}))
        assert first == short_starts


def test_request_that_outgrows_the_pool_is_refused_at_the_door():
    kv = KVCacheManager(4, 2)
    sched = Scheduler(SchedulerConfig(4, 16, 64), kv)
    sched.check_fits(3, 6)  # 3 + 6 - 1 = 8 tokens = 4 blocks: fits
    with pytest.raises(ValueError, match="needs 5 KV blocks .*the cache has 4"):
        sched.check_fits(3, 7)
    with pytest.raises(ValueError, match="needs 32 KV blocks"):
        sched.check_fits(3, None)  # up to max_model_len


def test_request_alone_that_outgrows_the_pool_finishes_by_length():
    """Past the door rule (the old bug): it used to be preempted and readmitted forever."""
    kv = KVCacheManager(3, 2)
    sched = Scheduler(SchedulerConfig(4, 16, 64), kv)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request(req)
    workers = FakeWorkers(2)
    for _ in range(10):
        out = sched.schedule()
        sched.update_from_output(out, workers.execute(out, {"a": req}))
    assert req.is_finished and req.finish_reason == "length"
    assert len(req.output_token_ids) == 4  # 3 + 4 - 1 = 6 tokens: 3 blocks, the whole pool
    assert kv.num_free_blocks == 3


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs=0), dict(max_num_seqs=-1),
                                    dict(max_num_batched_tokens=0), dict(max_model_len=1),
                                    dict(max_num_batched_tokens=8, enable_chunked_prefill=False)])
def test_limits_that_would_never_schedule_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs)) if "enable" not in str(kwargs) else "chunked"):
        EngineArgs("builtin:llama-tiny", device="cpu", **kwargs).create_engine_config()


@settings(max_examples=300, deadline=None)
@given(max_tokens=st.one_of(st.none(), st.integers(1, 20)), min_tokens=st.integers(0, 5),
       ignore_eos=st.booleans(), stop_ids=st.lists(st.integers(0, 9), max_size=3),
       eos=st.lists(st.integers(0, 9), max_size=2), prompt_len=st.integers(1, 6),
       max_model_len=st.integers(8, 40), tokens=st.lists(st.integers(0, 9), min_size=45, max_size=45))
def test_stop_filter_stops_where_the_full_check_does(max_tokens, min_tokens, ignore_eos, stop_ids,
                                                          eos, prompt_len, max_model_len, tokens):
    """Scheduler._take_token, which runs the full stop check only where a stop is possible (the
    stop set and length Scheduler.add_request gives a request), ends a request at the same token,
    for the same reason, as the full check after every token (a request without them)."""
    if max_tokens is not None and min_tokens > max_tokens:
        return  # refused at the door
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=stop_ids)
    ends = []
    for fast in (True, False):
        sched = Scheduler(SchedulerConfig(4, 64, max_model_len), KVCacheManager(64, 16))
        req = Request("r", list(range(100, 100 + prompt_len)), params, eos_token_ids=eos)
        sched.add_request(req)
        if not fast:
            req.stop_length = 0  # not set: every token takes the full check
        req.status, finished = RequestStatus.RUNNING, []
        for t in tokens:
            req.num_output_placeholders = 1
            sched._take_token(req, t, None, finished)
            if finished:
                break
        ends.append((list(req.output_token_ids), req.finish_reason, req.stop_reason, len(finished)))
    assert ends[0] == ends[1]
    assert ends[0][3] == 1  # (45 tokens pass max_model_len: every run ends)
