"""benchmarks/bench_offline.py on the CPU at a tiny size: the nano-vllm workload end to end
(LongServe and HF generate, profile windows, host timers), and the bytes floor by hand."""
import importlib.util
import os

import pytest

from longserve.engine.core import EngineCore
from longserve.engine.scheduler import Scheduler
from longserve.models.builtin import model_config, resolve_model
from longserve.step_plan import ScheduledRequest, SchedulerOutput
from longserve.worker import model_runner

_spec = importlib.util.spec_from_file_location(
    "bench_offline", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_offline.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


@pytest.fixture(autouse=True)
def one_thread():
    """The engine's tiny steps: OpenMP threads on a shared 2-core host only spin."""
    before = bench.torch.get_num_threads()
    bench.torch.set_num_threads(1)
    yield
    bench.torch.set_num_threads(before)


def req(computed, n_tokens):
    return ScheduledRequest("r", [1] * n_tokens, computed, [], False, True)


def test_run_floor_of_two_hand_worked_steps():
    # step 1: a 6-token prefill chunk after 10 cached tokens (context 16) and a decode at
    # position 29 (context 30); step 2: decodes of context 31 and 5
    s1 = bench.step_record(SchedulerOutput([req(10, 6), req(29, 1)]), 0.0)
    s2 = bench.step_record(SchedulerOutput([req(30, 1), req(4, 1)]), 0.0)
    assert (s1.decode_rows, s1.prefill_tokens, s1.num_seqs, s1.context_tokens) == (1, 6, 2, 46)
    assert (s2.decode_rows, s2.prefill_tokens, s2.num_seqs, s2.context_tokens) == (2, 0, 2, 36)
    # weights 1000 B each step, 10 B of KV a token: (1000 + 460) + (1000 + 360) = 2820 B
    assert bench.run_floor_s([s1, s2], 1000, 10, 1e-9) == pytest.approx(2820 / 1e3)


def test_model_bytes_from_config_match_the_published_shapes():
    q = model_config(resolve_model("builtin:qwen3-0.6b-shape"))
    assert bench.weight_params(q) == pytest.approx(0.596e9, rel=2e-3)
    assert bench.kv_bytes_per_token(q, bench.torch.bfloat16) == 28 * 2 * 8 * 128 * 2
    ll = model_config(resolve_model("builtin:llama3-8b-shape"))
    assert bench.weight_params(ll) == pytest.approx(8.03e9, rel=2e-3)
    assert bench.kv_bytes_per_token(ll, bench.torch.bfloat16) == 32 * 2 * 8 * 128 * 2


def test_nano_workload_is_nano_vllms():
    a, b = bench.nano_workload(256, 151936), bench.nano_workload(256, 151936)
    assert a == b and len(a.prompts) == 256
    lens = [len(p) for p in a.prompts]
    assert min(lens) >= 100 and max(lens) <= 1024 and min(a.out_lens) >= 100 and max(a.out_lens) <= 1024
    assert max(max(p) for p in a.prompts) <= 10000
    other = bench.nano_workload(256, 151936, token_seed=5)
    assert [len(p) for p in other.prompts] == lens and other.prompts != a.prompts


def test_gpu_busy_is_the_union_of_device_intervals():
    ev = [dict(ph="X", cat="kernel", ts=0, dur=10), dict(ph="X", cat="kernel", ts=5, dur=10),
          dict(ph="X", cat="gpu_memcpy", ts=20, dur=5), dict(ph="X", cat="cpu_op", ts=15, dur=5),
          dict(ph="X", cat="gpu_memset", ts=30, dur=10)]
    assert bench.gpu_busy(ev) == (30.0, 40.0)  # [0, 15) + [20, 25) + [30, 40) over [0, 40)
    assert bench.gpu_busy([]) == (0.0, 0.0)


def test_trace_busy_reads_the_profilers_export():
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        bench.torch.ones(64, 64) @ bench.torch.ones(64, 64)
    assert bench.trace_busy(prof) == (0.0, 0.0)  # CPU ops only: no device interval


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["on", "off"])
def test_nano_workload_end_to_end_on_cpu(mode):
    originals = (Scheduler.schedule, Scheduler.update_from_output, EngineCore._outputs,
                 model_runner.prepare_step, model_runner.ModelRunner.run_model)
    rows = bench.main(["--models", "qwen3-tiny", "--device", "cpu", "--workload", "nano",
                       "--num-prompts", "6", "--nano-min-len", "8", "--nano-max-len", "24",
                       "--max-num-batched-tokens", "32", "--hf", "qwen3-tiny", "--profile", "--profile-run",
                       "--async-scheduling", mode])
    r = rows[0]
    wl = bench.nano_workload(6, 512, 8, 24)
    assert r["output_tokens"] == sum(wl.out_lens) and r["workload"] == "nano"
    assert r["async_scheduling"] == (mode == "on")
    assert r["hf_generated_tokens"] == 6 * max(wl.out_lens)  # one static batch
    assert r["speedup"] == pytest.approx(r["out_tok_s"] / r["hf_tok_s"], rel=0.02)
    # every request prefills, then decodes out_len - 1 times: each step is recorded once
    assert max(wl.out_lens) <= r["steps"] <= bench.max_prefill_steps(32, wl) + max(wl.out_lens)
    assert r["run_floor_s"] > 0
    assert r["decode_step_ms"] > 0 and r["floor_step_ms"] > 0
    full, timed = map(int, r["decode_steps_full"].split("/"))
    assert full == timed == bench.DECODE_WINDOW  # every timed step held the whole batch
    mixed, decode, run = r["profile"]
    assert mixed["mixed_steps"] >= 1 and decode["mixed_steps"] == 0 and decode["steps"] == 4
    assert run["window"] == "whole run"  # the same workload: the same schedule
    assert run["mixed_steps"] + run["decode_steps"] == r["steps"]
    assert not mixed["not_timed"] and all(v > 0 for v in mixed["host_ms"].values())
    assert mixed["gpu_idle_pct"] is None  # no GPU here
    assert originals == (Scheduler.schedule, Scheduler.update_from_output,
                         EngineCore._outputs, model_runner.prepare_step,
                         model_runner.ModelRunner.run_model)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen2-tiny", "qwen3-moe-tiny"])
