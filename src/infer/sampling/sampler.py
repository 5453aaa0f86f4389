"""Turn a batch of logits into next tokens, each row with its own parameters and generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.sampling.params import SamplingParams
from infer.sampling.transforms import SamplingBatch, probs_from_logits, token_presence


def row_index(rows: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long, device=device)


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Draw one token per row of ``probs`` ([B, V], non-negative, need not be normalised).

    Row ``b`` uses ``generators[b]``; ``None`` means the global RNG of ``probs.device``. Rows that
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

    own = [b for b, g in enumerate(generators) if g is not None]
    draws = [torch.multinomial(weights[b], 1, generator=generators[b]) for b in own]
    out[row_index(own, device)] = torch.cat(draws)
    return out


def sample_rows(probs: torch.Tensor, greedy: Sequence[bool],
                generators: Sequence[torch.Generator | None]) -> torch.Tensor:
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


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Next token for each row of ``logits`` [B, V]; greedy rows take the argmax and draw nothing.
    ``allowed`` [B, V] bool: the tokens each row's grammar allows (None: no grammar)."""
    batch = SamplingBatch.from_params(params, logits.device)
    presence = context_presence(batch, contexts, logits.shape[-1], logits.device)
    return sample_rows(probs_from_logits(logits, batch, presence, allowed), [p.greedy for p in params], generators)
