"""Runs the model for one rank: KV cache set-up, one step's forward, sampling, CUDA graphs."""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from longserve.attention.backends import Attention, TorchAttentionBackend, TritonAttentionBackend
from longserve.attention.kv_cache_spec import (AttentionGroup, AttentionSpec, KVCacheConfig,
                                               KVCacheGroupSpec)
from longserve.attention.metadata import AttentionMetadata, PagedPart
from longserve.config import EngineConfig
from longserve.distributed.parallel_state import ParallelState
from longserve.host_to_device import to_device
from longserve.kv_transfer.base import build_worker_connector, connector_output
from longserve.kv_transfer.utils import KVConnectorOutput
from longserve.models.loader import build_model
from longserve.models.moe import FusedMoE
from longserve.sampling_params import SamplingParams
from longserve.step_plan import ScheduledRequest, SchedulerOutput
from longserve.worker.block_table import BlockIdList
from longserve.worker.cp_utils import PCPManager, check_attention_cp_compatibility
from longserve.worker.dp_step import run_coordinated, run_dummy_step
from longserve.worker.piecewise_graphs import PiecewiseGraphs, piecewise_unsupported
from longserve.worker.sampler import (Sampler, apply_token_bitmask, logit_bias_arrays,
                                      prompt_logprobs)
from longserve.worker.step_inputs import (CPLayout, StepInputs, build_block_table, prepare_step,
                                          step_rows)
from longserve.worker.utils import (KVBlockZeroer, add_kv_sharing_layers_to_kv_cache_groups,
                                    bind_kv_cache, is_residual_scattered_for_sp,
                                    prepare_kernel_block_sizes)

logger = logging.getLogger(__name__)
# LONGSERVE_PIECEWISE: "off" runs steps with prefill eagerly even with CUDA graphs; "eager"
# runs them through the piecewise runner with its graphs off (CPU tests of that path)
PIECEWISE_MODE = "LONGSERVE_PIECEWISE"


@dataclass
class RunnerRequest:
    block_ids: BlockIdList
    sampling_params: SamplingParams | None
    logit_bias: tuple | None = None  # sampler.logit_bias_arrays, made once


class SampledTokens:
    """A step's sampled ids on their way to the host: a non-blocking copy into pinned memory,
    queued behind the step's kernels; tolist() waits for that copy alone."""

    def __init__(self, tokens: torch.Tensor):
        self.event = None
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = tokens

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


@dataclass
class ModelRunnerOutput:
    sampled: dict[str, int]
    logprobs: dict[str, dict[int, float]]
    kv_connector_output: KVConnectorOutput | None = None
    prompt_logprobs: dict[str, list[tuple[int, dict[int, float]]]] = field(default_factory=dict)
    # the sampled ids while they are still on their way (request ids, ids); see resolve()
    pending: tuple[list[str], SampledTokens] | None = None
    deferred: tuple | None = None  # (sampling requests, logits): waits for a grammar bitmask

    def resolve(self) -> ModelRunnerOutput:
        """Wait for the sampled ids and fill `sampled`."""
        if self.pending is not None:
            req_ids, tokens = self.pending
            self.sampled, self.pending = dict(zip(req_ids, tokens.tolist())), None
        return self


