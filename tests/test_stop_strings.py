"""Stop strings: found in the new text only, counted only from min_tokens on, and also when
the last allowed token completes one."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from longserve import LLM, SamplingParams
from longserve.engine.detokenizer import IncrementalDetokenizer, find_stop
from longserve.engine.messages import EngineCoreRequest


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:llama-tiny", device="cpu", max_model_len=256)


def greedy(n, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def run(llm, prompt, params):
    return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]


def decode(llm, ids):
    return llm.get_tokenizer().decode(ids, skip_special_tokens=True)


def last_token_stop(llm, prompt, n):
    """A stop string that the n-th (last allowed) token completes, and the free run."""
    free = run(llm, prompt, greedy(n))
    before = decode(llm, free.token_ids[:-1])
    for k in range(1, len(free.text) + 1):
        stop = free.text[-k:]
        if stop.strip() and stop not in before and free.text.find(stop) == len(free.text) - k:
            return stop, free
    pytest.skip("the last token adds no text")


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_completed_by_the_last_allowed_token(llm, include, pool_whole):
    prompt = [1, 40, 41, 42]
    stop, free = last_token_stop(llm, prompt, 10)
    out = run(llm, prompt, greedy(10, stop=[stop], include_stop_str_in_output=include))
    assert out.finish_reason == "stop" and out.stop_reason == stop  # was "length"
    assert out.token_ids == free.token_ids
    assert out.text == free.text if include else out.text == free.text[:-len(stop)]
    pool_whole(llm)


def test_stop_string_waits_for_min_tokens(llm, pool_whole):
    prompt = [1, 50, 51, 52]
    free = run(llm, prompt, greedy(16))
    early = decode(llm, free.token_ids[:3])
    stop = next((early[i:i + 2] for i in range(len(early) - 1)
                 if early[i:i + 2].strip() and early[i:i + 2] not in decode(llm, free.token_ids[:2])), None)
    if stop is None:
        pytest.skip("no text early enough")
    out = run(llm, prompt, greedy(16, stop=[stop]))
    assert out.finish_reason == "stop" and len(out.token_ids) <= 3
    # with min_tokens past the first occurrence, that occurrence does not count
    later = run(llm, prompt, greedy(16, stop=[stop], min_tokens=6))
    assert len(later.token_ids) >= 6
    assert later.token_ids == free.token_ids[:len(later.token_ids)]
    tail_start = len(decode(llm, free.token_ids[:5]))
    if later.finish_reason == "stop":  # a later occurrence, completed at or after token 6
        assert later.text == free.text[:free.text.index(stop, tail_start - len(stop) + 1)]
    else:
        assert stop not in free.text[tail_start - len(stop) + 1:] and len(later.token_ids) == 16
    pool_whole(llm)


def test_stop_strings_decode_only_the_new_tokens(llm, monkeypatch):
    """Each step reads only the new token (the stream's window); the whole output is decoded once,
    for the final text."""
    lengths, steps = [], []
    decode_all, step = llm.engine.output.decode, IncrementalDetokenizer.update
    monkeypatch.setattr(llm.engine.output, "decode", lambda ids: lengths.append(len(ids)) or decode_all(ids))
    monkeypatch.setattr(IncrementalDetokenizer, "update",
                        lambda self, ids: steps.append(len(ids) - self.num_read) or step(self, ids))
    out = llm.generate([{"prompt_token_ids": [1, 60, 61]}],
                       greedy(60, stop=["\x00never"]), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 60 and out.finish_reason == "length"
    assert lengths == [60] and len(steps) >= 59 and max(steps) == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 511), min_size=1, max_size=40))
def test_incremental_text_equals_the_whole_decode(llm, ids):
    detok = IncrementalDetokenizer(llm.get_tokenizer())
    for i in range(1, len(ids) + 1):
        detok.update(ids[:i])
    whole = decode(llm, ids)
    assert whole.startswith(detok.text)
    assert detok.text == whole or whole.endswith("\ufffd")  # held back: an unfinished character


@pytest.mark.parametrize("text, new, stops, want", [
    ("hello world", 3, ["world"], (6, "world")),  # straddles the old and the new text
    ("hello world", 3, ["hello"], None),  # ended before the new text: found in an earlier step
    ("ab ab", 1, ["b", "a"], (4, "b")),
    ("xyz", 3, ["q", "y", "x"], (0, "x")),  # the earliest wins
])
def test_find_stop_looks_at_the_tail(text, new, stops, want):
    assert find_stop(text, new, stops) == want


def test_streamed_deltas_of_a_mixed_batch_join_into_the_final_outputs(llm, pool_whole):
    """Requests with and without stop strings, streamed side by side: each one's deltas join into
    the tokens, text and end that generate() gives it, and only its last delta ends it."""
    prompts = [[1, 30 + i, 31 + i, 32 + i] for i in range(6)]
    free = [run(llm, p, greedy(20)) for p in prompts]
    stops = [None, [free[1].text[5:8]], ["\x00never"], None, [free[4].text[-3:]],
             ["\x00never", free[5].text[2:4]]]
    params = [greedy(20, stop=s if s and all(x.strip() for x in s) else None) for s in stops]
    want = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                               use_tqdm=False)]
    streams = [llm.engine.add_request(EngineCoreRequest(f"mix-{i}", p, sp))
               for i, (p, sp) in enumerate(zip(prompts, params))]
    for stream, w in zip(streams, want):
        deltas = list(stream)
        assert sum((d.token_ids for d in deltas), []) == w.token_ids
        assert "".join(d.text for d in deltas) == w.text
        assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
        assert (deltas[-1].finish_reason, deltas[-1].stop_reason) == (w.finish_reason, w.stop_reason)
    assert {w.finish_reason for w in want} == {"length", "stop"}  # both ends are in the mix
    pool_whole(llm)
