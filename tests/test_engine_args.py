"""EngineArgs is the one declaration of the engine's arguments: the command's flags, LLM's
keywords and the EngineConfig agree with it (configs only: no engine starts)."""
import argparse
import dataclasses

import pytest
import torch

import longserve.llm
from longserve import LLM
from longserve.engine_args import EngineArgs
from longserve.models.builtin import resolve_model

FIELDS = [f.name for f in dataclasses.fields(EngineArgs)]
BASE = ["--model", "builtin:llama-tiny", "--device", "cpu"]
MOE = ["--model", "builtin:qwen3-moe-tiny"]

# field -> (flags on top of BASE, what the EngineConfig then holds)
FROM_CLI = {
    "model": (["--model", "builtin:qwen2-tiny"], lambda c: c.model.architecture == "Qwen2ForCausalLM"),
    "tokenizer": (["--tokenizer", resolve_model("builtin:qwen2-tiny")],
                  lambda c: c.model.tokenizer == resolve_model("builtin:qwen2-tiny")),
    "dtype": (["--dtype", "bfloat16"], lambda c: c.dtype == torch.bfloat16),
    "device": (["--device", "cpu"], lambda c: c.device == "cpu"),
    "max_model_len": (["--max-model-len", "64"], lambda c: c.scheduler.max_model_len == 64),
    "block_size": (["--block-size", "32"], lambda c: c.cache.block_size == 32),
    "max_num_seqs": (["--max-num-seqs", "8"], lambda c: c.scheduler.max_num_seqs == 8),
    "max_num_batched_tokens": (["--max-num-batched-tokens", "512"],
                               lambda c: c.scheduler.max_num_batched_tokens == 512),
    "gpu_memory_utilization": (["--gpu-memory-utilization", "0.5"],
                               lambda c: c.cache.gpu_memory_utilization == 0.5),
    "cpu_kv_cache_gb": (["--cpu-kv-cache-gb", "0.5"], lambda c: c.cache.cpu_kv_cache_bytes == 1 << 29),
    "num_gpu_blocks": (["--num-gpu-blocks", "64"], lambda c: c.cache.num_blocks == 64),
    "kv_cache_dtype": (["--kv-cache-dtype", "fp8"], lambda c: c.kv_dtype == torch.float8_e4m3fn),
    "enable_prefix_caching": (["--no-enable-prefix-caching"], lambda c: not c.cache.enable_prefix_caching),
    "enable_chunked_prefill": (["--no-enable-chunked-prefill"],
                               lambda c: not c.scheduler.enable_chunked_prefill),
    "long_prefill_token_threshold": (["--long-prefill-token-threshold", "2048"],
                                     lambda c: c.scheduler.long_prefill_token_threshold == 2048),
    "enforce_eager": (["--enforce-eager"], lambda c: c.enforce_eager),
    "async_scheduling": (["--no-async-scheduling"], lambda c: not c.scheduler.async_scheduling),
    "seed": (["--seed", "7"], lambda c: c.seed == 7),
    "load_format": (["--load-format", "dummy"], lambda c: c.load_format == "dummy"),
    "attention_backend": (["--attention-backend", "torch"], lambda c: c.attention_backend == "torch"),
    "tensor_parallel_size": (["-tp", "2"], lambda c: c.parallel.tensor_parallel_size == 2),
    "prefill_context_parallel_size": (["-pcp", "2"], lambda c: c.parallel.prefill_context_parallel_size == 2),
    "decode_context_parallel_size": (["-tp", "2", "-dcp", "2"],
                                     lambda c: c.parallel.decode_context_parallel_size == 2),
    "data_parallel_size": (["-dp", "2"], lambda c: c.parallel.data_parallel_size == 2),
    "data_parallel_size_local": (["-dp", "2", "-dpl", "1", "-dpp", "5000"],
                                 lambda c: c.parallel.data_parallel_size_local == 1),
    "data_parallel_start_rank": (["-dp", "2", "-dpl", "1", "-dpr", "1", "-dpp", "5000"],
                                 lambda c: c.parallel.data_parallel_start_rank == 1),
    "data_parallel_address": (["-dpa", "10.0.0.1"], lambda c: c.parallel.data_parallel_address == "10.0.0.1"),
    "data_parallel_rpc_port": (["-dpp", "5000"], lambda c: c.parallel.data_parallel_rpc_port == 5000),
    "cp_kv_cache_interleave_size": (["--cp-kv-cache-interleave-size", "4"],
                                    lambda c: c.parallel.cp_kv_cache_interleave_size == 4),
    "enable_sequence_parallel": (["--enable-sequence-parallel"], lambda c: c.parallel.enable_sequence_parallel),
    "enable_expert_parallel": (MOE + ["--enable-expert-parallel"], lambda c: c.parallel.enable_expert_parallel),
    "enable_dbo": (MOE + ["--enable-dbo"], lambda c: c.parallel.enable_dbo),
    "dbo_decode_token_threshold": (["--dbo-decode-token-threshold", "8"],
                                   lambda c: c.parallel.dbo_decode_token_threshold == 8),
    "dbo_prefill_token_threshold": (["--dbo-prefill-token-threshold", "64"],
                                    lambda c: c.parallel.dbo_prefill_token_threshold == 64),
    "distributed_timeout_s": (["--distributed-timeout-s", "60"], lambda c: c.parallel.distributed_timeout_s == 60),
    "rank0_own_process": (["--rank0-own-process"], lambda c: c.parallel.rank0_own_process),
    "kv_offload_gb": (["--kv-offload-gb", "0.5"], lambda c: c.kv_transfer.kv_offload_bytes == 1 << 29),
    "kv_transfer_config": (["--kv-transfer-config", '{"kv_role": "kv_producer"}'],
                           lambda c: c.kv_transfer.kv_role == "kv_producer"),
}


