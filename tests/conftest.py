import os
import tempfile

import pytest

# Built-in models are written once per test session into a private cache folder.
os.environ.setdefault("LONGSERVE_CACHE", os.path.join(tempfile.gettempdir(), "longserve-test-cache"))


def assert_pool_whole(llm):
    """Every block is back in the free queue and no request is left anywhere."""
    for kv in getattr(llm.engine, "kv_managers", [llm.engine.kv]):  # one per DP rank
        assert kv.num_free_blocks == kv.num_blocks
        assert all(c == 0 for c in kv.ref_cnt)
    assert not llm.engine.scheduler.has_unfinished()


@pytest.fixture
def pool_whole():
    return assert_pool_whole


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct's .gguf through the default model's resolver (fetched once into
    the test cache)."""
    from longserve.models.builtin import resolve_model
    return resolve_model("smollm2")
