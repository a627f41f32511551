"""The LLM API: bad input is refused with a clear message, and the engine keeps serving."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from longserve import LLM, SamplingParams
from longserve.models.builtin import resolve_model


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:llama-tiny", device="cpu", max_model_len=256)


def greedy(n=8, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def test_generate_text_and_ids(llm, pool_whole):
    outs = llm.generate(["Hello there", {"prompt_token_ids": [1, 5, 9, 200]}], greedy(), use_tqdm=False)
    assert outs[0].prompt == "Hello there"
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("Hello there").ids
    assert outs[1].prompt_token_ids == [1, 5, 9, 200]
    for o in outs:
        assert len(o.outputs[0].token_ids) == 8 and o.outputs[0].finish_reason == "length"
        assert isinstance(o.outputs[0].text, str)
    pool_whole(llm)


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [5] * 256}, "max_model_len"),
    ({"prompt_token_ids": [5, 100000]}, "outside the vocabulary"),
    (42, "a prompt is a string"),
])
def test_bad_prompt_is_refused_and_engine_keeps_serving(llm, prompt, message, pool_whole):
    good = {"prompt_token_ids": [1, 2, 3, 4]}
    with pytest.raises((ValueError, TypeError), match=message):
        llm.generate([good, prompt], greedy(), use_tqdm=False)
    pool_whole(llm)  # nothing of the refused batch was queued
    assert len(llm.generate([good], greedy(), use_tqdm=False)[0].outputs[0].token_ids) == 8


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-3), "top_k"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_stop_token_and_stop_string(llm, pool_whole):
    prompt = {"prompt_token_ids": [1, 40, 41, 42]}
    free = llm.generate([prompt], greedy(12), use_tqdm=False)[0].outputs[0]
    stop_tok = free.token_ids[3]
    out = llm.generate([prompt], greedy(12, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free.token_ids[:free.token_ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    stop_str = free.text[2:5]
    if stop_str.strip():
        out = llm.generate([prompt], greedy(12, stop=[stop_str]), use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.text == free.text[:free.text.index(stop_str)]
    pool_whole(llm)


def test_eos_stops_unless_ignored(llm):
    prompt = {"prompt_token_ids": [1, 7, 8]}
    free = llm.generate([prompt], greedy(6), use_tqdm=False)[0].outputs[0]
    llm.config.model.eos_token_ids.append(free.token_ids[1])  # pretend the 2nd token is an EOS
    try:
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        eos_tok = free.token_ids[1]
        assert out[0].outputs[0].token_ids == free.token_ids[:free.token_ids.index(eos_tok) + 1]
        assert out[0].outputs[0].finish_reason == "stop"
        out = llm.generate([prompt], greedy(6), use_tqdm=False)
        assert out[0].outputs[0].token_ids == free.token_ids
    finally:
        llm.config.model.eos_token_ids.pop()


def test_seeded_sampling_is_reproducible_across_batches(llm):
    p = {"prompt_token_ids": [1, 9, 10, 11]}
    sp = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [1, 3, 4 + i]} for i in range(3)]
    batched = llm.generate(others + [p], [greedy(5)] * 3 + [sp], use_tqdm=False)[3].outputs[0].token_ids
    assert alone == batched
    other_seed = SamplingParams(temperature=1.0, seed=99, max_tokens=10, ignore_eos=True)
    assert llm.generate([p], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_logprobs_are_returned(llm):
    out = llm.generate([{"prompt_token_ids": [1, 5, 6]}], greedy(3, logprobs=4), use_tqdm=False)[0]
    lps = out.outputs[0].logprobs
    assert len(lps) == 3
    for tok, entry in zip(out.outputs[0].token_ids, lps):
        assert tok in entry and len(entry) <= 5
        assert entry[tok] == max(entry.values())  # greedy picks the most likely token


def test_abort_frees_blocks(llm, pool_whole):
    """A request aborted by the front end mid-generation ends with "abort"; its blocks return."""
    eng = llm.engine
    req = eng.make_request({"prompt_token_ids": list(range(3, 60))}, greedy(50))
    stream = iter(eng.add_request(req))
    first = next(stream)
    assert not first.finished and eng.call("pool_state")["num_free_blocks"] < eng.num_blocks
    eng.abort(req.request_id)
    last = list(stream)[-1]
    assert last.finished and last.finish_reason == "abort"
    pool_whole(llm)


def test_prompt_too_big_for_the_kv_pool():
    llm = LLM("builtin:llama-tiny", device="cpu", block_size=4, num_gpu_blocks=3)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([{"prompt_token_ids": list(range(3, 40))}], greedy(), use_tqdm=False)


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture"):
        LLM(str(tmp_path), device="cpu")


def test_missing_model_folder():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM("/no/such/model", device="cpu")


def copy_builtin(tmp_path):
    src = resolve_model("builtin:llama-tiny")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_missing_weight_is_named(tmp_path):
    dst = copy_builtin(tmp_path)
    weights = load_file(dst / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, dst / "model.safetensors")
    with pytest.raises(ValueError, match="missing.*layers.1.mlp.gate_up_proj"):
        LLM(str(dst), device="cpu")


def test_misshaped_weight_names_tensor_and_file(tmp_path):
    dst = copy_builtin(tmp_path)
    weights = load_file(dst / "model.safetensors")
    weights["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 64)
    save_file(weights, dst / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_proj.weight.*model.safetensors"):
        LLM(str(dst), device="cpu")


def test_sharded_checkpoint_with_index(tmp_path):
    dst = copy_builtin(tmp_path)
    weights = load_file(dst / "model.safetensors")
    os.remove(dst / "model.safetensors")
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: weights[k] for k in keys}, dst / file)
        weight_map.update({k: file for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ref = LLM("builtin:llama-tiny", device="cpu")
    sharded = LLM(str(dst), device="cpu")
    p = [{"prompt_token_ids": [1, 30, 31, 32, 33]}]
    assert (sharded.generate(p, greedy(), use_tqdm=False)[0].outputs[0].token_ids
            == ref.generate(p, greedy(), use_tqdm=False)[0].outputs[0].token_ids)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=3), "must divide the 4 attention heads"),
    (dict(tensor_parallel_size=2, decode_context_parallel_size=4), "must divide tensor_parallel_size"),
    (dict(prefill_context_parallel_size=2, cp_kv_cache_interleave_size=32), "must divide block_size"),
    (dict(tensor_parallel_size=0), "positive integer"),
    (dict(block_size=12), "power of two"),
    (dict(device="tpu"), "device must be"),
    (dict(dtype="float8"), "unknown dtype"),
])
def test_bad_configuration_fails_at_start(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("builtin:llama-tiny", **{"device": "cpu", **kwargs})


@pytest.mark.parametrize("name", ["llama-tiny", "qwen2-tiny", "qwen3-tiny", "llama-tiny-mqa"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_builtin_models_run_in_each_dtype(name, dtype):
    llm = LLM(f"builtin:{name}", device="cpu", dtype=dtype)
    out = llm.generate(["Once upon a time"], greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4
    assert next(llm.engine.core.executor.driver.runner.model.parameters()).dtype == getattr(torch, dtype)


def test_warm_up_leaves_no_trace(llm, pool_whole):
    """The start-up warm-up (on CUDA) runs real steps: afterwards the pool is whole, the
    prefix cache and the counters are empty, and outputs are unchanged."""
    prompts = [{"prompt_token_ids": [1, 5, 9, 13, 2]}]
    want = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    with llm.engine.client.paused() as core:
        core._warm_up()
        assert not core.kv.cached and not core.decode_steps
        assert core.scheduler.num_prompt_tokens_computed == 0 == core.kv.num_cached_tokens_hit
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    pool_whole(llm)
