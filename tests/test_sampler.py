"""Sampling rules: top-k and top-p masks, temperature, greedy rows, seeds."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from longserve.sampling_params import SamplingParams
from longserve.worker.sampler import (Sampler, apply_logit_bias, apply_top_k, apply_top_p,
                                      logit_bias_arrays)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.integers(0, 1000))
def test_top_k_keeps_exactly_the_k_largest(k, seed):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(seed))
    kept = torch.isfinite(apply_top_k(logits, [k] * 3))
    assert (kept.sum(-1) == k).all()
    top = logits.topk(k).indices
    assert kept.gather(-1, top).all()


@settings(max_examples=50, deadline=None)
@given(st.floats(0.05, 1.0), st.integers(0, 1000))
def test_top_p_keeps_the_smallest_prefix_reaching_p(p, seed):
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(seed))
    kept = torch.isfinite(apply_top_p(logits, [p]))[0]
    probs = logits.softmax(-1)[0]
    order = probs.argsort(descending=True)
    n = int(kept.sum())
    assert kept[order[:n]].all()
    assert probs[order[:n]].sum() >= p - 1e-6
    assert n == 1 or probs[order[:n - 1]].sum() < p + 1e-6


def test_greedy_rows_take_the_argmax_and_seeds_repeat():
    s = Sampler(0, torch.device("cpu"))
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5),
              SamplingParams(temperature=0.7, top_k=3), SamplingParams(temperature=1.0, seed=5)]
    tokens = s(logits, params, [0, 0, 0, 0]).tolist()
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[2] in logits[2].topk(3).indices.tolist()
    again = s(logits[1:2], params[1:2], [0]).tolist()
    assert again[0] == tokens[1]  # same seed, same offset, same logits: same token


def test_sampling_follows_the_distribution():
    s = Sampler(0, torch.device("cpu"))
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]])).repeat(4000, 1)
    tokens = s(logits, [SamplingParams(temperature=1.0)] * 4000, [0] * 4000).tolist()
    freq = torch.bincount(torch.tensor(tokens), minlength=3).float() / 4000
    assert torch.allclose(freq, torch.tensor([0.7, 0.2, 0.1]), atol=0.03)


def test_logit_bias_of_hundreds_of_entries_is_added_per_row():
    logits = torch.zeros(3, 1000)
    bias = [{t: float(t % 7) - 3 for t in range(0, 1000, 3)}, None, {5: 1.5, 999: -2.0}]
    got = apply_logit_bias(logits, [logit_bias_arrays(SamplingParams(logit_bias=b)) for b in bias])
    want = torch.zeros(3, 1000)
    for i, b in enumerate(bias):
        for t, v in (b or {}).items():
            want[i, t] += v
    assert torch.equal(got, want) and not logits.any()  # a copy: logprobs stay the model's
