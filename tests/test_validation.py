"""Bad input fails at the door, alone, with a message naming the field and what is allowed;
vLLM's prompt forms and integer types of numpy / torch are accepted."""
import json
import pickle
import shutil

import numpy as np
import pytest
import torch

from longserve import LLM, SamplingParams
from longserve.entrypoints.cli import main as cli_main
from longserve.models.builtin import resolve_model


@pytest.fixture(scope="module")
def llm():
    return LLM("builtin:llama-tiny", device="cpu", max_model_len=128)


def greedy(n=4, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


def tokens(llm, prompt, params=None):
    return llm.generate(prompt, params or greedy(), use_tqdm=False)[0].outputs[0].token_ids


# ---- sampling parameters ---------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=2.5), r"max_tokens must be an integer, got float 2.5"),
    (dict(max_tokens=True), r"max_tokens must be an integer, got bool"),
    (dict(max_tokens="8"), r"max_tokens must be an integer"),
    (dict(seed=1.5), r"seed must be an integer"),
    (dict(seed="x" * 10_000), r"seed must be an integer, got str 'xxx"),
    (dict(seed=1 << 70), r"seed must be in \["),
    (dict(top_k=2.0), r"top_k .*integer"),
    (dict(top_k=-2), r"top_k .*must be in \[-1"),
    (dict(temperature=float("nan")), r"temperature must be a finite number"),
    (dict(temperature="0.5"), r"temperature must be a finite number"),
    (dict(top_p=True), r"top_p must be a finite number"),
    (dict(min_tokens=-1), r"min_tokens must be in \[0"),
    (dict(min_tokens=1.0), r"min_tokens must be an integer"),
    (dict(logprobs=2.0), r"logprobs must be an integer"),
    (dict(stop=5), r"stop must be a non-empty string"),
    (dict(stop=["ok", ""]), r"stop must be a non-empty string"),
    (dict(stop_token_ids=[1.0]), r"stop_token_ids entries must be an integer"),
    (dict(stop_token_ids=[-1]), r"stop_token_ids entries must be in \[0"),
    (dict(stop_token_ids=5), r"stop_token_ids must be a list"),
    (dict(ignore_eos=1), r"ignore_eos must be True or False"),
    (dict(max_tokens=-1), r"max_tokens must be in \[0"),
    (dict(logit_bias=[1]), r"logit_bias must be a dict"),
    (dict(logit_bias={-1: 1.0}), r"logit_bias keys must be in \[0"),
    (dict(logit_bias={"x": 1.0}), r"logit_bias keys must be an integer"),
    (dict(logit_bias={1: float("inf")}), r"logit_bias values must be a finite number"),
    (dict(include_stop_str_in_output="yes"), r"include_stop_str_in_output must be True or False"),
])
def test_sampling_params_name_the_field_and_range(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_take_numpy_and_torch_integers():
    sp = SamplingParams(seed=np.int64(3), max_tokens=torch.tensor(5), top_k=np.int8(-1),
                        min_tokens=np.uint8(1), stop_token_ids=np.array([4, 9]), stop="x")
    assert (sp.seed, sp.max_tokens, sp.top_k, sp.min_tokens) == (3, 5, 0, 1)
    assert sp.stop_token_ids == [4, 9] and sp.stop == ["x"]
    assert all(type(v) is int for v in (sp.seed, sp.max_tokens, *sp.stop_token_ids))


def test_params_changed_after_construction_are_checked_at_the_door(llm, pool_whole):
    sp = greedy()
    sp.max_tokens = 2.5
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1, 2, 3]], sp, use_tqdm=False)
    pool_whole(llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(logprobs=513), r"logprobs must be in \[0, 512\]"),
    (dict(stop_token_ids=[512]), r"stop_token_ids \[512\] are outside the vocabulary"),
    (dict(n=None), r"needs \d+ KV blocks .*the cache has"),
])
def test_params_checked_against_the_model_and_pool(kwargs, message, pool_whole):
    small = LLM("builtin:llama-tiny", device="cpu", block_size=4, num_gpu_blocks=8)
    good = [1, 2, 3]
    with pytest.raises(ValueError, match=message):
        small.generate([good, [4, 5]], [greedy(), greedy(**kwargs)], use_tqdm=False)
    pool_whole(small)
    assert len(tokens(small, good)) == 4


