"""Turn a batch of logits into next tokens, each row with its own parameters and generator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.sampling.params import SamplingParams
from infer.sampling.transforms import (
    SamplingBatch,
    argmax_only,
    greedy_tokens,
    probs_from_processed,
    process_logits,
    processed_logprobs,
    token_counts,
    token_presence,
)


@dataclass
class TokenLogprobs:
    """One generated token's log-probability and the likeliest tokens at its position."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), likeliest first; as many as asked


def raw_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprobs]:
    """``TokenLogprobs`` of ``tokens[i]`` under row i of raw ``logits`` [N, V] (log-softmax, no processor)."""
    if not len(tokens):
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(list(tokens), device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    values, ids = logprobs.topk(top, dim=-1) if top else (logprobs[:, :0], logprobs[:, :0].long())
    return [TokenLogprobs(int(t), float(v), list(zip(i, tv, strict=True)))
            for t, v, i, tv in zip(tokens, chosen, ids.tolist(), values.tolist(), strict=True)]


def gather_logprobs(processed: torch.Tensor, batch: SamplingBatch, tokens: Sequence[int],
                    tops: Sequence[int | None]) -> list[TokenLogprobs | None]:
    """``TokenLogprobs`` of ``tokens[i]`` under row i of ``processed`` logits [N, V] for the rows whose
    ``tops[i]`` (how many alternatives) is not None; None for the others."""
    out: list[TokenLogprobs | None] = [None] * len(tops)
    rows = [i for i, k in enumerate(tops) if k is not None]
    if not rows:
        return out
    index = row_index(rows, processed.device)
    logprobs = processed_logprobs(processed[index], batch.select(index))
    chosen = logprobs.gather(1, torch.tensor([tokens[i] for i in rows], device=processed.device).unsqueeze(1))
    widest = max(int(tops[i] or 0) for i in rows)
    values, ids = logprobs.topk(widest, dim=-1) if widest else (logprobs[:, :0], logprobs[:, :0].long())
    for i, value, top_values, top_ids in zip(rows, chosen.squeeze(1).tolist(), values.tolist(), ids.tolist(),
                                             strict=True):
        k = int(tops[i] or 0)
        out[i] = TokenLogprobs(int(tokens[i]), float(value), list(zip(top_ids[:k], top_values[:k], strict=True)))
    return out


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def on_device(values: list[int] | list[bool] | list[float], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without waiting for the device: through pinned memory, copied
    asynchronously on CUDA (a pageable copy would wait for the stream's queued work)."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class KeyedDraw:
    """The randomness of a seeded request's token at one position: a draw keyed by (seed, position).

    Each position has its own uniform u in [0, 1) (53 bits of a 64-bit hash of seed and position),
    and the token drawn from a distribution p is the inverse CDF at u (``inverse_cdf``): exactly
    distributed as p, and a deterministic function of (seed, position, p). Whatever pass computes p
    at that position (a decode step, a chain or tree verification), whatever the batch and the
    drafts, the token is the same; ``position`` is the index of the generated token (0: the first).
    """

    seed: int
    position: int

    def at(self, offset: int) -> KeyedDraw:
        return KeyedDraw(self.seed, self.position + offset)

    def uniform(self) -> float:
        """This position's u in [0, 1) (the same on every call, on every device)."""
        key = _splitmix64((_splitmix64(self.seed & _MASK64) + self.position) & _MASK64)
        return (_splitmix64(key) >> 11) * 2.0**-53


# Where a row's randomness comes from: its own generator's stream, a keyed draw, or (None) the
# device's global RNG.
RandomSource = torch.Generator | KeyedDraw | None


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of ``weights`` [N, V] (non-negative, need not be normalised): row n's token
    is the first i whose cumulative weight exceeds ``uniforms[n]`` (in [0, 1)) times the row's total,
    so token i has probability ``w_i / sum(w)`` exactly up to float64 rounding, and a token of weight
    0 is never drawn. One uniform per row where ``torch.multinomial`` draws V exponentials (its
    exponential race costs a sizeable share of a small model's decode step); no host read. [N] long."""
    cdf = weights.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # u * total may round up to total (u within 2^-53 of 1): the point just below it still lands on
    # a token of positive weight, as every point below total does.
    point = torch.minimum(uniforms.to(cdf).view(-1, 1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, point, right=True).squeeze(1)


def invalid_rows(probs: torch.Tensor) -> torch.Tensor:
    """Rows (over the last dim) that no sampler can draw from: inf, nan, a negative value, or sum 0
    (a NaN makes the minimum and the sum NaN, and every comparison with NaN is false; an inf makes
    the sum inf). On the device."""
    total = probs.sum(dim=-1)
    return ~((probs.amin(dim=-1) >= 0) & (total > 0) & (total < float("inf")))


def row_uniforms(generators: Sequence[RandomSource], device: torch.device) -> torch.Tensor:
    """One uniform [N] float64 per source: the global RNG's rows drawn together, a generator's from
    its own stream (one value, so a request's stream depends on its tokens alone), a keyed draw's
    from its key."""
    out = torch.empty(len(generators), dtype=torch.float64, device=device)
    shared = [b for b, g in enumerate(generators) if g is None]
    if shared:
        out[on_device(shared, torch.long, device)] = torch.rand(len(shared), dtype=torch.float64, device=device)
    keyed = [b for b, g in enumerate(generators) if isinstance(g, KeyedDraw)]
    if keyed:
        values = [generators[b].uniform() for b in keyed]  # type: ignore[union-attr]
        out[on_device(keyed, torch.long, device)] = on_device(values, torch.float64, device)
    for b, g in enumerate(generators):
        if isinstance(g, torch.Generator):
            out[b] = torch.rand(1, generator=g, dtype=torch.float64, device=device)[0]
    return out


def keyed_sample(probs: torch.Tensor, draws: Sequence[KeyedDraw]) -> torch.Tensor:
    """One token per row of ``probs`` [N, V] (non-negative, need not be normalised), row i drawn by
    ``draws[i]``: the inverse CDF at its keyed uniform. Returns [N] long on ``probs.device``."""
    if not draws:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    _refuse_undrawable(probs, "keyed sampling")
    return inverse_cdf(probs, row_uniforms(draws, probs.device))


def _refuse_undrawable(probs: torch.Tensor, what: str) -> None:
    """RuntimeError where ``invalid_rows`` flags a row: what multinomial refuses (a draw from NaNs
    would silently pick a token)."""
    if bool(invalid_rows(probs).any()):
        raise RuntimeError(f"{what}: the probabilities contain inf, nan or a negative value, or a row sums to 0")


def sample_from_probs(probs: torch.Tensor, generators: Sequence[RandomSource]) -> torch.Tensor:
    """Draw one token per row of ``probs`` ([B, V], non-negative, need not be normalised).

    Row ``b``'s uniform comes from ``generators[b]``: a generator (its stream), a ``KeyedDraw``
    (its key), or ``None`` for the global RNG of ``probs.device`` (those rows drawn in one call);
    the token is the inverse CDF there (``inverse_cdf``). A row with inf, nan, a negative value or
    no mass is refused, as ``torch.multinomial`` refuses it. Returns a [B] long tensor on
    ``probs.device``.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [B, V], got shape {tuple(probs.shape)}")
    batch = probs.shape[0]
    if len(generators) != batch:
        raise ValueError(f"generators has {len(generators)} entries for a batch of {batch}")
    if batch == 0:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    _refuse_undrawable(probs, "sampling")
    return inverse_cdf(probs, row_uniforms(generators, probs.device))


def sample_rows(probs: torch.Tensor, greedy: Sequence[bool], generators: Sequence[RandomSource]) -> torch.Tensor:
    """One token per row of ``probs`` [B, V]: the argmax for greedy rows (no randomness consumed), a
    draw with the row's own generator for the others."""
    sampled = [b for b, is_greedy in enumerate(greedy) if not is_greedy]
    if len(sampled) == len(greedy):
        return sample_from_probs(probs, generators)
    tokens = greedy_tokens(probs)
    if sampled:
        idx = row_index(sampled, probs.device)
        tokens[idx] = sample_from_probs(probs[idx], [generators[b] for b in sampled])
    return tokens


def logprobs_at_rows(params: Sequence[SamplingParams], processed: torch.Tensor, sampling: SamplingBatch | None,
                     rows: Sequence[Sequence[int]], emitted: Sequence[Sequence[int]]) -> list[list[TokenLogprobs | None]] | None:
    """Each emitted token's logprobs (``emitted[b][i]``, request b with ``params[b]``) from the row of
    ``processed`` logits [B, R, V] whose distribution produced it (``rows[b][i]``): a speculative
    round's verification rows, each the target's processed distribution as a plain step computes
    it, so logprobs do not depend on speculation. None: no request asked for logprobs."""
    want = [b for b, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return None
    picks = [(b, row, token) for b in want for row, token in zip(rows[b], emitted[b], strict=True)]
    device = processed.device
    index = torch.tensor([b for b, _, _ in picks], device=device)
    chosen = processed[index, torch.tensor([row for _, row, _ in picks], device=device)]
    if sampling is None:
        sampling = SamplingBatch.from_params(list(params), device)
    found = iter(gather_logprobs(chosen, sampling.select(index), [t for _, _, t in picks],
                                 [params[b].logprobs for b, _, _ in picks]))
    return [[next(found) for _ in emitted[b]] if b in want else [None] * len(emitted[b]) for b in range(len(params))]


def context_presence(batch: SamplingBatch, contexts: Sequence[Sequence[int]], vocab_size: int,
                     device: torch.device) -> torch.Tensor | None:
    """The repetition-penalty context mask, built only when some row uses the penalty."""
    return token_presence(contexts, vocab_size, device) if batch.use_penalty else None


def output_counts(batch: SamplingBatch, outputs: Sequence[Sequence[int]], vocab_size: int,
                  device: torch.device) -> torch.Tensor | None:
    """The generated tokens' counts, built only when some row uses a presence/frequency penalty."""
    return token_counts(outputs, vocab_size, device) if batch.use_counts else None


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[Sequence[int]],
    generators: Sequence[RandomSource],
    allowed: torch.Tensor | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Next token for each row of ``logits`` [B, V]; greedy rows take the argmax and draw nothing.
    ``contexts``: each row's prompt + generated tokens; ``outputs``: the generated ones alone (for
    presence/frequency penalties; default none); ``allowed`` [B, V] bool: the tokens each row's
    grammar allows (None: no grammar)."""
    return sample_with_logprobs(logits, params, contexts, generators, allowed, outputs)[0]


def sample_with_logprobs(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[Sequence[int]],
    generators: Sequence[RandomSource],
    allowed: torch.Tensor | None = None,
    outputs: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, list[TokenLogprobs | None]]:
    """``sample_next_tokens``, and each token's ``TokenLogprobs`` for the rows whose params ask."""
    if allowed is None and argmax_only(params) and all(p.logprobs is None for p in params):
        # Each distribution would be the one-hot argmax of the raw logits: take the argmax.
        return greedy_tokens(logits), [None] * len(params)
    batch = SamplingBatch.from_params(params, logits.device)
    presence = context_presence(batch, contexts, logits.shape[-1], logits.device)
    counts = output_counts(batch, outputs if outputs is not None else [[] for _ in params], logits.shape[-1],
                           logits.device)
    processed = process_logits(logits, batch, presence, allowed, counts)
    tokens = sample_rows(probs_from_processed(processed, batch), [p.greedy for p in params], generators)
    tops = [p.logprobs for p in params]
    if all(k is None for k in tops):
        return tokens, [None] * len(tops)
    return tokens, gather_logprobs(processed, batch, tokens.tolist(), tops)
