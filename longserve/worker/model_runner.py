"""Runs the model for one rank: KV cache set-up, one step's inputs and forward."""
from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

from longserve.attention.backends import TorchAttentionBackend, TritonAttentionBackend
from longserve.attention.kv_cache_spec import AttentionGroup, AttentionSpec, KVCacheConfig, KVCacheGroupSpec
from longserve.config import EngineConfig
from longserve.distributed.parallel_state import ParallelState
from longserve.host_to_device import to_device
from longserve.kv_transfer.base import build_worker_connector, connector_output
from longserve.models.loader import build_model
from longserve.sampling_params import SamplingParams
from longserve.step_plan import ScheduledRequest, SchedulerOutput
from longserve.worker.block_table import BlockIdList
from longserve.worker.cp_utils import PCPManager, check_attention_cp_compatibility
from longserve.worker.cuda_graphs import DecodeGraphs, capture_sizes, compile_kernel_variants
from longserve.worker.dp_step import run_coordinated, run_dummy_step
from longserve.worker.piecewise_graphs import PIECEWISE_MODE, PiecewiseGraphs, build_piecewise
from longserve.worker.sampler import logit_bias_arrays
from longserve.worker.step_inputs import CPLayout, StepInputs, build_block_table, prepare_step, step_rows
from longserve.worker.step_sampler import ModelRunnerOutput, StepSampler
from longserve.worker.utils import (KVBlockZeroer, add_kv_sharing_layers_to_kv_cache_groups,
                                    bind_kv_cache, is_residual_scattered_for_sp,
                                    prepare_kernel_block_sizes)


@dataclass
class RunnerRequest:
    block_ids: BlockIdList
    sampling_params: SamplingParams | None
    logit_bias: tuple | None = None  # sampler.logit_bias_arrays, made once


def choose_backend(config: EngineConfig, device: torch.device):
    name = config.attention_backend
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend {name!r} needs a CUDA device "
                         "(or TRITON_INTERPRET=1 to run its kernels on the CPU)")
    return TritonAttentionBackend(device, config.dtype, config.model.head_dim)


