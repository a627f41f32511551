"""Stopping multi-process engines (engine cores and their workers as processes, gloo): every
layout is down in seconds with every process exiting by itself with code 0, a front end killed
with SIGKILL takes its whole tree with it, and a normal run prints no c10d store-poll warning;
engine cores take the GPUs the caller's CUDA_VISIBLE_DEVICES names."""
import os
import signal
import subprocess
import sys
import time

import pytest

from longserve import LLM, SamplingParams
from server_utils import descendants, gone, wait_gone

PROMPTS = [{"prompt_token_ids": [1, 30, 31, 32, 33]}, {"prompt_token_ids": [5, 6, 7]}]
TINY = "builtin:llama-tiny"


def layouts(smollm2):
    return {"tp3": (smollm2, dict(tensor_parallel_size=3)),
            "dp2": (smollm2, dict(data_parallel_size=2)),
            "pcp2-tp2": (TINY, dict(prefill_context_parallel_size=2, tensor_parallel_size=2))}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", ["tp3", "dp2", "pcp2-tp2"])
def test_shutdown_within_5_s_every_process_exits_0(name, smollm2_gguf, monkeypatch, capfd):
    monkeypatch.setenv("LONGSERVE_ENABLE_MULTIPROCESSING", "1")
    model, layout = layouts(smollm2_gguf)[name]
    before = set(descendants(os.getpid()))
    llm = LLM(model, device="cpu", max_model_len=256, **layout)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert all(o.outputs[0].token_ids for o in outs)
    tree = [p for p in descendants(os.getpid()) if p not in before]
    cores = list(llm.engine.client.procs.values())
    ranks = 1
    for size in layout.values():
        ranks *= size
    assert len(tree) >= ranks  # one process a rank: the engine cores and their workers
    t = time.monotonic()
    llm.shutdown()
    took = time.monotonic() - t
    assert took <= 5, f"shutdown took {took:.1f} s"
    assert wait_gone(tree, 1), [p for p in tree if not gone(p)]
    assert [c.returncode for c in cores] == [0] * len(cores)
    err = capfd.readouterr().err
    for bad in ("waitForInput", "killing", "exited with an error", "did not exit"):
        assert bad not in err, err[-3000:]


FRONT_END = """
import sys
from longserve import LLM, SamplingParams
llm = LLM("builtin:llama-tiny", device="cpu", max_model_len=256, **{layout})
llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout,method", [("dict(tensor_parallel_size=2)", "spawn"),
                                           ("dict(data_parallel_size=2)", "spawn"),
                                           ("dict(tensor_parallel_size=2)", "fork")],
                         ids=["tp2", "dp2", "tp2-forked"])
def test_a_sigkilled_front_end_leaves_no_process_after_10_s(layout, method, tmp_path):
    script = tmp_path / "front.py"
    script.write_text(FRONT_END.replace("{layout}", layout))
    env = dict(os.environ, LONGSERVE_ENABLE_MULTIPROCESSING="1", LONGSERVE_START_METHOD=method)
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        tree = descendants(proc.pid)
        assert len(tree) >= 2  # engine core(s) and the tp rank 1 worker
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_gone(tree, 10), [p for p in tree if not gone(p)]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("visible,per_core,cores,want", [
    ("3,1", 1, 2, [["3"], ["1"]]),  # the caller's order, not 0..n-1
    ("GPU-a, GPU-b,GPU-c,GPU-d", 2, 2, [["GPU-a", "GPU-b"], ["GPU-c", "GPU-d"]]),
    ("1", 1, 1, [["1"]]),
])
def test_engine_cores_take_the_callers_gpus_in_order(visible, per_core, cores, want, monkeypatch):
    from types import SimpleNamespace

    from longserve.engine.core_client import core_gpus
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    config = SimpleNamespace(device="cuda", parallel=SimpleNamespace(replica_size=per_core))
    assert core_gpus(config, cores) == want
    assert core_gpus(SimpleNamespace(device="cpu"), 8) is None
