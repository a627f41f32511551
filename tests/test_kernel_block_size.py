"""Kernel blocks smaller than the manager's block: each manager block maps onto several kernel
blocks in the block table, and the tokens are those of the plain layout."""
import pytest

from longserve import LLM, SamplingParams
from longserve.attention.backends import TorchAttentionBackend
from longserve.attention.kv_cache_spec import MultipleOf


def generate(**kw):
    llm = LLM("builtin:qwen2-tiny", device="cpu", **kw)
    try:
        ps = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (7, 30, 45)]
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                               logprobs=3), use_tqdm=False)
        runner = llm.engine.core.executor.driver.runner
        assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
        return outs, runner
    finally:
        llm.shutdown()


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 16}], ids=["plain", "chunked"])
def test_smaller_kernel_blocks_give_the_same_tokens(monkeypatch, kw):
    ref, runner = generate(block_size=16, **kw)
    assert runner.kernel_block_size == 16
    monkeypatch.setattr(TorchAttentionBackend, "get_supported_kernel_block_sizes",
                        staticmethod(lambda: [4, 8]))
    outs, runner = generate(block_size=16, **kw)
    assert runner.kernel_block_size == 8 and runner.layout.kernel_blocks_per_block == 2
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert all(abs(x[k] - y[k]) < 1e-5 for k in y)


def test_no_common_kernel_block_size_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(TorchAttentionBackend, "get_supported_kernel_block_sizes",
                        staticmethod(lambda: [MultipleOf(48)]))
    with pytest.raises(ValueError, match="no kernel block size divides the KV manager block size 16"):
        LLM("builtin:qwen2-tiny", device="cpu", block_size=16)