def choose_backend(config: EngineConfig, device: torch.device):
    name = config.attention_backend
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"attention backend {name!r} needs a CUDA device "
                         "(or TRITON_INTERPRET=1 to run its kernels on the CPU)")
    return TritonAttentionBackend()


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
        self.block_size = config.cache.block_size
        par = config.parallel
        self.kernel_block_size = self._kernel_block_size()
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
        self.sampler = Sampler(config.seed, device)
        self.zeroer = KVBlockZeroer(device)
        self.kv_caches: list[torch.Tensor] = []
        self.kv_cache_dict: dict[str, torch.Tensor] = {}
        self.graphs: dict[int, tuple] = {}
        self.piecewise: PiecewiseGraphs | None = None  # steps with prefill (capture_cudagraphs)
        if os.environ.get(PIECEWISE_MODE) == "eager":
            self.piecewise = self._build_piecewise(use_graphs=False)
        # expert layers shared by DP ranks (or split into micro-batches): every step's shape
        # is agreed on with the other DP ranks (worker/dp_step.py)
        self.coordinated = config.model.is_moe and (par.data_parallel_size > 1 or par.enable_dbo)
        # expert layers span the DP ranks: the engine core executes a plan only while every DP
        # rank steps (a wave), so an empty plan here is a dummy step
        self.dp_lockstep = config.dp_lockstep
        self.num_dbo_steps = 0  # steps run as two micro-batches
        self.kv_connector = build_worker_connector(config, ps, device)  # None without KV transfer
        # asynchronous scheduling: the last step's sampled ids on the device, the row of each
        # request in them and the rows' request ids; the next step's PLACEHOLDER inputs are
        # filled from these
        self.async_scheduling = config.scheduler.async_scheduling
        self.last_sampled: tuple[torch.Tensor, dict[str, int], list[str]] | None = None
        self._batch: tuple | None = None  # _batch_params
        self._table: tuple[list[str], np.ndarray] | None = None  # _block_table
        # prompt logprobs take logits of this many rows at a time: [rows, vocab] stays ~64 MB
        self.prompt_logprob_rows_per_slice = max(1, (1 << 24) // config.model.vocab_size)

    # ---- KV cache -----------------------------------------------------------------------
    def _kv_cache_groups(self) -> tuple[KVCacheConfig, list[list[AttentionGroup]], set[str]]:
        first = next(iter(self.layers.values()))
        spec = AttentionSpec(self.block_size, first.num_kv_heads, first.head_dim, self.kv_dtype)
        owners = [n for n, a in self.layers.items() if a.kv_sharing_target is None]
        group = KVCacheGroupSpec(list(owners), spec)
        shared = {n: f"model.layers.{a.kv_sharing_target}.self_attn.attn"
                  for n, a in self.layers.items() if a.kv_sharing_target is not None}
        runner_only: set[str] = set()
        add_kv_sharing_layers_to_kv_cache_groups(shared, [group], runner_only)
        attn_groups = [[AttentionGroup(type(self.backend), group.layer_names, spec, 0)]]
        return KVCacheConfig(0, [group]), attn_groups, runner_only

    def _kernel_block_size(self) -> int:
        kv_config, attn_groups, _ = self._kv_cache_groups()
        return prepare_kernel_block_sizes(kv_config, attn_groups)[0]

    def kv_bytes_per_block(self) -> int:
        owners = [a for a in self.layers.values() if a.kv_sharing_target is None]
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * self.kv_dtype.itemsize
                   for a in owners)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """[2, num_blocks * k, kernel_block_size, Hkv, D] per layer that owns a cache."""
        kv_config, attn_groups, runner_only = self._kv_cache_groups()
        k = self.block_size // self.kernel_block_size
        caches = {}
        for name, a in self.layers.items():
            if a.kv_sharing_target is None:
                caches[name] = torch.empty(2, num_blocks * k, self.kernel_block_size, a.num_kv_heads,
                                           a.head_dim, dtype=self.kv_dtype, device=self.device)
        for name, a in self.layers.items():
            if a.kv_sharing_target is not None:
                caches[name] = caches[f"model.layers.{a.kv_sharing_target}.self_attn.attn"]
        bind_kv_cache(caches, self.layers, self.kv_caches)
        self.kv_cache_dict = caches
        self.zeroer.init_meta(attn_groups[0], [self.kernel_block_size], "auto", runner_only,
                              self.layers)

    def kv_scales(self) -> dict[str, torch.Tensor] | None:
        """An FP8 cache's per-head scales by layer (None: the cache holds the model's dtype)."""
        if self.kv_dtype != torch.float8_e4m3fn:
            return None
        return {name: a.kv_scale for name, a in self.layers.items()}

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
        self._table = self._batch = None
        self.kv_caches.clear()
        for a in self.layers.values():
            a.kv_cache = None
        torch.cuda.empty_cache()
        return peak

    # ---- one step -----------------------------------------------------------------------
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
        if profile:  # every token's slot in block 0: the table only needs to be wide enough
            table = build_block_table([[0] * (len(out.requests[0].token_ids) // self.block_size + 1)])
        else:
            table = self._block_table(out, rows.req_ids)
        inp = prepare_step(rows, table, self.layout, self.ps, self.pcp, self.device, self.backend)
        if inp.placeholder_rows is not None:
            self.fill_placeholders(rows.req_ids, inp)
        if self.coordinated:
            hidden = run_coordinated(self, rows, table, inp)
        else:
            hidden = self.run_model(inp)
        if self.pcp is not None:
            hidden = self.pcp.restore_hidden_states(hidden, inp.num_local_tokens)
        return self.sample(out, hidden, inp)

    def _block_table(self, out: SchedulerOutput, ids: list[str]) -> np.ndarray:
        """The step's block table [R, width]. A step with the rows of the step before (a run of
        decode steps) patches that table's changed rows: the new blocks of plain decodes, and
        every other request's row."""
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
                self._batch = None
                self.requests[r.req_id] = RunnerRequest(BlockIdList(r.block_ids), r.sampling_params,
                                                        logit_bias_arrays(r.sampling_params))
            else:
                self.requests[r.req_id].block_ids.extend(r.block_ids)

    def run_model(self, inp: StepInputs) -> torch.Tensor:
        n = inp.num_local_tokens
        if inp.is_pure_decode and self.graph_size(n) is not None:
            return self.replay_graph(inp)
        if not inp.is_pure_decode and self.piecewise is not None and self.piecewise.fits(n):
            return self.piecewise.run(inp.input_ids, inp.positions, inp.meta)
        sp = is_residual_scattered_for_sp(self.config, n)
        return self.model(inp.input_ids, inp.positions, inp.meta, sp)

    def fill_placeholders(self, req_ids: list[str], inp: StepInputs) -> None:
        """Asynchronous scheduling: the plan's PLACEHOLDER ids are the tokens the previous
        step sampled; copy them on the device (the host never saw them)."""
        sampled, row_of, prev = self.last_sampled or (None, {}, [])
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

    def sample(self, out: SchedulerOutput, hidden, inp: StepInputs) -> ModelRunnerOutput | None:
        """Sample on the first rank of the model group (the first PCP rank's first TP rank);
        the output's ids stay pending until resolve(). Asynchronous scheduling keeps them on
        the device for the next step, on every rank of the model group. A step with a
        structured request leaves its logits in `output.deferred`: the engine core builds the
        grammar bitmask while the forward runs and calls sample_deferred()."""
        d = out.decodes
        sampling = (out.sampling_req_ids(),
                    d.seed_offsets + [r.seed_offset for r in out.requests if r.sample])
        output, logits = None, None
        _, _, _, structured, _, greedy = self._batch_params(sampling[0])
        if self.ps.pcp.rank_in_group == 0:  # the first PCP rank's TP group takes the logits
            output, logits = self._logits_here(out.requests, hidden, inp, greedy)
        if logits is not None and structured:
            output.deferred = (sampling, logits)
        else:
            self._finish_sampling(output, sampling, logits)
        return output

    def sample_deferred(self, output: ModelRunnerOutput, bitmask: tuple) -> None:
        """bitmask: (int32 [R, ceil(V / 32)] on the host, the R sampling rows it masks)."""
        (sampling, logits), output.deferred = output.deferred, None
        apply_token_bitmask(logits, *bitmask)
        self._finish_sampling(output, sampling, logits)

    def _logits_here(self, reqs, hidden, inp, greedy: bool):
        """(output, the rows' logits) on the first TP rank; greedy: their argmax ids instead."""
        prompt_lps = {}
        if inp.prompt_logprob_rows is not None:  # every TP rank joins the logits gathers
            prompt_lps = self.prompt_logprobs(reqs, hidden, inp.prompt_logprob_rows)
        rows = hidden[inp.logits_indices]
        logits = self.model.greedy_tokens(rows) if greedy else self.model.compute_logits(rows)
        if logits is None:
            return None, None
        return ModelRunnerOutput({}, {}, prompt_logprobs=prompt_lps), logits

    def _batch_params(self, ids: list[str]) -> tuple:
        """(params, logit biases, row of each id, any structured, any logprobs, plain greedy)
        of the sampling rows; kept while the rows stay the same (a run of decode steps pays for
        it once). Plain greedy: every row's token is the argmax, nothing else is asked."""
        if self._batch is None or self._batch[0] != ids:
            params = [self.requests[i].sampling_params for i in ids]
            biases = [self.requests[i].logit_bias for i in ids]
            structured = any(p.structured_outputs for p in params)
            logprobs = any(p.logprobs is not None for p in params)
            greedy = (not structured and not logprobs and all(b is None for b in biases)
                      and all(p.greedy for p in params))
            self._batch = (ids, params, biases, {rid: i for i, rid in enumerate(ids)},
                           structured, logprobs, greedy)
        return self._batch[1:]

    def _finish_sampling(self, output, sampling, logits) -> None:
        """logits: the rows' logits on the first TP rank (plain greedy rows: their argmax ids,
        as _logits_here took them)."""
        ids, seed_offsets = sampling
        tokens = None
        params, biases, row_of, _, any_logprobs, greedy = self._batch_params(ids)
        if logits is not None:
            tokens = logits if greedy else self.sampler(logits, params, seed_offsets, biases)
            output.pending = (ids, SampledTokens(tokens))
            if any_logprobs:  # these need the ids now
                lps = self.sampler.logprobs(logits, params, list(output.resolve().sampled.values()))
                output.logprobs = {i: lp for i, lp in zip(ids, lps) if lp is not None}
        if self.async_scheduling:
            self._keep_sampled(ids, tokens, row_of)

    def _keep_sampled(self, ids: list[str], tokens: torch.Tensor | None,
                      row_of: dict[str, int]) -> None:
        if not ids:
            self.last_sampled = None
            return
        if self.ps.model.world_size > 1:  # every rank embeds the next step's ids
            if tokens is None:
                tokens = torch.empty(len(ids), dtype=torch.int64, device=self.device)
            self.ps.model.broadcast(tokens)
        self.last_sampled = tokens, row_of, ids

    def prompt_logprobs(self, reqs: list[ScheduledRequest], hidden,
                        rows) -> dict[str, list[dict[int, float]]]:
        """Score the step's prompt rows a slice at a time (logits [slice, vocab], not [T, vocab])."""
        asking = [r for r in reqs if r.prompt_logprob_targets]
        targets = [t for r in asking for t in r.prompt_logprob_targets]
        ks = [self.requests[r.req_id].sampling_params.prompt_logprobs
              for r in asking for _ in r.prompt_logprob_targets]
        rows = torch.from_numpy(rows).to(hidden.device)
        entries, step = [], self.prompt_logprob_rows_per_slice
        for a in range(0, len(targets), step):
            logits = self.model.compute_logits(hidden[rows[a:a + step]])
            if logits is not None:
                entries += prompt_logprobs(logits, targets[a:a + step], ks[a:a + step])
        if not entries:  # not the first TP rank
            return {}
        out, at = {}, 0
        for r in asking:
            n = len(r.prompt_logprob_targets)
            out[r.req_id], at = entries[at:at + n], at + n
        return out

    # ---- CUDA graphs: full graphs for decode, piecewise for steps with prefill ---------------
    def capture_cudagraphs(self) -> None:
        """Capture the model's decode forward at bucketed batch sizes (largest first, one pool),
        then the piecewise graphs."""
        max_bs = self.config.scheduler.max_num_seqs
        sizes = sorted({b for b in [1, 2, 4, 8] + list(range(16, max_bs + 1, 16)) if b <= max_bs}
                       | {max_bs})
        max_blocks = -(-self.config.scheduler.max_model_len // (self.block_size * self.layout.cp_world_size))
        width = max_blocks * self.layout.kernel_blocks_per_block
        dev = self.device
        self.static = dict(
            input_ids=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            positions=torch.zeros(max_bs, dtype=torch.int64, device=dev),
            slots=torch.full((max_bs,), -1, dtype=torch.int64, device=dev),
            kv_lens=torch.zeros(max_bs, dtype=torch.int32, device=dev),
            qsl=torch.arange(max_bs + 1, dtype=torch.int32, device=dev),
            table=torch.zeros(max_bs, width, dtype=torch.int32, device=dev))
        pool, t0 = torch.cuda.graph_pool_handle(), time.perf_counter()
        dp = self.ps.dp.world_size > 1  # expert layers: the graph of bs pads every DP rank to bs
        for bs in reversed(sizes):  # (every DP rank captures the same sizes, in this order)
            meta = self._static_decode_meta(bs)
            args = (self.static["input_ids"][:bs], self.static["positions"][:bs], meta, False,
                    bs if dp else None)
            self.model(*args)  # warm up (Triton compile, cuBLAS handles) outside the capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(*args)
            self.graphs[bs] = (graph, hidden, meta)
        torch.cuda.synchronize(dev)
        logger.info("captured %d decode graphs in %.1f s", len(sizes), time.perf_counter() - t0)
        if os.environ.get(PIECEWISE_MODE, "graphs") == "graphs":
            self._capture_piecewise(pool)
        self._compile_attention_variants()
        moe = next((m for m in self.model.modules() if isinstance(m, FusedMoE)), None)
        if moe is not None:  # the expert kernels' variants too
            moe.compile_kernels(self.config.dtype)

    def _compile_attention_variants(self) -> None:
        """The paged kernel's tile variants that eager and mixed steps may pick (not only the
        shapes warm-up steps reach), compiled before serving, on this layer's own cache."""
        layer = next((m for m in self.model.modules() if isinstance(m, Attention)), None)
        if (self.backend.name != "TRITON" or layer is None or layer.kv_cache is None
                or self.ps.cp.world_size > 1):  # CP writes packed partials: other variants
            return
        from longserve.attention.triton_kernels import compile_attention_variants
        t = time.perf_counter()
        s = self.config.scheduler
        n = compile_attention_variants(layer.num_heads, layer.kv_cache[0], layer.kv_cache[1],
                                       layer.kv_scale, self.config.dtype,
                                       s.max_num_batched_tokens, s.max_num_seqs)
        torch.cuda.synchronize(self.device)
        logger.info("ran %d attention tile variants in %.1f s", n, time.perf_counter() - t)

    def _build_piecewise(self, use_graphs: bool) -> PiecewiseGraphs | None:
        reason = piecewise_unsupported(self.config)
        if reason is not None:
            logger.info("steps with prefill run eagerly: %s", reason)
            return None
        return PiecewiseGraphs(self.model, self.max_num_tokens, self.device, use_graphs)

    def _capture_piecewise(self, pool) -> None:
        """Graphs of the layers' dense work for steps with prefill (worker/piecewise_graphs.py),
        after the decode graphs, in their memory pool (replays never overlap)."""
        pw = self._build_piecewise(use_graphs=True)
        if pw is None:
            return
        n = pw.capture(pool)
        self.piecewise = pw
        logger.info("captured %d piecewise graphs (%d buckets up to %d tokens) in %.1f s", n,
                    len(pw.buckets), pw.buckets[-1], pw.capture_s)

    def _static_decode_meta(self, bs: int) -> AttentionMetadata:
        s = self.static
        part = PagedPart(s["qsl"][:bs + 1], s["kv_lens"][:bs], s["table"][:bs], 1,
                         list(range(bs + 1)), [0] * bs)
        return AttentionMetadata(num_decode_tokens=bs, num_tokens=bs, slot_mapping=s["slots"][:bs],
                                 decode=part, ps=self.ps, backend=self.backend)

    def replay_graph(self, inp: StepInputs | None, bs: int | None = None) -> torch.Tensor:
        """Replay the decode graph of bs rows (default: the smallest that holds the step), the
        step's rows first; inp None: every row is padding (an idle DP rank's dummy step)."""
        n = inp.num_local_tokens if inp is not None else 0
        bs = bs or self.graph_size(n)
        graph, hidden, _ = self.graphs[bs]
        s = self.static
        if inp is not None:
            part = inp.meta.decode
            s["input_ids"][:n].copy_(inp.input_ids)
            s["positions"][:n].copy_(inp.positions)
            s["slots"][:n].copy_(inp.meta.slot_mapping)
            s["kv_lens"][:n].copy_(part.kv_lens)
            s["table"][:n, :part.block_table.shape[1]].copy_(part.block_table)
        s["slots"][n:bs].fill_(-1)  # padding rows write nowhere and read nothing
        s["kv_lens"][n:bs].fill_(0)
        graph.replay()
        return hidden[:n]

    def graph_size(self, n: int) -> int | None:
        """The decode graph that holds n tokens, None if none does."""
        return min((b for b in self.graphs if b >= n), default=None)