class ModelRunner:
    def __init__(self, config: EngineConfig, ps: ParallelState, device: torch.device):
        self.config, self.ps, self.device = config, ps, device
        self.backend = choose_backend(config, device)
        check_attention_cp_compatibility(config.parallel, [type(self.backend)])
        self.kv_dtype = config.kv_dtype  # the model's dtype, or float8 e4m3 (kv_cache_dtype="fp8")
        self.model = build_model(config.model, ps, config.dtype, str(device), config.load_format,
                                 config.seed, config.parallel.enable_expert_parallel,
                                 fp8_kv=self.kv_dtype == torch.float8_e4m3fn)
        self.layers = {a.layer_name: a for a in self.model.attention_layers()}
        # layers that own a cache, and each layer that reads another's (kv_sharing_target) -> owner
        self.kv_owners = {n: a for n, a in self.layers.items() if a.kv_sharing_target is None}
        self.kv_targets = {n: f"model.layers.{a.kv_sharing_target}.self_attn.attn"
                           for n, a in self.layers.items() if a.kv_sharing_target is not None}
        self.block_size = config.cache.block_size
        par = config.parallel
        self.kernel_block_size = prepare_kernel_block_sizes(*self._kv_cache_groups()[:2])[0]
        self.layout = CPLayout(self.block_size, par.cp_world_size, ps.layout.cp_rank,
                               par.cp_kv_cache_interleave_size,
                               self.block_size // self.kernel_block_size)
        self.max_num_tokens = config.scheduler.max_num_batched_tokens
        self.pcp = None
        if par.prefill_context_parallel_size > 1:
            self.pcp = PCPManager(par.prefill_context_parallel_size, ps.pcp.rank_in_group,
                                  config.scheduler.max_num_seqs,
                                  2 * self.max_num_tokens + 4 * par.prefill_context_parallel_size
                                  * config.scheduler.max_num_seqs, device, pcp_group=ps.pcp)
        self.requests: dict[str, RunnerRequest] = {}
        self.sampling = StepSampler(self.model, ps, self.requests, config, device)
        self.zeroer = KVBlockZeroer(device)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache_dict: dict[str, torch.Tensor] = {}
        self.graphs = DecodeGraphs(self.model, ps, self.backend, device)  # pure decode steps
        self.piecewise: PiecewiseGraphs | None = None  # steps with prefill (capture_cudagraphs)
        if os.environ.get(PIECEWISE_MODE) == "eager":
            self.piecewise = build_piecewise(config, self.model, device)
        # expert layers over DP ranks (or micro-batches): each step's shape is agreed (dp_step.py)
        self.coordinated = config.model.is_moe and (par.data_parallel_size > 1 or par.enable_dbo)
        # expert layers span the DP ranks: the core steps in waves, so an empty plan is a dummy step
        self.dp_lockstep = config.dp_lockstep
        self.num_dbo_steps = 0  # steps run as two micro-batches
        self.kv_connector = build_worker_connector(config, ps, device)  # None without KV transfer
        self._table: tuple[list[str], np.ndarray] | None = None  # _block_table

    def _kv_cache_groups(self) -> tuple[KVCacheConfig, list[list[AttentionGroup]], set[str]]:
        first = next(iter(self.layers.values()))
        spec = AttentionSpec(self.block_size, first.num_kv_heads, first.head_dim, self.kv_dtype)
        group = KVCacheGroupSpec(list(self.kv_owners), spec)
        runner_only: set[str] = set()
        add_kv_sharing_layers_to_kv_cache_groups(self.kv_targets, [group], runner_only)
        attn_groups = [[AttentionGroup(type(self.backend), group.layer_names, spec, 0)]]
        return KVCacheConfig(0, [group]), attn_groups, runner_only

    def kv_bytes_per_block(self) -> int:
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * self.kv_dtype.itemsize
                   for a in self.kv_owners.values())

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """[2, num_blocks * k, kernel_block_size, Hkv, D] per layer that owns a cache."""
        _, attn_groups, runner_only = self._kv_cache_groups()
        k = self.block_size // self.kernel_block_size
        caches = {name: torch.empty(2, num_blocks * k, self.kernel_block_size, a.num_kv_heads, a.head_dim,
                                    dtype=self.kv_dtype, device=self.device)
                  for name, a in self.kv_owners.items()}
        caches.update({name: caches[target] for name, target in self.kv_targets.items()})
        bind_kv_cache(caches, self.layers, self.kv_caches)
        self.kv_cache_dict = caches
        self.zeroer.init_meta(attn_groups[0], [self.kernel_block_size], "auto", runner_only, self.layers)

    def kv_scales(self) -> dict[str, torch.Tensor] | None:
        """An FP8 cache's per-head scales by layer (None: the cache holds the model's dtype)."""
        fp8 = self.kv_dtype == torch.float8_e4m3fn
        return {name: a.kv_scale for name, a in self.layers.items()} if fp8 else None

    @torch.no_grad()
    def profile_peak_memory(self) -> int:
        """Run one full-budget prefill with a one-block cache; the activation peak in bytes."""
        self.allocate_kv_cache(1)
        n = self.max_num_tokens
        req = ScheduledRequest("profile", [0] * n, 0, [0], True, True, SamplingParams(max_tokens=1))
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self.execute(SchedulerOutput([req], [], []), profile=True)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.requests.clear()
        self._table = self.sampling.batch = None
        self.kv_caches.clear()
        for a in self.layers.values():
            a.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    @torch.no_grad()
    def execute(self, out: SchedulerOutput, profile: bool = False) -> ModelRunnerOutput | None:
        kv = None if profile else self.kv_connector
        if kv is not None:  # before new blocks are zeroed: offload saves evicted blocks first
            kv.start_load_kv(out.kv_connector_metadata)
        result = self._execute(out, profile)
        if kv is not None:
            kv.wait_for_save()
            result = result or ModelRunnerOutput({}, {})
            result.kv_connector_output = connector_output(kv, out.finished_req_ids)
        return result

    def _execute(self, out: SchedulerOutput, profile: bool) -> ModelRunnerOutput | None:
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        if out.new_block_ids and not profile:
            self.zeroer.zero_block_ids(out.new_block_ids)
        self._add_blocks(out)
        if out.is_empty:
            if self.dp_lockstep:  # the other DP ranks run a step this rank must join
                run_dummy_step(self)
            return ModelRunnerOutput({}, {})
        rows = step_rows(out)
        # profile: every token's slot in block 0, the table only needs to be wide enough
        table = (build_block_table([[0] * (len(out.requests[0].token_ids) // self.block_size + 1)])
                 if profile else self._block_table(out, rows.req_ids))
        inp = prepare_step(rows, table, self.layout, self.ps, self.pcp, self.device, self.backend)
        if inp.placeholder_rows is not None:
            self.fill_placeholders(rows.req_ids, inp)
        hidden = run_coordinated(self, rows, table, inp) if self.coordinated else self.run_model(inp)
        if self.pcp is not None:
            hidden = self.pcp.restore_hidden_states(hidden, inp.num_local_tokens)
        return self.sampling.sample(out, hidden, inp)

    def _block_table(self, out: SchedulerOutput, ids: list[str]) -> np.ndarray:
        """The step's block table [R, width]; with the rows of the step before (a run of decodes)
        only the changed rows are patched: plain decodes' new blocks, every other request's row."""
        if self._table is None or self._table[0] != ids:
            table = build_block_table([self.requests[i].block_ids.view() for i in ids])
        else:
            table, nd = self._table[1], len(out.decodes.req_ids)
            for row in [*out.decodes.new_blocks, *range(nd, len(ids))]:
                blocks = self.requests[ids[row]].block_ids.view()
                if len(blocks) > table.shape[1]:  # (exactly as wide as the longest row)
                    table = np.pad(table, ((0, 0), (0, len(blocks) - table.shape[1])))
                table[row, :len(blocks)] = blocks
                table[row, len(blocks):] = 0  # (a victim readmitted at once starts over)
        self._table = (ids, table)
        return table

    def _add_blocks(self, out: SchedulerOutput) -> None:
        """New requests' state, and the blocks the others were given since the last step."""
        d = out.decodes
        for row, blocks in d.new_blocks.items():
            self.requests[d.req_ids[row]].block_ids.extend(blocks)
        for r in out.requests:
            if r.new:  # (an id may come back as another request: no cached rows hold it)
                self.sampling.batch = None
                self.requests[r.req_id] = RunnerRequest(BlockIdList(r.block_ids), r.sampling_params,
                                                        logit_bias_arrays(r.sampling_params))
            else:
                self.requests[r.req_id].block_ids.extend(r.block_ids)

    def run_model(self, inp: StepInputs) -> torch.Tensor:
        n = inp.num_local_tokens
        if inp.is_pure_decode and self.graphs.size(n) is not None:
            return self.graphs.replay(inp)
        if not inp.is_pure_decode and self.piecewise is not None and self.piecewise.fits(n):
            return self.piecewise.run(inp.input_ids, inp.positions, inp.meta)
        sp = is_residual_scattered_for_sp(self.config, n)
        return self.model(inp.input_ids, inp.positions, inp.meta, sp)

    def fill_placeholders(self, req_ids: list[str], inp: StepInputs) -> None:
        """The plan's PLACEHOLDER ids: the previous step's sampled tokens, copied on the device."""
        sampled, row_of, prev = self.sampling.last_sampled or (None, {}, [])
        k, rows = len(inp.placeholder_rows), inp.placeholder_rows
        if rows[-1] == k - 1 and prev[:k] == req_ids[:k]:  # the first k rows, in the last order
            inp.input_ids[:k] = sampled[:k]  # (a run of decode steps: no index on the host)
            return
        try:
            src = [row_of[req_ids[i]] for i in inp.placeholder_reqs]
        except KeyError as e:
            raise RuntimeError(f"request {e.args[0]} has a placeholder token, but the previous "
                               "step sampled none for it") from None
        rows = to_device(inp.placeholder_rows, self.device)
        inp.input_ids[rows] = sampled[to_device(np.array(src, dtype=np.int64), self.device)]

    def capture_cudagraphs(self) -> None:
        """The decode graphs, then the piecewise graphs in their memory pool (replays never
        overlap), then the kernel variants serving may pick (worker/cuda_graphs.py)."""
        pool = torch.cuda.graph_pool_handle()
        s = self.config.scheduler
        max_blocks = -(-s.max_model_len // (self.block_size * self.layout.cp_world_size))
        self.graphs.capture(capture_sizes(s.max_num_seqs),
                            max_blocks * self.layout.kernel_blocks_per_block, pool)
        if os.environ.get(PIECEWISE_MODE, "graphs") == "graphs":
            self.piecewise = build_piecewise(self.config, self.model, self.device, pool)
        compile_kernel_variants(self.model, self.config, self.ps, self.backend, self.device)
