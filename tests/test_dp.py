"""Data parallelism: dp=2 gives one rank's tokens (dense and expert models, with expert
parallelism, with TP, with dual-batch overlap); an idle DP rank does not hang the other;
a dead DP worker fails the engine; every DP rank's KV pool is whole afterwards."""
import os
import signal
import time

import pytest
import torch

from hf_models import VOCAB, make_hf_model
from longserve import LLM, SamplingParams

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


def assert_pools_whole(llm):
    for kv in llm.engine.kv_managers:
        assert kv.num_free_blocks == kv.num_blocks and all(c == 0 for c in kv.ref_cnt)
    assert not llm.engine.scheduler.has_unfinished()


def run(path, max_tokens=5, generate_kw=None, **kw):
    llm = LLM(path, device="cpu", distributed_timeout_s=60, **kw)
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=VOCAB, ignore_eos=True)
        outs = llm.generate(prompts(), params, use_tqdm=False, **(generate_kw or {}))
        assert_pools_whole(llm)
        runner = llm.engine.executor.driver.runner
        return outs, runner.num_dbo_steps
    finally:
        llm.shutdown()


def assert_same(outs, ref):
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            ours = torch.tensor([a[k] for k in range(VOCAB)])
            assert torch.allclose(ours, torch.tensor([b[k] for k in range(VOCAB)]), atol=1e-4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("arch,layout", [
    ("qwen3", dict(data_parallel_size=2)),
    ("qwen3_moe", dict(data_parallel_size=2)),  # experts split by width over the 2 DP ranks
    ("qwen3_moe", dict(data_parallel_size=2, enable_expert_parallel=True)),
    ("mixtral", dict(data_parallel_size=2, enable_expert_parallel=True, **DBO_SMALL)),
], ids=["dense", "moe-tp-experts", "moe-ep", "mixtral-ep-dbo"])
def test_dp2_matches_one_rank(models, arch, layout):
    ref, _ = run(models[arch])
    outs, dbo_steps = run(models[arch], **layout)
    assert_same(outs, ref)
    if layout.get("enable_dbo"):
        assert dbo_steps > 0


@pytest.mark.timeout(180)
def test_dp2_tp2_expert_parallel_matches_one_rank(models):
    ref, _ = run(models["qwen3_moe"], max_tokens=3)
    outs, _ = run(models["qwen3_moe"], max_tokens=3, data_parallel_size=2, tensor_parallel_size=2,
                  enable_expert_parallel=True)
    assert_same(outs, ref)


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


@pytest.mark.timeout(60)
def test_balancer_spreads_and_pins(models):
    llm = LLM(models["qwen3"], device="cpu", data_parallel_size=2)
    try:
        sched = llm.engine.scheduler
        reqs = [llm.engine.make_request(p, SamplingParams(max_tokens=2)) for p in prompts()]
        for r in reqs:
            llm.engine.add_request(r)
        assert [len(s.waiting) for s in sched.schedulers] == [3, 3]
        with pytest.raises(ValueError, match="data_parallel_rank must be an integer in \\[0, 2\\)"):
            llm.generate(prompts()[:1], data_parallel_rank=2)
        while llm.engine.has_unfinished():
            llm.engine.step()
        assert_pools_whole(llm)
    finally:
        llm.shutdown()


@pytest.mark.timeout(90)
def test_killed_worker_on_one_dp_rank_fails_the_engine(models):
    llm = LLM(models["qwen3_moe"], device="cpu", data_parallel_size=2, enable_expert_parallel=True,
              distributed_timeout_s=30)
    procs = list(llm.engine.executor.procs)
    os.kill(procs[0].pid, signal.SIGKILL)  # rank 1 = DP rank 1
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1 died"):
        llm.generate(prompts(), SamplingParams(max_tokens=20), use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.shutdown()
    assert all(not p.is_alive() for p in procs)


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

from longserve.config import SchedulerConfig  # noqa: E402
from longserve.engine.dp_scheduler import DPScheduler  # noqa: E402
from longserve.engine.kv_cache_manager import KVCacheManager  # noqa: E402
from longserve.engine.request import Request  # noqa: E402
from longserve.worker.dp_step import balanced_split  # noqa: E402


@given(st.lists(st.integers(1, 600), min_size=2, max_size=40))
def test_balanced_split_minimises_the_larger_micro_batch(tokens):
    import numpy as np
    k = balanced_split(np.array(tokens))
    assert 1 <= k < len(tokens)
    larger = lambda j: max(sum(tokens[:j]), sum(tokens[j:]))  # noqa: E731
    assert larger(k) == min(larger(j) for j in range(1, len(tokens)))


@given(st.lists(st.one_of(st.none(), st.integers(0, 2)), min_size=1, max_size=30))
def test_balancer_picks_the_least_loaded_rank_or_the_pinned_one(pins):
    sched = DPScheduler(SchedulerConfig(), [KVCacheManager(8, 16) for _ in range(3)], False)
    for i, pin in enumerate(pins):
        load = [4 * len(s.waiting) + len(s.running) for s in sched.schedulers]
        req = Request(str(i), [1, 2], SamplingParams(), data_parallel_rank=pin)
        sched.add_request(req)
        chosen = next(d for d, s in enumerate(sched.schedulers) if req in s.waiting)
        assert chosen == (pin if pin is not None else load.index(min(load)))
    assert sum(len(s.waiting) for s in sched.schedulers) == len(pins)


@pytest.mark.timeout(240)
def test_torchrun_with_two_dp_ranks_matches_one_rank():
    """`torchrun --nproc-per-node 2 ... -dp 2 --enable-expert-parallel`: rank 0 balances and
    prints, both exit 0, the text of one rank."""
    import json
    import subprocess
    import sys

    cmd = ["-m", "longserve.entrypoints.cli", "generate", "--device", "cpu", "--max-tokens", "6",
           "--model", "builtin:qwen3-moe-tiny", "--prompt", "Hello there", "--prompt", "Once upon"]
    one = subprocess.run([sys.executable, *cmd], capture_output=True, text=True, timeout=120)
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          *cmd, "-dp", "2", "--enable-expert-parallel"],
                         capture_output=True, text=True, timeout=180)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    text = lambda out: [json.loads(line)["text"] for line in out.splitlines() if line.startswith("{")]  # noqa: E731
    assert text(two.stdout) == text(one.stdout) and len(text(one.stdout)) == 2


def test_dp_world_larger_than_the_gpus_fails_at_start(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match="data_parallel_size x prefill_context_parallel_size x "
                                         "tensor_parallel_size\\) needs 4 GPUs; 2 are visible"):
        LLM("builtin:qwen3-moe-tiny", device="cuda", data_parallel_size=2, tensor_parallel_size=2)


def test_merge_outputs_of_dp_ranks():
    from longserve.worker.dp_step import merge_outputs
    from longserve.worker.model_runner import ModelRunnerOutput
    a = ModelRunnerOutput({"0": 5}, {"0": {5: -0.1}})
    b = ModelRunnerOutput({"1": 7, "2": 9}, {})
    merged = merge_outputs([a, None, b])
    assert merged.sampled == {"0": 5, "1": 7, "2": 9} and merged.logprobs == {"0": {5: -0.1}}
