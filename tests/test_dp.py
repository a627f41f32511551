"""Data parallelism (one engine-core process per DP rank): dp=2 gives one rank's tokens (dense
and expert models, with expert parallelism, with TP, with dual-batch overlap); an idle DP rank
does not hang the other; the balancer spreads and pins; a dead core of lockstep (expert) DP
fails every request; every DP rank's KV pool is whole afterwards."""
import os
import signal
import time

import numpy as np
import pytest
import torch

from conftest import assert_pool_whole
from hf_models import VOCAB, make_hf_model
from longserve import LLM, SamplingParams
from longserve.models.moe import DISPATCH_ENV

LENGTHS = (5, 17, 33, 40, 9, 3)
DBO_SMALL = dict(enable_dbo=True, dbo_decode_token_threshold=2, dbo_prefill_token_threshold=2)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    paths = {}
    for arch in ("qwen3", "qwen3_moe", "mixtral"):
        paths[arch] = str(tmp_path_factory.mktemp(arch))
        make_hf_model(arch, paths[arch])
    return paths


def prompts(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": torch.randint(3, VOCAB, (n,), generator=g).tolist()}
            for n in LENGTHS]


def run(path, max_tokens=5, generate_kw=None, repeat=1, **kw):
    llm = LLM(path, device="cpu", distributed_timeout_s=60, **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=VOCAB, ignore_eos=True)
        outs = llm.generate(prompts() * repeat, params, use_tqdm=False, **(generate_kw or {}))
        assert_pool_whole(llm)
        return outs, llm.engine.core_stats()["num_dbo_steps"]
    finally:
        llm.shutdown()


def assert_same(outs, ref):
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            ours = torch.tensor([a[k] for k in range(VOCAB)])
            assert torch.allclose(ours, torch.tensor([b[k] for k in range(VOCAB)]), atol=1e-4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch,layout,dispatch", [
    ("qwen3", dict(data_parallel_size=2), None),
    ("mixtral", dict(tensor_parallel_size=2), None),  # experts split by width over TP
    ("qwen3_moe", dict(data_parallel_size=2), None),  # experts split by width over the 2 DP ranks
    ("qwen3_moe", dict(data_parallel_size=2, enable_expert_parallel=True), None),
    ("qwen3_moe", dict(data_parallel_size=2, enable_expert_parallel=True), "all_to_all"),
    ("mixtral", dict(data_parallel_size=2, enable_expert_parallel=True, **DBO_SMALL), None),
    ("mixtral", dict(data_parallel_size=2, enable_expert_parallel=True, **DBO_SMALL), "all_to_all"),
], ids=["dense", "mixtral-tp2", "moe-tp-experts", "moe-ep", "moe-ep-a2a", "mixtral-ep-dbo", "mixtral-ep-dbo-a2a"])
def test_dp2_matches_one_rank(models, arch, layout, dispatch, monkeypatch):
    ref, _ = run(models[arch])
    if dispatch:  # the engine cores' expert layers read it (models/moe.py)
        monkeypatch.setenv(DISPATCH_ENV, dispatch)
    outs, dbo_steps = run(models[arch], **layout)
    assert_same(outs, ref)
    if layout.get("enable_dbo"):
        assert dbo_steps > 0


@pytest.mark.timeout(180)
def test_dp2_tp2_expert_parallel_matches_one_rank(models, monkeypatch):
    """With the all-to-all dispatch: each TP rank sends its peers only its TP position's experts."""
    ref, _ = run(models["qwen3_moe"], max_tokens=3)
    monkeypatch.setenv(DISPATCH_ENV, "all_to_all")
    outs, _ = run(models["qwen3_moe"], max_tokens=3, data_parallel_size=2, tensor_parallel_size=2,
                  enable_expert_parallel=True)
    assert_same(outs, ref)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", [dict(data_parallel_size=4, enable_expert_parallel=True),
                                    dict(data_parallel_size=2, tensor_parallel_size=2, enable_expert_parallel=True)],
                         ids=["dp4-ep", "dp2-tp2-ep"])
