"""Incremental detokenization as the server streams it: every delta is a prefix-extension of
the full decode, never ends in a split character, and the rest at finish completes it."""
from hypothesis import given, settings, strategies as st

from longserve.engine.detokenizer import IncrementalDetokenizer
from longserve.tokenizer import folder_tokenizer
from longserve.models.builtin import resolve_model

TOKENIZER = folder_tokenizer(resolve_model("builtin:llama-tiny"))[0]  # byte-level BPE, 512 tokens
REPLACEMENT = "\ufffd"
# text with multi-byte characters (2, 3 and 4 bytes in UTF-8) among the corpus's ASCII
TEXT = st.text(alphabet=st.sampled_from(list("ab the fox,.\n") + list("éß中文€😀🙂ü")), max_size=40)


def decode(ids):
    return TOKENIZER.decode(ids, skip_special_tokens=True)


def stream(ids, chunks):
    """Feed `ids` in chunks of the given sizes: the deltas, and the rest at finish."""
    detok, deltas, i = IncrementalDetokenizer(TOKENIZER), [], 0
    for size in [*chunks, len(ids)]:
        i = min(i + size, len(ids))
        deltas.append(detok.update(ids[:i]))
        assert decode(ids[:i]).startswith(detok.text)  # never text that a later token changes
    full = decode(ids)
    return deltas, full[len(detok.text):]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 511), max_size=60), st.lists(st.integers(1, 4), max_size=30))
def test_deltas_and_rest_equal_full_decode_for_any_tokens(ids, chunks):
    deltas, rest = stream(ids, chunks)
    assert "".join(deltas) + rest == decode(ids)
    assert not any(d.endswith(REPLACEMENT) for d in deltas)  # an unfinished character waits


@settings(max_examples=200, deadline=None)
@given(TEXT, st.lists(st.integers(1, 3), max_size=30))
def test_multibyte_text_never_splits_a_character(text, chunks):
    ids = TOKENIZER.encode(text, add_special_tokens=False).ids
    deltas, rest = stream(ids, chunks)
    assert "".join(deltas) + rest == text
    assert REPLACEMENT not in "".join(deltas) and rest == ""


def test_a_character_over_several_tokens_comes_out_whole():
    ids = TOKENIZER.encode("😀", add_special_tokens=False).ids
    assert len(ids) > 1  # the emoji's 4 bytes are separate tokens in this small vocabulary
    detok = IncrementalDetokenizer(TOKENIZER)
    assert [detok.update(ids[:i + 1]) for i in range(len(ids))] == [""] * (len(ids) - 1) + ["😀"]


def test_without_a_tokenizer_there_is_no_text():
    detok = IncrementalDetokenizer(None)
    assert detok.update([5, 6, 7]) == "" and detok.text == "" and detok.num_read == 3
