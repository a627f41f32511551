"""What stalls a warm process names itself in the log (longserve/stalls.py)."""
import logging

import pytest

from longserve import stalls


def test_a_kernel_compiled_after_warm_up_is_logged(caplog):
    knobs = pytest.importorskip("triton").knobs
    saved = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    try:
        stalls._watch_kernel_compiles()
        with caplog.at_level(logging.WARNING, logger="longserve.stalls"):
            # what Triton calls around a compile: the first must return None (compile it)
            assert knobs.runtime.jit_cache_hook(key=("k", 1), repr="_paged_attn_kernel[...]") is None
            knobs.runtime.jit_post_compile_hook(
                key=("k", 1), repr="_paged_attn_kernel[...](q_ptr: *bf16)", compile=dict(
                    signature={"q_ptr": "*bf16", "stride": "i32", "BLOCK_R": "constexpr"},
                    constants={(1,): 1, (2,): 256}, configs=[{(0,): [["tt.divisibility", 16]]}]))
        assert "compiled while serving" in caplog.text and "_paged_attn_kernel" in caplog.text
        # the variant names itself: its pointers' types, its constants and its arguments
        # assumed 16-divisible
        assert "pointers q_ptr *bf16;" in caplog.text
        assert "stride=1, BLOCK_R=256" in caplog.text and "divisible by 16: q_ptr" in caplog.text
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = saved


def test_a_long_collection_is_logged(caplog, monkeypatch):
    monkeypatch.setattr(stalls, "GC_PAUSE_S", 0.0)
    with caplog.at_level(logging.WARNING, logger="longserve.stalls"):
        stalls._log_gc_pause("start", {})
        stalls._log_gc_pause("stop", {"generation": 2})
    assert "generation-2 garbage collection" in caplog.text