def test_four_rank_expert_layouts_with_dbo_match_one_rank(models, layout):
    """Issue 43's four-GPU expert layouts, dual-batch overlap on: one rank's tokens and logprobs
    (every core gets two requests at least: a step splits only where every DP rank can)."""
    ref, _ = run(models["qwen3_moe"], max_tokens=3, repeat=2)
    outs, dbo_steps = run(models["qwen3_moe"], max_tokens=3, repeat=2, **layout, **DBO_SMALL)
    assert_same(outs, ref)
    assert dbo_steps > 0


@pytest.mark.timeout(60)
def test_dbo_on_one_rank_gives_the_same_tokens(models):
    ref, none = run(models["qwen3_moe"])
    outs, dbo_steps = run(models["qwen3_moe"], tensor_parallel_size=1, **DBO_SMALL)
    assert none == 0 and dbo_steps > 0
    assert_same(outs, ref)


@pytest.mark.timeout(120)
def test_idle_dp_rank_does_not_hang(models):
    """Every request pinned to DP rank 1: rank 0 (the driver) only runs dummy steps."""
    ref, _ = run(models["mixtral"])
    outs, _ = run(models["mixtral"], data_parallel_size=2, enable_expert_parallel=True,
                  generate_kw=dict(data_parallel_rank=1))
    assert_same(outs, ref)


@pytest.mark.timeout(90)
def test_balancer_spreads_and_pins(models):
    llm = LLM(models["qwen3"], device="cpu", data_parallel_size=2)
    try:
        computed = lambda: [llm.engine.call("stats", core=d)["num_prompt_tokens_computed"]  # noqa: E731
                            for d in range(2)]
        llm.generate(prompts(), SamplingParams(max_tokens=2), use_tqdm=False)
        spread = computed()
        # one burst from one front end: three requests each, whenever the cores reported
        assert [s.num_added for s in llm.engine.coordinator.stats] == [(3,), (3,)]
        llm.generate(prompts(seed=4), SamplingParams(max_tokens=2), use_tqdm=False,  # no prefix hit
                     data_parallel_rank=1)
        pinned = computed()
        assert pinned[0] == spread[0] and pinned[1] == spread[1] + sum(LENGTHS)
        with pytest.raises(ValueError, match="data_parallel_rank must be an integer in \\[0, 2\\)"):
            llm.generate(prompts()[:1], data_parallel_rank=2)
        assert_pool_whole(llm)
    finally:
        llm.shutdown()


@pytest.mark.timeout(90)
def test_killed_core_of_expert_dp_fails_every_request(models):
    """Expert models' cores step together: one killed, every request fails within seconds and
    the engine refuses more; shutdown leaves no process behind."""
    llm = LLM(models["qwen3_moe"], device="cpu", data_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout_s=30)
    cores = list(llm.engine.client.procs.values())
    os.kill(cores[1].pid, signal.SIGKILL)
    start = time.monotonic()
    # whichever is seen first: core 1's death, or core 0 failing as its peer went away
    dead = r"engine core (1 died|0 failed)"
    with pytest.raises(RuntimeError, match=dead):
        llm.generate(prompts(), SamplingParams(max_tokens=20), use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match=dead):
        llm.generate(prompts(), SamplingParams(max_tokens=20), use_tqdm=False)
    llm.shutdown()
    assert all(p.poll() is not None for p in cores)


