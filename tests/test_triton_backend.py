"""The CUDA attention backend's engine path, with its Triton kernels run by the Triton
interpreter on the CPU: same tokens and log-probabilities as the torch reference backend.
Runs in a subprocess because TRITON_INTERPRET must be set before triton is imported."""
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

SCRIPT = textwrap.dedent("""
    import torch
    from longserve import LLM, SamplingParams

    def run(backend, **kw):
        llm = LLM("builtin:qwen3-tiny", device="cpu", attention_backend=backend, **kw)
        g = torch.Generator().manual_seed(3)
        ps = [{"prompt_token_ids": torch.randint(3, 500, (n,), generator=g).tolist()} for n in (6, 21, 40)]
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=8),
                            use_tqdm=False)
        assert llm.engine.core.kv.num_free_blocks == llm.engine.core.kv.num_blocks
        llm.shutdown()
        return outs

    if __name__ == "__main__":
        # pcp=2: the decode kernel writes the CP exchange's packed layout; prefix rows are split
        for kw in ({}, {"max_num_batched_tokens": 16, "block_size": 16},
                   {"prefill_context_parallel_size": 2, "max_num_batched_tokens": 16}):
            ref, got = run("torch", **kw), run("triton", **kw)
            for a, b in zip(ref, got):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                    assert all(abs(x[k] - y[k]) < 1e-4 for k in x)
        print("OK")
""")


@pytest.mark.timeout(600)
def test_triton_backend_matches_reference_under_interpreter(tmp_path):
    script = tmp_path / "check.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    res = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and "OK" in res.stdout, res.stderr[-3000:]
