"""The start-up timeline (longserve/startup.py): an engine's phases add up to its measured
start, every rank reports its own, and an engine starts, serves, stops and starts again in one
process (engine cores as processes, as a server runs them)."""
import time

import pytest

from longserve import LLM, SamplingParams
from longserve.startup import Timeline, critical_path, describe

GREEDY = SamplingParams(temperature=0, max_tokens=8)


def timed_start(*args, **kwargs):
    t = time.time()
    llm = LLM(*args, **kwargs)
    return llm, time.time() - t


def test_phases_are_consecutive_marks():
    tl = Timeline(start=time.time() - 1.0)
    tl.mark("a")
    time.sleep(0.05)
    tl.mark("b")
    assert [n for n, _ in tl.phases] == ["a", "b"]
    assert sum(s for _, s in tl.phases) == pytest.approx(time.time() - tl.start, abs=0.02)
    path = critical_path(tl.start - 0.5, tl.as_dict(), tl.last + 0.25)
    assert [n for n, _ in path] == ["front end", "a", "b", "handshake"]
    assert sum(s for _, s in path) == pytest.approx(1.8, abs=0.02)
    assert describe(path, {1: [["a", 0.5]]}).endswith("; rank 1: a 0.50")


@pytest.mark.timeout(300)
def test_smollm2_starts_serves_stops_and_starts_again(smollm2_gguf, monkeypatch, pool_whole):
    monkeypatch.setenv("LONGSERVE_ENABLE_MULTIPROCESSING", "1")
    texts = []
    for _ in range(2):
        llm, measured = timed_start(smollm2_gguf, device="cpu")
        phases = llm.engine.startup_phases
        names = [n for n, _ in phases]
        assert names[:2] == ["front end", "core process start + imports"]
        assert {"weights", "KV sizing", "KV cache", "warm-up"} <= set(names)
        assert sum(s for _, s in phases) == pytest.approx(measured, rel=0.1)
        assert llm.engine.info()["startup"].startswith("started in ")
        texts.append(llm.generate(["The capital of France is"], GREEDY, use_tqdm=False)[0]
                     .outputs[0].text)
        llm.shutdown()
    assert texts[0] == texts[1] and texts[0]


@pytest.mark.timeout(300)
def test_every_rank_reports_its_phases(monkeypatch):
    monkeypatch.setenv("LONGSERVE_ENABLE_MULTIPROCESSING", "1")
    with LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=2) as llm:
        ranks = llm.engine.infos[0]["startup"]["ranks"]
        assert list(ranks) == [1]
        assert [n for n, _ in ranks[1]][:4] == ["process start + imports", "rendezvous", "process groups",
                                                "weights"]
        assert "; rank 1: process start + imports" in llm.engine.startup