@pytest.mark.parametrize("kwargs,match", [
    (dict(model="builtin:qwen3-tiny", enable_dbo=True), "enable_dbo.*no expert layers"),
    (dict(model="builtin:qwen3-moe-tiny", enable_dbo=True, prefill_context_parallel_size=2),
     "enable_dbo.*prefill_context_parallel_size"),
    (dict(model="builtin:qwen3-moe-tiny", data_parallel_size=3, enable_expert_parallel=True),
     "3 must divide the 8 experts"),
    (dict(model="builtin:qwen3-moe-tiny", data_parallel_size=3), "must divide the expert width 32"),
    (dict(model="builtin:qwen3-moe-tiny", enable_dbo=True, dbo_decode_token_threshold=1),
     "dbo_decode_token_threshold must be an integer >= 2"),
])
def test_bad_layouts_fail_at_start(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(device="cpu", **kwargs)


# ---- rules that hold for every input ---------------------------------------------------

from hypothesis import given, strategies as st  # noqa: E402

from longserve.engine.dp_coordinator import DPCoordinator  # noqa: E402
from longserve.engine.messages import SchedulerStats  # noqa: E402
from longserve.worker.dp_step import balanced_split  # noqa: E402


@given(st.lists(st.integers(1, 600), min_size=2, max_size=40))
def test_balanced_split_minimises_the_larger_micro_batch(tokens):
    import numpy as np
    k = balanced_split(np.array(tokens))
    assert 1 <= k < len(tokens)
    larger = lambda j: max(sum(tokens[:j]), sum(tokens[j:]))  # noqa: E731
    assert larger(k) == min(larger(j) for j in range(1, len(tokens)))


@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 2)), st.integers(0, 3), st.integers(0, 4)),
                min_size=1, max_size=30),
       st.sets(st.integers(0, 2), max_size=2))
def test_balancer_picks_the_live_core_with_fewest_requests_or_the_pinned_one(events, dead):
    """Each request goes to its pinned core, else to the live core with the fewest requests:
    running and waiting as it last reported, plus ours it had not taken by then, counted once
    for each of the 2 front ends (the other's are unknown); ties to the first counting from
    this front end's index (1)."""
    coord = DPCoordinator(3, lockstep=False, front_end=1, num_front_ends=2)
    coord.dead |= dead
    sent, reported = [0, 0, 0], [(0, 0)] * 3  # ours sent; (requests there, ours taken) reported
    for pin, report, lag in events:
        if report:  # core `report - 1` reports, having taken all but `lag` of ours (others' too)
            core = report - 1
            taken = max(0, sent[core] - lag)
            running = taken // 2 + 1  # one of another front end's
            coord.on_stats(core, SchedulerStats(num_running=running, num_waiting=taken - taken // 2,
                                                num_added=(5, taken)))
            reported[core] = (taken + 1, taken)
        load = [n + 2 * (sent[i] - taken) for i, (n, taken) in enumerate(reported)]
        chosen = coord.choose(pin)
        live = [i for i in range(3) if i not in dead]
        assert chosen == (pin if pin is not None else min(live, key=lambda i: (load[i], (i - 1) % 3)))
        coord.on_send(chosen)
        sent[chosen] += 1


@pytest.mark.parametrize("seed", range(20))
def test_a_burst_through_two_api_servers_splits_evenly_over_stale_reports(seed):
    """256 requests reach two front ends (2:1) over ~200 ms; two cores take them between
    15 ms prefill steps (8 admitted a step) and report after each. Every core ends with
    128 +- 1: counts from the reports plus what is on its way, not 4 x waiting + running."""
    import heapq
    import itertools
    import random
    rnd, order = random.Random(seed), itertools.count()  # order: a tie-break for the heap
    fronts = [DPCoordinator(2, lockstep=False, front_end=k, num_front_ends=2) for k in range(2)]
    cores = [dict(queue=[], waiting=0, running=0, added=[0, 0]) for _ in range(2)]
    events = []
    at = lambda t, kind, x: heapq.heappush(events, (t, next(order), kind, x))  # noqa: E731
    for i in range(256):
        at(i * 0.75 + rnd.uniform(0, 0.5), "send", 0 if i % 3 else 1)
    for c in range(2):
        at(rnd.uniform(0, 10), "step", c)
    while events:
        t, _, kind, x = heapq.heappop(events)
        if kind == "send":
            core = fronts[x].choose(None)
            fronts[x].on_send(core)
            at(t + 0.2, "arrive", (core, x))
        elif kind == "arrive":
            cores[x[0]]["queue"].append(x[1])
        elif kind == "step":
            c = cores[x]
            for k in c["queue"]:
                c["waiting"], c["added"][k] = c["waiting"] + 1, c["added"][k] + 1
            admitted = min(8, c["waiting"])
            c.update(queue=[], waiting=c["waiting"] - admitted, running=c["running"] + admitted)
            stats = SchedulerStats(c["running"], c["waiting"], num_added=tuple(c["added"]))
            took = 15 * rnd.uniform(0.8, 1.2)
            for front in fronts:  # reports land 0.2 ms after the step
                at(t + took + 0.2, "report", (front, x, stats))
            if t < 600:
                at(t + took, "step", x)
        else:
            x[0].on_stats(x[1], x[2])
    assert [c["running"] for c in cores] in ([128, 128], [127, 129], [129, 127])


