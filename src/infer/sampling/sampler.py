"""Turn a batch of logits into next tokens, each row with its own parameters and generator."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.sampling.params import SamplingParams
from infer.sampling.transforms import (
    SamplingBatch,
    argmax_only,
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


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True)
class KeyedDraw:
    """The randomness of a seeded request's token at one position: a draw keyed by (seed, position).

    Each position has its own noise, a vector of independent Exp(1) variables E_v (one per token,
    from a generator seeded with a hash of seed and position), and the token drawn from a
    distribution p is ``argmax_v p_v / E_v`` (the exponential race, i.e. Gumbel-max): exactly
    distributed as p, and a deterministic function of (seed, position, p). Whatever pass computes p
    at that position (a decode step, a chain or tree verification), whatever the batch and the
    drafts, the token is the same; ``position`` is the index of the generated token (0: the first).
    """

    seed: int
    position: int

    def at(self, offset: int) -> KeyedDraw:
        return KeyedDraw(self.seed, self.position + offset)

    def exponentials(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab] float64 Exp(1) noise of this position (the same on every call)."""
        gen = torch.Generator(device=device)
        gen.manual_seed(_splitmix64((_splitmix64(self.seed & _MASK64) + self.position) & _MASK64))
        return torch.empty(vocab, dtype=torch.float64, device=device).exponential_(generator=gen)


# Where a row's randomness comes from: its own generator's stream, a keyed draw, or (None) the
# device's global RNG.
RandomSource = torch.Generator | KeyedDraw | None


def keyed_sample(probs: torch.Tensor, draws: Sequence[KeyedDraw]) -> torch.Tensor:
    """One token per row of ``probs`` [N, V] (non-negative, need not be normalised), row i drawn by
    ``draws[i]``: ``argmax_v probs[i, v] / E_v``. Returns [N] long on ``probs.device``."""
    if not draws:
        return torch.empty(0, dtype=torch.long, device=probs.device)
    # What multinomial refuses, refused here too: argmax would silently pick a token from NaNs.
    if not bool((torch.isfinite(probs) & (probs >= 0)).all() & (probs.sum(dim=-1) > 0).all()):
        raise RuntimeError("keyed sampling: the probabilities contain inf, nan or a negative value, or a row sums to 0")
    noise = torch.stack([d.exponentials(probs.shape[-1], probs.device) for d in draws])
    return (probs.double() / noise).argmax(dim=-1)


def sample_from_probs(probs: torch.Tensor, generators: Sequence[RandomSource]) -> torch.Tensor:
    """Draw one token per row of ``probs`` ([B, V], non-negative, need not be normalised).

    Row ``b`` uses ``generators[b]``: a generator (multinomial from its stream), a ``KeyedDraw``
    (the keyed exponential race), or ``None`` for the global RNG of ``probs.device``. Rows that
    share the global RNG are sampled in one batched call, so large batches without per-row
    generators stay fast. Returns a [B] long tensor on ``probs.device``.
    """
    if probs.dim() != 2:
        raise ValueError(f"probs must be [B, V], got shape {tuple(probs.shape)}")
    batch = probs.shape[0]
    if len(generators) != batch:
        raise ValueError(f"generators has {len(generators)} entries for a batch of {batch}")
    device = probs.device
    if batch == 0:
        return torch.empty(0, dtype=torch.long, device=device)
    # multinomial is not implemented for half types on every backend; a [B, V] cast is cheap.
    weights = probs if probs.dtype in (torch.float32, torch.float64) else probs.float()

    shared = [b for b, g in enumerate(generators) if g is None]
    if len(shared) == batch:
        return torch.multinomial(weights, 1).squeeze(1)
    out = torch.empty(batch, dtype=torch.long, device=device)
    if shared:
        idx = row_index(shared, device)
        out[idx] = torch.multinomial(weights[idx], 1).squeeze(1)
    keyed = [b for b, g in enumerate(generators) if isinstance(g, KeyedDraw)]
    if keyed:
        idx = row_index(keyed, device)
        out[idx] = keyed_sample(weights[idx], [generators[b] for b in keyed])  # type: ignore[misc]
    own = [b for b, g in enumerate(generators) if isinstance(g, torch.Generator)]
    if own:
        draws = [torch.multinomial(weights[b], 1, generator=generators[b]) for b in own]  # type: ignore[arg-type]
        out[row_index(own, device)] = torch.cat(draws)
    return out


def sample_rows(probs: torch.Tensor, greedy: Sequence[bool], generators: Sequence[RandomSource]) -> torch.Tensor:
    """One token per row of ``probs`` [B, V]: the argmax for greedy rows (no randomness consumed), a
    draw with the row's own generator for the others."""
    tokens = probs.argmax(dim=-1)
    sampled = [b for b, is_greedy in enumerate(greedy) if not is_greedy]
    if len(sampled) == len(greedy):
        return sample_from_probs(probs, generators)
    if sampled:
        idx = row_index(sampled, probs.device)
        tokens[idx] = sample_from_probs(probs[idx], [generators[b] for b in sampled])
    return tokens


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
        return logits.argmax(dim=-1), [None] * len(params)
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