def test_a_request_the_pool_cannot_finish_is_refused_not_looped(pool_whole):
    """The prompt fits the pool, prompt + output does not: was preempted and readmitted forever."""
    small = LLM("builtin:llama-tiny", device="cpu", block_size=4, num_gpu_blocks=4)
    with pytest.raises(ValueError, match=r"needs 5 KV blocks \(8 prompt tokens \+ up to 13 output"):
        small.generate([list(range(3, 11))], greedy(13), use_tqdm=False)
    out = small.generate([list(range(3, 11))], greedy(9), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 9 and out.finish_reason == "length"  # 16 tokens = 4 blocks
    pool_whole(small)


# ---- prompts -------------------------------------------------------------------------
def test_vllm_prompt_forms_give_the_same_tokens(llm):
    text = "Once upon a time"
    ids = llm.get_tokenizer().encode(text).ids
    want = tokens(llm, [{"prompt_token_ids": ids}])
    assert tokens(llm, text) == want
    assert tokens(llm, {"prompt": text}) == want  # vLLM's TextPrompt (was: "the prompt is empty")
    assert tokens(llm, ids) == want  # one prompt given as a list of ids
    assert tokens(llm, [ids]) == want
    assert tokens(llm, np.array(ids, dtype=np.int32)) == want
    assert tokens(llm, torch.tensor(ids)) == want
    assert tokens(llm, [[np.int64(t) for t in ids]]) == want
    assert tokens(llm, {"prompt_token_ids": torch.tensor(ids, dtype=torch.int32)}) == want
    out = llm.generate({"prompt": text}, greedy(), use_tqdm=False)[0]
    assert out.prompt == text and out.prompt_token_ids == ids


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [1, 2.0, 3]}, r"prompt_token_ids\[1\] must be an integer, got float"),
    ([1, 2.7], r"prompt_token_ids\[1\] must be an integer, got float 2.7"),
    ({"prompt_token_ids": [True, 2]}, r"prompt_token_ids\[0\] must be an integer, got bool"),
    ({"prompt_token_ids": np.array([1.0, 2.0])}, r"must hold integers, got dtype float64"),
    ({"prompt_token_ids": torch.tensor([[1, 2]])}, r"must be 1-D"),
    ({"prompt_token_ids": "1 2 3"}, r"prompt_token_ids must be a list of integers"),
    ({"prompt": "hi", "max_tokens": 4}, r"unknown prompt keys \['max_tokens'\]"),
    ({"text": "hi"}, r"unknown prompt keys \['text'\]"),
    ({}, r"needs 'prompt' \(text\) or 'prompt_token_ids'"),
    ({"prompt": 5}, r"'prompt' must be a string"),
    ({"prompt_token_ids": []}, r"the prompt is empty"),
    (3.5, r"a prompt is a string"),
])
def test_bad_prompts_fail_alone_before_anything_is_queued(llm, prompt, message, pool_whole):
    good = [1, 2, 3, 4]
    with pytest.raises((ValueError, TypeError), match=message):
        llm.generate([good, prompt], greedy(), use_tqdm=False)
    pool_whole(llm)
    assert len(tokens(llm, [good])) == 4