def test_weight_params_count_every_parameter_of_the_model(model):
    llm = bench.LLM(f"builtin:{model}", load_format="dummy", device="cpu", max_model_len=64)
    try:
        real = sum(p.numel() for p in llm.engine.core.executor.driver.runner.model.parameters())
        assert bench.weight_params(llm.config.model) == real
    finally:
        llm.shutdown()


@pytest.mark.timeout(60)
def test_host_timers_time_and_restore_and_skip_missing():
    llm = bench.LLM("builtin:qwen3-tiny", load_format="dummy", device="cpu", max_model_len=64)
    parts = bench.HOST_PARTS + [("gone", "scheduler", "no_such_method")]
    try:
        with llm.engine.client.paused() as eng, bench.host_timers(eng, parts) as (totals, calls, missing):
            bench.add_requests(eng, bench.fixed_workload(2, 8, 3, 512), 3)
            bench.drain(eng)
        assert missing == ["scheduler.no_such_method"]
        assert calls["schedule"] >= 3 and calls["run_model"] == calls["sample"] >= 3
        assert all(totals[k] > 0 for k in ("schedule", "prepare_step", "run_model", "sample",
                                           "token_wait", "update_from_output", "outputs"))
        assert "schedule" not in vars(type(eng.scheduler)) or \
            type(eng.scheduler).schedule.__name__ == "schedule"
        assert model_runner.prepare_step.__name__ == "prepare_step"
    finally:
        llm.shutdown()
