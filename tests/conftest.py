import contextlib
import functools
import os
import tempfile
from unittest import mock

import numpy as np
import pytest

# Built-in models are written once per test session into a private cache folder.
os.environ.setdefault("LONGSERVE_CACHE", os.path.join(tempfile.gettempdir(), "longserve-test-cache"))
# An LLM built by a test runs its engine core on a thread of the test process (fast to start,
# and tests can look inside it); the tests of the engine-core processes, the servers and DP
# run them as processes (with LONGSERVE_ENABLE_MULTIPROCESSING=1 CI runs every test so).
os.environ.setdefault("LONGSERVE_ENABLE_MULTIPROCESSING", "0")


def per_request(msg) -> list:
    """Every request's delta of one core message (EngineCoreOutputs: the columns, then the rest)
    as an EngineCoreOutput."""
    from longserve.engine.messages import EngineCoreOutput
    return [EngineCoreOutput(r, [t]) for r, t in zip(msg.token_req_ids, msg.token_ids)] + msg.outputs


def assert_pool_whole(llm):
    """Every block of every engine core (one per DP rank) is back in the pool, no request left."""
    for state in llm.engine.pool_states():
        assert state == dict(state, num_free_blocks=state["num_blocks"], refs_zero=True,
                             unfinished=False), state


@pytest.fixture
def pool_whole():
    return assert_pool_whole


@pytest.fixture(scope="session")
def smollm2_gguf():
    """SmolLM2-135M-Instruct's .gguf through the default model's resolver (fetched once into
    the test cache)."""
    from longserve.models.builtin import resolve_model
    return resolve_model("smollm2")


def _hf_where(gguf_path: str) -> dict:
    return dict(pretrained_model_name_or_path=os.path.dirname(gguf_path),
                gguf_file=os.path.basename(gguf_path))


@contextlib.contextmanager
def fast_hf_gguf_reads():
    """HF's GGUF loading, faster, computing the same: gguf's reader on a plain array (numpy.memmap's
    __array_finalize__ on every slice was most of its ~25 s) and the tensor-name map built once (HF
    builds it again for every tensor)."""
    import gguf
    with mock.patch("numpy.memmap", lambda path, dtype=np.uint8, mode="r", **_: np.fromfile(path, dtype)), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map)):
        yield


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_gguf):
    """HF transformers' tokenizer rebuilt from the same .gguf (loaded once a session)."""
    from transformers import AutoTokenizer
    with fast_hf_gguf_reads():
        return AutoTokenizer.from_pretrained(**_hf_where(smollm2_gguf))


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_gguf):
    """HF transformers' model from the same .gguf, dequantized by HF itself, float32."""
    import torch
    from transformers import AutoModelForCausalLM
    with fast_hf_gguf_reads():
        return AutoModelForCausalLM.from_pretrained(**_hf_where(smollm2_gguf), dtype=torch.float32).eval()
