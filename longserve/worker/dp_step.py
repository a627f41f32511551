"""The steps of models with expert layers under DP, or with dual-batch overlap: an agreed shape and
decode graph, dummy steps of idle ranks, DBO (docs/architecture.md, 'Data parallelism, ...')."""
from __future__ import annotations

import numpy as np
import torch

from longserve.models.dbo import run_dual_batch
from longserve.step_plan import ScheduledRequest, SchedulerOutput
from longserve.worker.dp_utils import coordinate_batch_across_dp

from longserve.worker.step_inputs import StepInputs, StepRows, build_block_table, prepare_step, step_rows
from longserve.worker.utils import is_residual_scattered_for_sp

NO_GRAPH, FULL_GRAPH = 0, 2  # coordinate_batch_across_dp's CUDA-graph modes


def wants_dbo(parallel, inp: StepInputs) -> bool:
    """vLLM's thresholds: decode-only steps of >= 32 tokens, steps with a prefill of >= 512."""
    threshold = (parallel.dbo_decode_token_threshold if inp.is_pure_decode
                 else parallel.dbo_prefill_token_threshold)
    return parallel.enable_dbo and inp.num_local_tokens >= threshold


def balanced_split(tokens_per_request: np.ndarray) -> int:
    """k in [1, R): requests [:k] and [k:] as two micro-batches, the larger as small as can be."""
    before = np.cumsum(tokens_per_request)[:-1]
    return int(np.argmin(np.maximum(before, before[-1] + tokens_per_request[-1] - before))) + 1


def run_coordinated(runner, rows: StepRows, table: np.ndarray,
                    inp: StepInputs, dummy: bool = False) -> torch.Tensor:
    """The forward of a step whose shape the DP ranks agree on -> hidden [T, hidden]; when every rank
    can, all replay the decode graph of the agreed size (a dummy step with no real row)."""
    par, ps = runner.config.parallel, runner.ps
    n = inp.num_local_tokens
    per_req = rows.n
    # DBO's micro-batches run eagerly: a decode step that a CUDA graph holds replays it (faster)
    graphed = inp.is_pure_decode and runner.graphs.size(n) is not None
    allow_ubatch = wants_dbo(par, inp) and len(per_req) >= 2 and not graphed
    graph = runner.graphs.size(n) if (inp.is_pure_decode or dummy) and not allow_ubatch else None
    padded = n if graph is None else graph
    if allow_ubatch:  # both micro-batches are padded to the larger one's size
        k = balanced_split(per_req)
        padded = 2 * int(max(per_req[:k].sum(), per_req[k:].sum()))
    should_ubatch, after_padding, mode = coordinate_batch_across_dp(
        n, allow_ubatch, True, par, padded, inp.is_pure_decode, per_req,
        NO_GRAPH if graph is None else FULL_GRAPH, dp_group=ps.dp)
    dp_pad = int(after_padding[ps.layout.dp_rank])
    if mode == FULL_GRAPH:
        return runner.graphs.replay(None if dummy else inp, dp_pad)
    if not should_ubatch:
        sp = is_residual_scattered_for_sp(runner.config, n)
        return runner.model(inp.input_ids, inp.positions, inp.meta, sp, dp_pad)
    ubatches, split = [], int(per_req[:k].sum())
    for (a, b), tokens in (((0, k), slice(0, split)), ((k, len(per_req)), slice(split, n))):
        ub = prepare_step(rows.part(a, b), table[a:b], runner.layout, ps, None, runner.device, runner.backend)
        # the step's ids, not the micro-batch's own: placeholders are filled in there
        ubatches.append((inp.input_ids[tokens], ub.positions, ub.meta))
    runner.num_dbo_steps += 1
    return run_dual_batch(runner.model, ubatches, dp_pad // 2)


def run_dummy_step(runner) -> None:
    """A one-token forward with no KV write (or a graph replay with no real row): an idle DP rank
    joins the expert collectives."""
    rows = step_rows(SchedulerOutput([ScheduledRequest("dp-dummy", [0], 0, [0], True, False)]))
    table = build_block_table([[0]])
    inp = prepare_step(rows, table, runner.layout, runner.ps, None, runner.device, runner.backend)
    inp.meta.slot_mapping.fill_(-1)
    run_coordinated(runner, rows, table, inp, dummy=True)
