"""Piecewise CUDA graphs for steps with prefill: the forward as L + 1 segments around the eager
attentions (`segment`), each a graph per token bucket; `use_graphs=False` runs the same segments
uncaptured (docs/architecture.md, 'CUDA graphs')."""
from __future__ import annotations

import bisect
import logging
import time

import torch

logger = logging.getLogger(__name__)
# LONGSERVE_PIECEWISE: "off" runs steps with prefill eagerly even with CUDA graphs; "eager"
# runs them through the piecewise runner with its graphs off (CPU tests of that path)
PIECEWISE_MODE = "LONGSERVE_PIECEWISE"
MAX_GRAPH_TOKENS = 8192  # past this a step's dense work dwarfs its launch overhead: eager


def token_buckets(max_tokens: int) -> list[int]:
    """Padded token counts that get graphs (the ladder: docs/architecture.md, 'CUDA graphs')."""
    top = min(max_tokens, MAX_GRAPH_TOKENS)
    ladder = [16 << i for i in range(7)] + list(range(1536, 4097, 512)) + list(range(5120, top, 1024))
    return sorted({b for b in ladder if b < top} | {top})


def piecewise_unsupported(config) -> str | None:
    """Why steps with prefill run eagerly under this EngineConfig; None: piecewise graphs."""
    par = config.parallel
    if config.model.is_moe:
        return "expert layers: only decode steps replay graphs"
    if par.enable_sequence_parallel:
        return "sequence parallelism is not captured piecewise"
    return None  # (PCP: every rank holds P / W of each prefill's padded tokens, the same count)


def build_piecewise(config, model, device, pool=None) -> PiecewiseGraphs | None:
    """The piecewise runner of this EngineConfig (None: steps with prefill run eagerly); without a
    memory pool (CPU) its segments run uncaptured."""
    reason = piecewise_unsupported(config)
    if reason is not None:
        logger.info("steps with prefill run eagerly: %s", reason)
        return None
    pw = PiecewiseGraphs(model, config.scheduler.max_num_batched_tokens, device, pool is not None)
    if pool is not None:
        n = pw.capture(pool)
        logger.info("captured %d piecewise graphs (%d buckets up to %d tokens) in %.1f s", n,
                    len(pw.buckets), pw.buckets[-1], pw.capture_s)
    return pw


def piecewise_pool_bytes(config, activation_peak: int) -> int:
    """Device memory to keep for the piecewise graphs (static buffers and pool): the activations of an
    eager step of the largest bucket, scaled from the profiled full-budget step (linear in tokens)."""
    if piecewise_unsupported(config) is not None:
        return 0
    budget = config.scheduler.max_num_batched_tokens
    return activation_peak * min(budget, MAX_GRAPH_TOKENS) // budget


class PiecewiseGraphs:
    def __init__(self, model, max_tokens: int, device, use_graphs: bool):
        self.model, self.use_graphs = model, use_graphs
        self.buckets = token_buckets(max_tokens)
        self.num_layers = len(model.layers)
        attn = model.layers[0].self_attn
        d, dtype = attn.head_dim, model.embed_tokens.weight.dtype

        def buf(*shape, dt=dtype):  # [largest bucket, *shape]
            return torch.zeros(self.buckets[-1], *shape, dtype=dt, device=device)
        self.input_ids, self.positions = buf(dt=torch.int64), buf(dt=torch.int64)
        self.cos, self.sin = buf(d // 2, dt=torch.float32), buf(d // 2, dt=torch.float32)
        self.q, self.attn_out = buf(attn.num_heads, d), buf(attn.num_heads, d)
        self.k, self.v = buf(attn.num_kv_heads, d), buf(attn.num_kv_heads, d)
        self.residual, self.hidden = buf(model.cfg.hidden_size), buf(model.cfg.hidden_size)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}  # bucket -> one per segment
        self.num_steps = 0  # steps run piecewise
        self.capture_s = 0.0  # seconds capture() took

    def fits(self, num_tokens: int) -> bool:
        return num_tokens <= self.buckets[-1]

    def bucket(self, num_tokens: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, num_tokens)]

    @torch.no_grad()
    def run(self, input_ids, positions, meta) -> torch.Tensor:
        """The model's forward over the step's T tokens -> hidden [T, hidden] (a static buffer's view)."""
        t = input_ids.shape[0]
        b = self.bucket(t)
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        for i in range(self.num_layers + 1):
            if self.use_graphs:
                self.graphs[b][i].replay()
            else:
                self.segment(i, b)
            if i < self.num_layers:
                self.attention(i, t, meta)
        self.num_steps += 1
        return self.hidden[:t]

    def attention(self, i: int, t: int, meta) -> None:
        """Layer i's attention over the real rows [0, t): stores their K/V, fills attn_out."""
        attn = self.model.layers[i].self_attn.attn
        q, k, v = self.q[:t], self.k[:t], self.v[:t]
        if attn.kv_shared:  # a later layer reads them (meta.step_kv); the next segment overwrites the buffers
            k, v = k.clone(), v.clone()
        attn(q, k, v, meta, out=self.attn_out[:t])

    def segment(self, i: int, b: int) -> None:
        """Segment i over the first b rows of the static buffers (what a graph captures)."""
        m = self.model
        if i == 0:
            hidden, residual = m.embed_tokens(self.input_ids[:b]), None
            cos, sin = m.layers[0].self_attn.rotary.cos_sin(self.positions[:b])
            self.cos[:b].copy_(cos)
            self.sin[:b].copy_(sin)
        else:
            hidden, residual = m.layers[i - 1].after_attention(self.attn_out[:b], self.residual[:b])
        if i == self.num_layers:
            self.hidden[:b].copy_(m.norm(hidden, residual)[0])
            return
        _, _, v, residual = m.layers[i].before_attention(  # RoPE writes q, k in place
            (self.cos[:b], self.sin[:b]), hidden, residual, out=(self.q[:b], self.k[:b]))
        self.v[:b].copy_(v)
        self.residual[:b].copy_(residual)

    @torch.no_grad()
    def capture(self, pool) -> int:
        """Capture every segment at every bucket, largest first, into one pool; returns the graph count.
        Eager runs come first at the smallest and largest bucket (a kernel's variant follows its row
        count's divisibility, not its size, and the others are multiples of 16 as the smallest is)."""
        start = time.perf_counter()
        for b in {self.buckets[0], self.buckets[-1]}:
            for i in range(self.num_layers + 1):
                self.segment(i, b)
        torch.cuda.synchronize()
        for b in reversed(self.buckets):
            self.graphs[b] = []
            for i in range(self.num_layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.segment(i, b)
                self.graphs[b].append(graph)
        torch.cuda.synchronize()
        self.capture_s = time.perf_counter() - start
        return len(self.buckets) * (self.num_layers + 1)
