"""Turn the last-position logits of each request into its next token: argmax, or temperature,
top-k, top-p and the exponential race (argmax of p / E, E ~ Exp(1)); a seeded request's noise
comes from (seed, tokens sampled so far), so batch and preemption do not change its tokens."""
from __future__ import annotations

import numpy as np
import torch

from longserve.sampling_params import SamplingParams
from longserve.host_to_device import to_device


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._seeded = torch.Generator(device=device)

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams], seed_offsets: list[int],
                 biases: list[tuple[np.ndarray, np.ndarray] | None] | None = None) -> torch.Tensor:
        """logits [N, V] float32 -> token ids [N] on the logits' device, without waiting for it; biases:
        each row's `logit_bias_arrays` (made here if missing)."""
        logits = apply_logit_bias(logits, biases or [logit_bias_arrays(p) for p in params])
        tokens = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):
            greedy = to_device(np.array([p.greedy for p in params]), logits.device)
            tokens = torch.where(greedy, tokens, self._sample(logits, params, seed_offsets))
        return tokens

    def _sample(self, logits, params, seed_offsets):
        temps = to_device(np.array([max(p.temperature, 1e-5) for p in params], np.float32), logits.device)
        logits = logits / temps[:, None]
        logits = apply_top_k(logits, [p.top_k for p in params])
        logits = apply_top_p(logits, [p.top_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)  # one launch
        for i, p in enumerate(params):  # seeded rows draw again from their own stream
            if p.seed is not None:
                gen = self._seeded.manual_seed((p.seed * 1_000_003 + seed_offsets[i]) % (1 << 63))
                noise[i].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def logprobs(logits, params, tokens: list[int]) -> list[dict[int, float] | None]:
        """Per row {sampled token: logprob} plus the top `params.logprobs` (None where not asked)."""
        wanted = [p.logprobs for p in params]
        if all(w is None for w in wanted):
            return [None] * len(params)
        logprobs = torch.log_softmax(logits, dim=-1)
        out = []
        for i, w in enumerate(wanted):
            entry = None if w is None else {tokens[i]: logprobs[i, tokens[i]].item()}
            if w:  # and the top w
                top = logprobs[i].topk(w)
                entry.update(zip(top.indices.tolist(), top.values.tolist()))
            out.append(entry)
        return out


def prompt_logprobs(logits: torch.Tensor, targets: list[int],
                    top_ks: list[int]) -> list[tuple[int, dict[int, float]]]:
    """logits [R, V] float32 of prompt rows -> per row (the target's rank, 1 = likeliest, also
    outside the top-k; {target: logprob} plus its top-k)."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets, device=logits.device)[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top = logprobs.topk(max(top_ks))  # k = 0: empty rows
    top_v, top_i = top.values.tolist(), top.indices.tolist()
    return [(r, {t: c, **dict(zip(ids[:kr], vs[:kr]))})
            for t, c, r, kr, vs, ids in zip(targets, chosen[:, 0].tolist(), ranks, top_ks, top_v, top_i)]


def logit_bias_arrays(params: SamplingParams | None) -> tuple[np.ndarray, np.ndarray] | None:
    """A request's logit_bias as (token ids int64, biases float32), made once when it arrives."""
    if params is None or not params.logit_bias:
        return None
    return (np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias)),
            np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias)))


def apply_logit_bias(logits: torch.Tensor, biases: list[tuple[np.ndarray, np.ndarray] | None]) -> torch.Tensor:
    """A copy with the rows' biases added by one index_put (logprobs stay the model's, as vLLM)."""
    rows = [i for i, b in enumerate(biases) if b is not None]
    if not rows:
        return logits
    cols = np.concatenate([biases[i][0] for i in rows])
    index = to_device(np.stack([np.repeat(rows, [len(biases[i][0]) for i in rows]), cols]), logits.device)
    vals = to_device(np.concatenate([biases[i][1] for i in rows]), logits.device)
    return logits.index_put((index[0], index[1]), vals, accumulate=True)


def apply_top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    if not any(top_ks):
        return logits
    vocab = logits.shape[-1]
    k = to_device(np.array([k if 0 < k < vocab else vocab for k in top_ks]), logits.device)
    kth = logits.sort(dim=-1, descending=True).values.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_ps: list[float]) -> torch.Tensor:
    if all(p >= 1.0 for p in top_ps):
        return logits
    p = to_device(np.array(top_ps, np.float32), logits.device)[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    # drop a token when the mass strictly before it already reaches top_p (the first stays)
    drop = (probs.cumsum(dim=-1) - probs) >= p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[i]] keeps only the tokens whose bit is set in bitmask[i] (int32 words on
    the host, bit j of word w = token 32 w + j); ids past the mask's bits are masked."""
    if not rows:
        return
    if logits.is_cuda:
        from longserve.worker.bitmask_kernel import apply_bitmask_triton
        return apply_bitmask_triton(logits, bitmask, rows)
    dev, vocab = logits.device, logits.shape[-1]
    words = to_device(bitmask, dev)
    allowed = ((words[:, :, None] >> torch.arange(32, device=dev, dtype=words.dtype)) & 1).flatten(1)
    allowed = torch.nn.functional.pad(allowed[:, :vocab], (0, max(0, vocab - allowed.shape[1])))
    index = to_device(np.array(rows, np.int64), dev)
    logits[index] = logits[index].masked_fill(allowed == 0, float("-inf"))