def test_waves_start_once_and_follow_the_cores():
    coord = DPCoordinator(2, lockstep=True)
    assert coord.on_send(0) == 0 and coord.on_send(1) is None  # one announcement per wave
    assert coord.on_wave_started(0) is None  # the wave we announced
    coord.on_wave_finished(0)
    assert (coord.wave, coord.wave_running) == (1, False)
    assert coord.on_wave_started(1) == 1  # a core began wave 1 before we sent anything
    assert coord.on_send(1) is None
    coord.on_wave_finished(0)  # stale
    assert (coord.wave, coord.wave_running) == (1, True)
    assert coord.on_wave_started(3) == 3 and coord.wave == 3  # it ran ahead of our news


def test_coordinated_steps_replay_the_graph_that_holds_them():
    """One DP rank (nothing exchanged): a decode step replays the smallest graph that holds it,
    an idle rank's dummy step replays one with no real row, others run eagerly."""
    from types import SimpleNamespace

    from longserve.config import ParallelConfig
    from longserve.worker.cuda_graphs import DecodeGraphs
    from longserve.worker.dp_step import run_coordinated

    class Graphs(DecodeGraphs):
        def __init__(self):
            self.graphs = {1: None, 8: None}

        def replay(self, inp, bs):
            Runner.calls.append(("graph", inp is None, bs))

    class Runner:
        config = SimpleNamespace(parallel=ParallelConfig())
        ps = SimpleNamespace(dp=None, layout=SimpleNamespace(dp_rank=0))
        graphs, calls = Graphs(), []

        def model(self, ids, positions, meta, sp, dp_pad):
            self.calls.append(("eager", dp_pad))

    def step(n, decode, dummy=False):
        inp = SimpleNamespace(num_local_tokens=n, is_pure_decode=decode, input_ids=None,
                              positions=None, meta=None)
        run_coordinated(runner, SimpleNamespace(n=np.array([n])), [[0]], inp, dummy)
        return runner.calls.pop()

    runner = Runner()
    assert step(3, True) == ("graph", False, 8)
    assert step(1, False, dummy=True) == ("graph", True, 1)
    assert step(3, False) == ("eager", 3)  # a prefill
    assert step(9, True) == ("eager", 9)  # no graph that large


def test_lockstep_cores_ask_whether_the_wave_is_over_every_32_steps_only():
    """The wave's end check (an all-reduce over the DP cores) runs every WAVE_CHECK_EVERY-th
    lockstep iteration, counted from the wave's start; a wave ends at the first check that finds
    no work anywhere, and the next wave counts afresh."""
    import queue
    from types import SimpleNamespace
    from longserve.engine.core_proc import WAVE_CHECK_EVERY, EngineCoreProc
    from longserve.engine.messages import EngineCoreOutputs
    checks, work = [], [True]

    class Core(SimpleNamespace):
        def dp_any_unfinished(self):
            checks.append(proc.wave_steps)
            return work[0]

        def drain(self):
            return EngineCoreOutputs(1)

    emitted = []
    proc = EngineCoreProc(Core(engine_index=1, config=SimpleNamespace(dp_lockstep=True)),
                          queue.Queue(), emitted.append)
    proc.wave_running = True
    for _ in range(2 * WAVE_CHECK_EVERY):
        proc._end_of_wave_check()
    assert checks == [WAVE_CHECK_EVERY, 2 * WAVE_CHECK_EVERY] and proc.wave_running
    work[0] = False
    steps = 0
    while proc.wave_running:
        proc._end_of_wave_check()
        steps += 1
    assert steps == WAVE_CHECK_EVERY and (proc.wave, proc.wave_steps) == (1, 0)
    assert emitted == []  # (core 0 announces the end)
