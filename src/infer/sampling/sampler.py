"""Turn a batch of logits into next tokens, each row with its own parameters and generator."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.sampling.params import SamplingParams
from infer.sampling.transforms import SamplingBatch, probs_from_logits, token_presence


def sample_from_probs(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` [B, V], drawn with that row's generator (None: global RNG)."""
    rows = [torch.multinomial(probs[b], 1, generator=g) for b, g in enumerate(generators)]
    return torch.cat(rows) if rows else torch.empty(0, dtype=torch.long, device=probs.device)


def context_presence(batch: SamplingBatch, contexts: Sequence[Sequence[int]], vocab_size: int,
                     device: torch.device) -> torch.Tensor | None:
    """The repetition-penalty context mask, built only when some row uses the penalty."""
    return token_presence(contexts, vocab_size, device) if batch.use_penalty else None


def sample_next_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    contexts: Sequence[Sequence[int]],
    generators: Sequence[torch.Generator | None],
) -> torch.Tensor:
    """Next token for each row of ``logits`` [B, V]; greedy rows take the argmax and draw nothing."""
    batch = SamplingBatch.from_params(params, logits.device)
    presence = context_presence(batch, contexts, logits.shape[-1], logits.device)
    probs = probs_from_logits(logits, batch, presence)
    if batch.all_greedy:
        return probs.argmax(dim=-1)
    tokens = probs.argmax(dim=-1)
    sampled_rows = [b for b, p in enumerate(params) if not p.greedy]
    drawn = sample_from_probs(probs[sampled_rows], [generators[b] for b in sampled_rows])
    tokens[sampled_rows] = drawn
    return tokens
