"""CUDA graphs of pure decode steps, and the kernel variants compiled after capture
(docs/architecture.md, 'CUDA graphs'). Steps with prefill: worker/piecewise_graphs.py."""
from __future__ import annotations

import logging
import time

import torch

from longserve.attention.backends import Attention
from longserve.attention.metadata import AttentionMetadata, PagedPart
from longserve.models.moe import FusedMoE

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes with a graph, ascending (a step replays the smallest that holds it)."""
    return sorted({b for b in [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
                   if b <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    """The decode forward captured at each capture size; a step of n rows replays the
    smallest graph that holds n, its rows first and padding after. None captured: eager."""

    def __init__(self, model, ps, backend, device):
        self.model, self.ps, self.backend, self.device = model, ps, backend, device
        self.graphs: dict[int, tuple] = {}  # batch size -> (graph, hidden states, metadata)
        self.static: dict[str, torch.Tensor] = {}  # the inputs every graph reads

    def capture(self, sizes: list[int], table_width: int, pool) -> None:
        """Largest first, into one memory pool (every DP rank captures the same sizes, in this
        order); table_width: kernel blocks of the longest request."""
        max_bs, dev = sizes[-1], self.device
        i64, i32 = dict(dtype=torch.int64, device=dev), dict(dtype=torch.int32, device=dev)
        self.static = dict(
            input_ids=torch.zeros(max_bs, **i64), positions=torch.zeros(max_bs, **i64),
            slots=torch.full((max_bs,), -1, **i64), kv_lens=torch.zeros(max_bs, **i32),
            qsl=torch.arange(max_bs + 1, **i32), table=torch.zeros(max_bs, table_width, **i32))
        dp = self.ps.dp.world_size > 1  # expert layers: the graph of bs pads every DP rank to bs
        for bs in reversed(sizes):
            ids, pos = self.static["input_ids"][:bs], self.static["positions"][:bs]
            self.model(ids, pos, self._meta(bs), False, bs if dp else None)  # warm up (Triton
            torch.cuda.synchronize(dev)  # compile, cuBLAS handles) outside the capture
            graph = torch.cuda.CUDAGraph()
            meta = self._meta(bs)  # fresh: the step's first layer plans decode inside the graph
            # thread_local: a KV connector's thread may build an NCCL pair group meanwhile
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                hidden = self.model(ids, pos, meta, False, bs if dp else None)
            self.graphs[bs] = (graph, hidden, meta)
        torch.cuda.synchronize(dev)

    def _meta(self, bs: int) -> AttentionMetadata:
        s = self.static
        part = PagedPart(s["qsl"][:bs + 1], s["kv_lens"][:bs], s["table"][:bs], 1,
                         list(range(bs + 1)), [0] * bs)
        return AttentionMetadata(num_decode_tokens=bs, num_tokens=bs, slot_mapping=s["slots"][:bs],
                                 decode=part, ps=self.ps, backend=self.backend)

    def size(self, n: int) -> int | None:
        """The decode graph that holds n tokens, None if none does."""
        return min((b for b in self.graphs if b >= n), default=None)

    def replay(self, inp, bs: int | None = None) -> torch.Tensor:
        """Replay bs rows' graph (default: the smallest holding the step); inp None: dummy step."""
        n = inp.num_local_tokens if inp is not None else 0
        bs = bs or self.size(n)
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


def compile_kernel_variants(model, config, ps, backend, device) -> None:
    """After capture: the paged attention kernel's tile variants that eager and mixed steps may pick,
    on the first layer's cache, and the expert kernels' variants, compiled before serving."""
    layer = next((m for m in model.modules() if isinstance(m, Attention)), None)
    if (backend.name == "TRITON" and layer is not None and layer.kv_cache is not None
            and ps.cp.world_size == 1):  # CP writes packed partials: other variants
        from longserve.attention.triton_kernels import compile_attention_variants
        t = time.perf_counter()
        s = config.scheduler
        n = compile_attention_variants(layer.num_heads, layer.kv_cache[0], layer.kv_cache[1],
                                       layer.kv_scale, config.dtype,
                                       s.max_num_batched_tokens, s.max_num_seqs)
        torch.cuda.synchronize(device)
        logger.info("ran %d attention tile variants in %.1f s", n, time.perf_counter() - t)
    elif backend.name == "TRITON" and layer is not None:  # CP: the prefix / suffix merges only
        from longserve.attention.triton_kernels import merge_variants, run_in_threads
        run_in_threads(merge_variants(layer.num_heads, layer.head_dim, config.dtype, device,
                                      ps.cp.world_size), device)
    moe = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
    if moe is not None:  # the expert kernels' variants too
        moe.compile_kernels(config.dtype)
    # the LM head's GEMV of 2-16 rows (no warm-up step has two rows of one sampling kind): both
    # heads, on every rank alike (their collectives)
    rows = torch.zeros(2, config.model.hidden_size, dtype=config.dtype, device=device)
    model.lm_head(rows)
    model.lm_head.greedy(rows)
