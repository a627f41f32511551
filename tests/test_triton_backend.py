"""The CUDA attention backend's engine path, with its Triton kernels (attention and the fused
ops) run by the Triton interpreter on the CPU: same tokens and log-probabilities as the torch
reference backend, run here without the interpreter. The Triton run is this file run as a
script, because TRITON_INTERPRET must be set before triton is imported."""
import json
import os
import subprocess
import sys

import pytest
import torch

from interpreter_utils import speed_up_interpreter
from longserve import LLM, SamplingParams

speed_up_interpreter()  # (the script run and its workers: TRITON_INTERPRET=1)

# pcp=2: the decode kernel writes the CP exchange's packed layout; prefix rows are split
LAYOUTS = ({}, {"max_num_batched_tokens": 16, "block_size": 16},
           {"prefill_context_parallel_size": 2, "max_num_batched_tokens": 16})


def run(backend: str, **kw) -> list:
    """Each prompt's greedy ids and per-token logprobs (ids as JSON keys), the pool whole after."""
    llm = LLM("builtin:qwen3-tiny", device="cpu", attention_backend=backend, **kw)
    g = torch.Generator().manual_seed(3)
    ps = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (6, 21, 40)]
    outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=8),
                        use_tqdm=False)
    assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
    llm.shutdown()
    return [(o.outputs[0].token_ids, [{str(k): v for k, v in lp.items()} for lp in o.outputs[0].logprobs])
            for o in outs]


def check_triton_against(want: list) -> None:
    for kw, ref in zip(LAYOUTS, want):
        for (ids, lps), (ref_ids, ref_lps) in zip(run("triton", **kw), ref):
            assert ids == ref_ids, (kw, ids, ref_ids)
            for x, y in zip(lps, ref_lps):
                assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x), (kw, x, y)


@pytest.mark.timeout(600)
def test_triton_backend_matches_reference_under_interpreter(tmp_path):
    pytest.importorskip("triton")
    (tmp_path / "want.json").write_text(json.dumps([run("torch", **kw) for kw in LAYOUTS]))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, __file__, str(tmp_path / "want.json")], env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]


if __name__ == "__main__":
    check_triton_against(json.load(open(sys.argv[1])))
    print("OK")
