"""LONGSERVE_TRACE: every rank's chosen steps under the profiler, a timeline file per rank."""
import json

import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.worker.step_trace import StepTrace


@pytest.mark.timeout(300)
def test_every_rank_writes_its_steps_timeline(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGSERVE_TRACE", f"{tmp_path}:2:3")
    llm = LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=2, max_model_len=128)
    try:
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
    finally:
        llm.shutdown()
    for rank in (0, 1):
        events = json.load(open(tmp_path / f"rank{rank}.json"))["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events)


def test_only_the_chosen_steps_are_traced(tmp_path):
    trace = StepTrace(3, torch.device("cpu"), spec=f"{tmp_path}:2:3")
    traced = []
    for step in range(7):
        trace.before_step()
        traced.append(trace.prof is not None)
        trace.after_step()
        assert (tmp_path / "rank3.json").exists() == (step >= 4)
    assert traced == [False, False, True, True, True, False, False]
    idle = StepTrace(0, torch.device("cpu"), spec="")  # unset: never starts a profiler
    idle.before_step()
    assert idle.prof is None
