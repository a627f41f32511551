"""Worker utilities: zeroing, binding, KV sharing, kernel block sizes, memory, SP."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from longserve.config import CacheConfig, ParallelConfig
from longserve.attention.kv_cache_spec import (AttentionGroup, AttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec, MultipleOf)
from longserve.worker.utils import (KVBlockZeroer, MemorySnapshot, add_kv_sharing_layers_to_kv_cache_groups,
                                    bind_kv_cache, is_residual_scattered_for_sp, prepare_kernel_block_sizes,
                                    request_memory, select_common_block_size)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30


def layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


# ----------------------------------------------------------------------------- zeroer

NUM_BLOCKS = 6  # manager blocks


def zeroer_scenario(device: str, use_triton: bool | None) -> None:
    """Two groups with different page sizes, kernel blocks smaller than manager blocks in
    group 0, a K/V pair living in a larger allocation, and two layers reading others' caches.

    group 0: manager block 8, kernel block 4 (k=2), 2 heads x 8, fp32 -> 512 B per segment
    group 1: manager block 8 = kernel block, 1 head x 8, bf16          -> 128 B per segment
             and layer 7, an FP8 cache (kv_cache_dtype="fp8"), 2 heads x 8 -> 128 B per segment
    """
    g0 = lambda: torch.empty(2, NUM_BLOCKS * 2, 4, 2, 8, device=device)
    bases = {0: g0(), 1: g0(), 2: g0(), 5: torch.empty(2, NUM_BLOCKS, 8, 1, 8, dtype=torch.bfloat16, device=device),
             6: torch.empty(2, NUM_BLOCKS + 3, 8, 1, 8, dtype=torch.bfloat16, device=device),
             7: torch.empty(2, NUM_BLOCKS, 8, 2, 8, dtype=torch.float8_e4m3fn, device=device)}
    caches = {i: b for i, b in bases.items()}
    caches[6] = bases[6][:, :NUM_BLOCKS]  # K and V planes not adjacent
    caches[3], caches[4] = caches[1], caches[0]  # layer 3 reads layer 1's cache, layer 4 layer 0's
    context = {layer(i): SimpleNamespace(kv_cache=c) for i, c in caches.items()}
    spec0, spec1 = AttentionSpec(8, 2, 8, torch.float32), AttentionSpec(8, 1, 8, torch.bfloat16)
    groups = [AttentionGroup(object, [layer(i) for i in (0, 1, 2, 3, 4)], spec0, 0),
              AttentionGroup(object, [layer(5), layer(6), layer(7)], spec1, 1)]

    zeroer = KVBlockZeroer(device, use_triton=use_triton)
    # layer 3 is declared runner-only; layer 4 is not, and must be found by address
    zeroer.init_meta(iter(groups), [4, 8], "auto", {layer(3)}, context)
    assert zeroer.use_triton == (device == "cuda" if use_triton is None else use_triton)
    assert len(zeroer.views) == 6 and zeroer.num_blocks == NUM_BLOCKS
    if zeroer.use_triton:
        assert zeroer.seg_table.shape == (12, 2) and zeroer.chunk_bytes == 128 and zeroer.num_chunks == 4

    for ids in ([4, 1], np.array([0, 5, 5]), torch.tensor([3], dtype=torch.int32, device=device), [], np.array([])):
        for b in bases.values():
            b.copy_(torch.rand(b.shape) + 0.5)  # no zeros anywhere
        expected = {i: b.clone() for i, b in bases.items()}
        zeroer.zero_block_ids(ids)
        zero = torch.as_tensor(ids.cpu() if isinstance(ids, torch.Tensor) else np.asarray(ids, dtype=np.int64)).to(device)
        for i, b in expected.items():
            b.view(torch.uint8)[:, :NUM_BLOCKS * (2 if i < 5 else 1)].view(2, NUM_BLOCKS, -1)[:, zero] = 0
            assert torch.equal(bases[i].view(torch.uint8), b.view(torch.uint8)), f"layer {i}, ids {ids}"


def test_zeroer_torch_path():
    zeroer_scenario("cpu", use_triton=False)


def test_zeroer_default_on_cpu_is_torch():
    zeroer_scenario("cpu", use_triton=None)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_zeroer_triton_kernel_interpreted():
    # TRITON_INTERPRET must be set before triton is imported: a fresh interpreter
    code = ("import sys; sys.path.insert(0, 'tests'); import test_worker_utils as t;"
            " t.zeroer_scenario('cpu', use_triton=True); print('ok')")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")
def test_zeroer_triton_kernel_cuda():
    zeroer_scenario("cuda", use_triton=None)
    zeroer_scenario("cuda", use_triton=False)


def one_layer_zeroer(cache, cache_dtype="auto", kernel_block_size=4, manager_block_size=4):
    spec = AttentionSpec(manager_block_size, 1, 4, torch.float32)
    zeroer = KVBlockZeroer("cpu", use_triton=False)
    zeroer.init_meta([AttentionGroup(object, [layer(0)], spec)], [kernel_block_size], cache_dtype,
                     set(), {layer(0): SimpleNamespace(kv_cache=cache)})
    return zeroer


def test_zeroer_rejects_bad_ids_and_layouts():
    zeroer = one_layer_zeroer(torch.ones(2, 3, 4, 1, 4))
    with pytest.raises(ValueError, match=r"block ids span \[0, 3\] but the KV caches have 3 blocks"):
        zeroer.zero_block_ids([0, 3])
    with pytest.raises(ValueError, match=r"span \[-1, 1\]"):
        zeroer.zero_block_ids(np.array([-1, 1]))
    with pytest.raises(ValueError, match=r"expected a KV cache \[2, num_blocks, 4"):
        one_layer_zeroer(torch.ones(3, 2, 4, 1, 4))
    with pytest.raises(ValueError, match="not the configured torch.bfloat16"):
        one_layer_zeroer(torch.ones(2, 3, 4, 1, 4), cache_dtype="bf16")
    with pytest.raises(ValueError, match="must each be contiguous"):
        one_layer_zeroer(torch.ones(3, 2, 4, 1, 4).transpose(0, 1))
    with pytest.raises(ValueError, match="3 kernel blocks of 2 tokens do not form whole manager blocks of 4"):
        one_layer_zeroer(torch.ones(2, 3, 2, 1, 4), kernel_block_size=2)


@pytest.mark.parametrize("use_triton", [False, pytest.param(True, marks=pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton not installed"))])
def test_zeroer_without_layers_is_a_no_op(use_triton):
    # a cache that no attention group names is not the zeroer's; on CPU (no interpreter) a
    # Triton launch would raise, so use_triton=True also shows that nothing is launched
    other = torch.ones(2, 3, 4, 1, 4)
    zeroer = KVBlockZeroer("cpu", use_triton=use_triton)
    zeroer.init_meta([], [], "auto", set(), {layer(0): SimpleNamespace(kv_cache=other)})
    assert zeroer.views == [] and zeroer.num_blocks == 0 and zeroer.seg_table is None
    zeroer.zero_block_ids([1, 2])  # no cache: no id is out of range
    zeroer.zero_block_ids(torch.tensor([7]))
    assert bool((other == 1).all())


# ----------------------------------------------------------------------------- binding

def test_bind_kv_cache_orders_by_layer_index_not_name():
    kv = {layer(i): torch.full((1,), float(i)) for i in (10, 2, 0, 1)}
    context = {name: SimpleNamespace(kv_cache=None) for name in kv}
    runner = [torch.zeros(1)]  # stale contents are replaced
    bind_kv_cache(kv, context, runner)
    assert [int(t) for t in runner] == [0, 1, 2, 10]
    assert all(context[name].kv_cache is kv[name] for name in kv)


def test_bind_kv_cache_two_modules_per_layer_keep_their_order():
    names = ["model.layers.1.encoder_attn.attn", "model.layers.0.self_attn.attn",
             "model.layers.1.self_attn.attn", "model.layers.0.encoder_attn.attn"]
    kv = {n: torch.tensor([k]) for k, n in enumerate(names)}
    context = {n: SimpleNamespace() for n in names}
    runner: list[torch.Tensor] = []
    bind_kv_cache(kv, context, runner, num_attn_module=2)
    assert [int(t) for t in runner] == [1, 3, 0, 2]
    with pytest.raises(ValueError, match=r"layer index 1 has 2 attention modules .*num_attn_module=1"):
        bind_kv_cache(kv, context, [])


def test_bind_kv_cache_errors():
    with pytest.raises(ValueError, match="'model.lm_head.attn' must hold exactly one layer index"):
        bind_kv_cache({"model.lm_head.attn": torch.zeros(1)}, {}, [])
    with pytest.raises(ValueError, match="found \\[1, 2\\]"):
        bind_kv_cache({"model.layers.1.experts.2.attn": torch.zeros(1)}, {}, [])
    with pytest.raises(ValueError, match="missing from the forward context.*layers.3"):
        bind_kv_cache({layer(3): torch.zeros(1)}, {}, [])


# ----------------------------------------------------------------------------- KV sharing

def sharing_groups():
    spec = AttentionSpec(16, 2, 8, torch.float16)
    return [KVCacheGroupSpec([layer(0), layer(1)], spec), KVCacheGroupSpec([layer(2)], spec)]


def test_kv_sharing_layers_join_their_targets_group():
    groups, runner_only = sharing_groups(), set()
    shared = {layer(3): layer(2), layer(4): layer(0)}
    add_kv_sharing_layers_to_kv_cache_groups(shared, groups, runner_only)
    assert groups[0].layer_names == [layer(0), layer(1), layer(4)]
    assert groups[1].layer_names == [layer(2), layer(3)]
    assert runner_only == {layer(3), layer(4)}
    add_kv_sharing_layers_to_kv_cache_groups(shared, groups)  # again: nothing changes
    assert groups[1].layer_names == [layer(2), layer(3)]


def test_kv_sharing_unknown_or_chained_target_is_an_error():
    groups = sharing_groups()
    with pytest.raises(ValueError, match=r"'model.layers.5.self_attn.attn' shares the KV cache of "
                                         r"'model.layers.9.self_attn.attn'"):
        add_kv_sharing_layers_to_kv_cache_groups({layer(5): layer(9)}, groups)
    with pytest.raises(ValueError, match="layers.4.*layers.3.*owns no cache"):  # a chain: 4 -> 3 -> 2
        add_kv_sharing_layers_to_kv_cache_groups({layer(3): layer(2), layer(4): layer(3)}, groups)
    assert groups[1].layer_names == [layer(2)]  # nothing added on error


# ----------------------------------------------------------------------------- block sizes

class Flash:
    @staticmethod
    def get_supported_kernel_block_sizes():
        return [MultipleOf(16)]


class Fixed:
    @staticmethod
    def get_supported_kernel_block_sizes():
        return [16, 32]


class Tiny:
    @classmethod
    def get_supported_kernel_block_sizes(cls):
        return [8]


def test_select_common_block_size():
    assert select_common_block_size(32, [Flash, Fixed]) == 32  # manager size itself
    assert select_common_block_size(64, [Flash, Fixed]) == 32  # largest common divisor size
    assert select_common_block_size(48, [Flash, Fixed]) == 16  # 32 does not divide 48
    assert select_common_block_size(256, [Flash]) == 256
    assert select_common_block_size(24, [Tiny]) == 8
    assert select_common_block_size(12, []) == 12


def test_select_common_block_size_error_names_sizes():
    with pytest.raises(ValueError, match=r"block size 16 .*Flash: \[MultipleOf\(base=16\)\]; Tiny: \[8\]"):
        select_common_block_size(16, [Flash, Tiny])
    with pytest.raises(ValueError, match="block size 8 .*Fixed: \\[16, 32\\]"):
        select_common_block_size(8, [Fixed])
    with pytest.raises(ValueError, match="positive base"):
        MultipleOf(0)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 512), sizes=st.lists(st.lists(st.one_of(st.integers(1, 64), st.builds(MultipleOf, st.integers(1, 64))),
                                                      min_size=1, max_size=3), max_size=3))
def test_select_common_block_size_is_the_largest_common_divisor(m, sizes):
    backends = [type(f"B{i}", (), {"get_supported_kernel_block_sizes": staticmethod(lambda s=s: s)})
                for i, s in enumerate(sizes)]
    ok = lambda n: all(any(n % s.base == 0 if isinstance(s, MultipleOf) else n == s for s in ss) for ss in sizes)
    common = [d for d in range(1, m + 1) if m % d == 0 and ok(d)]
    if not common:
        with pytest.raises(ValueError, match=f"block size {m} "):
            select_common_block_size(m, backends)
    else:
        assert select_common_block_size(m, backends) == max(common)


def test_prepare_kernel_block_sizes_per_group():
    spec64, spec16 = AttentionSpec(64, 8, 128, torch.bfloat16), AttentionSpec(16, 8, 128, torch.bfloat16)
    config = KVCacheConfig(100, [KVCacheGroupSpec([layer(0)], spec64), KVCacheGroupSpec([layer(1)], spec16)])
    attn_groups = [[AttentionGroup(Flash, [layer(0)], spec64), AttentionGroup(Fixed, [layer(0)], spec64)],
                   [AttentionGroup(Flash, [layer(1)], spec16, 1)]]
    assert prepare_kernel_block_sizes(config, attn_groups) == [32, 16]
    with pytest.raises(ValueError, match="1 lists of attention groups for 2 KV-cache groups"):
        prepare_kernel_block_sizes(config, attn_groups[:1])


def test_attention_spec_page_size():
    assert AttentionSpec(16, 8, 128, torch.bfloat16).page_size_bytes == 2 * 16 * 8 * 128 * 2


# ----------------------------------------------------------------------------- memory

def test_request_memory():
    snap = MemorySnapshot(total=80 * GiB, free=79 * GiB)
    assert snap.used == 1 * GiB
    assert request_memory(snap, CacheConfig(gpu_memory_utilization=0.9)) == int(80 * GiB * 0.9)
    assert request_memory(MemorySnapshot(10 * GiB, 10 * GiB), CacheConfig(gpu_memory_utilization=1.0)) == 10 * GiB


def test_request_memory_errors():
    busy = MemorySnapshot(total=80 * GiB, free=40 * GiB)
    with pytest.raises(ValueError, match=r"\(40.00 GiB\) is less than the requested 72.00 GiB"):
        request_memory(busy, CacheConfig(gpu_memory_utilization=0.9))


@pytest.mark.skipif(not os.path.exists("/proc/meminfo"), reason="no /proc/meminfo")
def test_memory_snapshot_measures_cpu():
    snap = MemorySnapshot.measure("cpu")
    assert 0 < snap.free <= snap.total and snap.used == snap.total - snap.free


# ----------------------------------------------------------------------------- SP

def test_is_residual_scattered_for_sp():
    sp4 = ParallelConfig(tensor_parallel_size=4, enable_sequence_parallel=True)
    assert is_residual_scattered_for_sp(sp4, 8192)
    assert not is_residual_scattered_for_sp(sp4, 8190)  # uneven: stays replicated
    assert is_residual_scattered_for_sp(SimpleNamespace(parallel=sp4), 12)  # an EngineConfig-like
    assert not is_residual_scattered_for_sp(ParallelConfig(tensor_parallel_size=4), 8192)  # SP off
    assert not is_residual_scattered_for_sp(ParallelConfig(enable_sequence_parallel=True), 8192)  # tp=1


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([np.int32, np.int64, np.float32, np.bool_]),
                          st.integers(0, 3), st.integers(0, 5), st.booleans()), max_size=8))
def test_step_inputs_pack_into_one_buffer(specs):
    """to_device_all's one buffer: every array back with its dtype, shape and values, each at a
    16-byte aligned start, whatever its strides (numpy gives a size-1 array stride 0)."""
    from longserve.host_to_device import pack, to_device, unpack
    arrays = []
    for dtype, rows, cols, strided in specs:
        a = (np.arange(rows * cols * 2) % 7).astype(dtype).reshape(rows, cols * 2)
        a = a[:, ::2] if strided else a[:, :cols]
        stride0 = rows == 3 and cols > 0  # one element, stride 0
        arrays.append(np.lib.stride_tricks.as_strided(a[:1, :1], (1,), (0,)) if stride0 else a)
    ts = [to_device(a, "cpu") for a in arrays]
    buf, starts = pack(ts, pin=False)
    assert all(s % 16 == 0 for s in starts)
    for a, t in zip(arrays, unpack(buf, ts, starts)):
        assert t.dtype == to_device(a, "cpu").dtype and tuple(t.shape) == a.shape
        assert np.array_equal(t.numpy(), a)