def test_a_bad_request_never_aborts_queued_ones(llm, pool_whole):
    eng = llm.engine
    good = eng.make_request([1, 2, 3, 4], greedy(6))
    stream = eng.add_request(good)
    for bad in ([1.5], {"prompt": "x", "oops": 1}):
        with pytest.raises(ValueError):
            eng.make_request(bad, greedy())
    with pytest.raises(ValueError, match="logprobs"):
        eng.make_request([1, 2], greedy(logprobs=10_000))
    deltas = list(stream)
    assert deltas[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == 6
    pool_whole(llm)


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("cannot pickle this")


@pytest.mark.timeout(180)
def test_unpicklable_params_subclass_cannot_kill_a_tp2_engine(pool_whole):
    class LocalParams(SamplingParams):  # like a class defined in __main__: workers cannot import it
        pass

    sp = LocalParams(temperature=0, max_tokens=4, ignore_eos=True)
    sp.extra = _Unpicklable()
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        pickle.dumps(sp)
    one = LLM("builtin:llama-tiny", device="cpu", max_model_len=128)
    want = tokens(one, [[1, 2, 3]])
    one.shutdown()
    llm = LLM("builtin:llama-tiny", device="cpu", tensor_parallel_size=2, max_model_len=128)
    try:
        assert tokens(llm, [[1, 2, 3]], sp) == want
        assert tokens(llm, [[1, 2, 3]]) == want  # and the engine keeps serving
        pool_whole(llm)
    finally:
        llm.shutdown()


# ---- configuration ---------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_seqs=0), r"max_num_seqs must be an integer in \[1, inf\]"),
    (dict(max_num_seqs=-3), r"max_num_seqs"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens must be an integer in \[1"),
    (dict(max_model_len=0), r"max_model_len must be an integer in \[2, 4096\]"),
    (dict(max_model_len=-5), r"max_model_len must be an integer in \[2, 4096\]"),
    (dict(max_model_len=10_000), r"max_model_len .*max_position_embeddings"),
    (dict(max_model_len=64.0), r"max_model_len must be an integer"),
    (dict(block_size=1 << 20), r"block_size must be an integer in \[1, 4096\]"),
    (dict(block_size=0), r"block_size"),
    (dict(cpu_kv_cache_gb=0), r"cpu_kv_cache_gb must be a number in \(0, inf\]"),
    (dict(cpu_kv_cache_gb=-1), r"cpu_kv_cache_gb"),
    (dict(cpu_kv_cache_gb=1e-8), r"room for no block .*block_size=16"),
    (dict(gpu_memory_utilization=0), r"gpu_memory_utilization must be a number in \(0, 1\]"),
    (dict(gpu_memory_utilization=1.2), r"gpu_memory_utilization"),
    (dict(num_gpu_blocks=0), r"num_gpu_blocks must be an integer in \[1"),
    (dict(load_format="pt"), r"load_format must be one of \['auto', 'dummy'\]"),
    (dict(attention_backend="flash"), r"attention_backend must be one of \['auto', 'torch', 'triton'\]"),
    (dict(dtype="float8"), r"unknown dtype"),
    (dict(dtype=[32]), r"unknown dtype"),
    (dict(seed=0.5), r"seed must be an integer"),
    (dict(enable_prefix_caching="no"), r"enable_prefix_caching must be True or False"),
    (dict(distributed_timeout_s=0), r"distributed_timeout_s must be a number in \(0"),
    (dict(tensor_parallel_size=True), r"tensor_parallel_size must be a positive integer"),
])
def test_bad_engine_arguments_fail_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM("builtin:llama-tiny", **{"device": "cpu", **kwargs})


def test_model_argument_must_be_a_path():
    with pytest.raises(ValueError, match="model must be a folder path or 'builtin:<name>'"):
        LLM(5, device="cpu")


def model_copy(tmp_path, **config_changes):
    dst = tmp_path / "model"
    shutil.copytree(resolve_model("builtin:llama-tiny"), dst)
    if config_changes:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config_changes)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_intermediate_size_not_divisible_by_tp(tmp_path):
    dst = model_copy(tmp_path, intermediate_size=225)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide .*intermediate_size=225"):
        LLM(str(dst), device="cpu", tensor_parallel_size=2, load_format="dummy")


@pytest.mark.parametrize("changes, message", [
    (dict(vocab_size=-5), r"config.json: vocab_size must be a positive integer, got -5"),
    (dict(hidden_size="64"), r"config.json: hidden_size must be a positive integer"),
    (dict(num_attention_heads=None), r"config.json: num_attention_heads must be a positive integer"),
    (dict(rope_scaling=5), r"config.json: rope_scaling must be an object"),
    (dict(rope_scaling={"rope_type": "llama3"}), r"config.json: rope_scaling llama3 needs .*'factor'"),
    (dict(rope_scaling={"rope_type": "yarn"}), r"config.json: unsupported rope_scaling type 'yarn'"),
    (dict(eos_token_id="2"), r"config.json: eos_token_id must be an integer or a list"),
    (dict(num_key_value_heads=3), r"num_key_value_heads=3 must divide num_attention_heads=4"),
])
def test_bad_config_values_name_the_file(tmp_path, changes, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(model_copy(tmp_path, **changes)), device="cpu")


@pytest.mark.parametrize("file, damage, message", [
    ("config.json", lambda b: b[: len(b) // 2], r"config.json is not valid JSON"),
    ("config.json", lambda b: b"[1, 2]", r"config.json must hold a JSON object"),
    ("tokenizer.json", lambda b: b[: len(b) // 2], r"cannot read the tokenizer .*tokenizer.json"),
    ("model.safetensors", lambda b: b[: len(b) // 2], r"cannot read weights from .*model.safetensors"),
    ("model.safetensors", lambda b: b"\x00" * 64, r"cannot read weights from .*model.safetensors"),
])
def test_corrupt_files_are_named(tmp_path, file, damage, message):
    dst = model_copy(tmp_path)
    (dst / file).write_bytes(damage((dst / file).read_bytes()))
    with pytest.raises(ValueError, match=message):
        LLM(str(dst), device="cpu")


def test_cli_prints_errors_without_a_traceback(tmp_path, capsys):
    dst = model_copy(tmp_path)
    (dst / "config.json").write_text("{not json")
    for argv in (["generate", "--model", str(dst)],
                 ["generate", "--max-num-seqs", "0", "--device", "cpu"],
                 ["generate", "--cpu-kv-cache-gb", "-1", "--device", "cpu"]):
        with pytest.raises(SystemExit) as exit_info:
            cli_main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("longserve: error: ") and "Traceback" not in err
        assert ("config.json is not valid JSON" in err) == (argv[2] == str(dst))
