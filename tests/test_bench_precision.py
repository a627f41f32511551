"""The precision benchmark's metric: with every token its KL is the exact KL, with the top-k it
is the KL of the coarse-grained distributions (never above the exact one); top-1 counts ties;
teacher-forced decode scores what one prefill scores."""
import importlib.util
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

_spec = importlib.util.spec_from_file_location(
    "bench_precision", os.path.join(os.path.dirname(__file__), "..", "benchmarks", "bench_precision.py"))
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def distributions(seed, rows=5, vocab=40, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    ref = torch.log_softmax(2 * torch.randn(rows, vocab, generator=g, dtype=torch.float64), -1)
    other = torch.log_softmax(ref + noise * torch.randn(rows, vocab, generator=g, dtype=torch.float64), -1)
    return ref, other


def exact_kl(ref, other):
    return (ref.exp() * (ref - other)).sum(1)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), k=st.integers(1, 40))
def test_kl_exact_with_every_token_and_a_lower_bound_with_top_k(seed, k):
    ref, other = distributions(seed)
    targets = ref.argmin(1).tolist()  # the least likely token: outside most top-k sets
    full = bench.compare(ref, targets, bench.to_entries(other, targets, 40))
    assert torch.allclose(full["kl"], exact_kl(ref, other), atol=1e-12, rtol=1e-9)
    top = bench.compare(ref, targets, bench.to_entries(other, targets, k))
    assert torch.all(top["kl"] <= full["kl"] + 1e-12) and torch.all(top["kl"] >= -1e-12)
    assert torch.allclose(top["dlp"], (other - ref).gather(1, torch.tensor(targets)[:, None])[:, 0].abs())


def test_top1_counts_a_tie_as_agreement():
    ref = torch.log_softmax(torch.tensor([[3.0, 1.0, 0.0], [3.0, 1.0, 0.0]], dtype=torch.float64), -1)
    entries = [{1: -0.5, 0: -0.5}, {1: -0.4, 0: -0.6}]  # a tie between 0 and 1; then 1 ahead
    assert bench.compare(ref, [2, 2], entries)["top1"].tolist() == [1.0, 0.0]


@pytest.mark.timeout(120)  # starts an engine (its core process)
def test_teacher_forced_decode_scores_what_one_prefill_scores():
    """Forcing a continuation through decode steps (float32, CPU) gives each position the
    top-k log-probs that one prefill of the whole sequence gives it."""
    from longserve import LLM, SamplingParams
    seqs = [[5, 17, 99, 4, 250, 31, 7, 8, 120, 64], [3, 44, 45, 46, 200, 9, 11]]
    with LLM("builtin:llama-tiny", device="cpu", async_scheduling=False) as llm:
        forced = bench.teacher_forced_decode(llm.engine, seqs, [4, 3], k=5)
        params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5)
        prefill = [o.prompt_logprobs[1:] for o in llm.generate([{"prompt_token_ids": s} for s in seqs],
                                                               params, use_tqdm=False)]
    for f, p, s in zip(forced, prefill, seqs):
        assert len(f) == len(s) - 1 == len(p)
        for a, b in zip(f, p):  # the top 5 (a prompt entry adds the sequence's own token)
            both = a.keys() & b.keys()
            assert len(both) >= 5 and max(abs(a[t] - b[t]) for t in both) < 1e-4