def parse(argv):
    return EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv)


@pytest.fixture
def llm_without_engine(monkeypatch):
    """LLM(...) that builds its config and starts nothing."""
    monkeypatch.setattr(longserve.llm, "LLMEngine", lambda config, **_: None)
    monkeypatch.setattr(LLM, "shutdown", lambda self: None)
    return LLM


def test_every_field_is_a_flag_whose_default_is_the_fields():
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    assert vars(parse([])) == defaults
    assert EngineArgs.from_cli_args(parse([])) == EngineArgs()
    for short, name in [("-tp", "tensor_parallel_size"), ("-pcp", "prefill_context_parallel_size"),
                        ("-dcp", "decode_context_parallel_size"), ("-dp", "data_parallel_size"),
                        ("-dpl", "data_parallel_size_local"), ("-dpr", "data_parallel_start_rank"),
                        ("-dpp", "data_parallel_rpc_port")]:
        assert getattr(parse([short, "3"]), name) == 3
    assert parse(["-dpa", "h"]).data_parallel_address == "h"


@pytest.mark.parametrize("name", FIELDS)
def test_a_flag_reaches_the_config_and_llm_builds_the_same(name, llm_without_engine):
    argv, holds = FROM_CLI[name]
    args = parse(BASE + argv)
    assert getattr(args, name) != dataclasses.fields(EngineArgs)[FIELDS.index(name)].default
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert holds(config)
    assert llm_without_engine(**vars(args)).config == config  # LLM's keywords are the fields


def test_every_field_is_in_the_table_and_llm_refuses_an_unknown_keyword(llm_without_engine):
    assert sorted(FROM_CLI) == sorted(FIELDS)
    with pytest.raises(TypeError, match="no_such_arg"):
        llm_without_engine("builtin:llama-tiny", device="cpu", no_such_arg=1)


def test_bad_flag_values_are_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"max_num_seqs must be an integer in \[1, inf\], got 0"):
        EngineArgs.from_cli_args(parse(["--max-num-seqs", "0"]))
    with pytest.raises(SystemExit):  # argparse: not a JSON object
        parse(["--kv-transfer-config", "[1]"])
    with pytest.raises(SystemExit):  # neither JSON nor a role's short name
        parse(["--kv-transfer-config", "prefill"])


@pytest.mark.parametrize("short", ["producer", "consumer", "both"])
def test_kv_transfer_config_takes_a_roles_short_name(short):
    config = EngineArgs.from_cli_args(parse(["--kv-transfer-config", short])).create_engine_config()
    assert config.kv_transfer.kv_role == f"kv_{short}"
