"""Logits -> probability distribution, vectorised over a batch of rows with per-row parameters.

Order of transforms (as in vLLM): repetition penalty, the grammar's allowed-token mask,
temperature, top-k, top-p, min-p. Greedy rows
(temperature 0) become a one-hot distribution on the argmax of the penalised logits, so greedy and
sampled rows flow through the same code and the same rejection sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.sampling.params import SamplingParams

# top_k above any vocabulary keeps every token; capping it keeps an int64 tensor from overflowing
# (top_k=2**70 is a valid "keep everything"); _top_k clamps to the real vocabulary.
_TOP_K_CAP = 2**31 - 1


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, plus flags that let rows skip unused transforms."""

    temperature: torch.Tensor  # [N] float, 1.0 on greedy rows
    top_k: torch.Tensor  # [N] long, 0 = off
    top_p: torch.Tensor  # [N] float
    min_p: torch.Tensor  # [N] float
    repetition_penalty: torch.Tensor  # [N] float
    greedy: torch.Tensor  # [N] bool
    any_greedy: bool
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    use_penalty: bool

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str) -> SamplingBatch:
        greedy = [p.greedy for p in params]
        return cls(
            temperature=torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                                     dtype=torch.float32, device=device),
            top_k=torch.tensor([min(p.top_k, _TOP_K_CAP) for p in params], dtype=torch.long, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            repetition_penalty=torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32,
                                            device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            any_greedy=any(greedy),
            all_greedy=all(greedy),
            use_top_k=any(p.top_k > 0 and not g for p, g in zip(params, greedy, strict=True)),
            use_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy, strict=True)),
            use_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy, strict=True)),
            use_penalty=any(p.repetition_penalty != 1.0 for p in params),
        )

    def select(self, rows: torch.Tensor) -> SamplingBatch:
        """The rows ``rows`` (an index tensor; may repeat rows). Flags stay safe over-approximations."""
        picked = {name: getattr(self, name)[rows]
                  for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "greedy")}
        return SamplingBatch(**picked, any_greedy=self.any_greedy, all_greedy=self.all_greedy,
                             use_top_k=self.use_top_k, use_top_p=self.use_top_p, use_min_p=self.use_min_p,
                             use_penalty=self.use_penalty)

    def repeat_rows(self, n: int) -> SamplingBatch:
        """Each row repeated ``n`` times consecutively (row b -> rows b*n .. b*n+n-1)."""
        return self.select(torch.arange(self.greedy.shape[0], device=self.greedy.device).repeat_interleave(n))


def argmax_only(params: Sequence[SamplingParams]) -> bool:
    """Every row greedy without a repetition penalty or a grammar: each distribution is the one-hot
    argmax of the raw logits, so a caller may take the argmax and skip forming distributions."""
    return all(p.greedy and p.repetition_penalty == 1.0 and p.structured_output is None for p in params)


def token_presence(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, V] bool mask of the tokens each row has seen (prompt + generated), for the repetition penalty."""
    presence = torch.zeros(len(token_lists), vocab_size, dtype=torch.bool, device=device)
    for row, tokens in enumerate(token_lists):
        if len(tokens):
            presence[row, torch.as_tensor(list(tokens), dtype=torch.long, device=device)] = True
    return presence


def presence_with_drafts(presence: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """[B, K+1, V] presence where position i also contains the drafts t_1..t_i before it.

    Verification position i scores the token after t_1..t_i, so its penalty context includes them.
    """
    batch, k = draft_tokens.shape
    out = presence.unsqueeze(1).repeat(1, k + 1, 1)
    if k:
        seen = torch.zeros(batch, k + 1, presence.shape[-1], dtype=torch.bool, device=presence.device)
        hits = torch.zeros(batch, k, presence.shape[-1], dtype=torch.bool, device=presence.device)
        hits.scatter_(2, draft_tokens.clamp(min=0).unsqueeze(-1), True)
        seen[:, 1:] = hits.cumsum(dim=1) > 0
        out |= seen
    return out


def apply_repetition_penalty(logits: torch.Tensor, presence: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL-style penalty (as in transformers): divide positive, multiply negative seen logits."""
    pen = penalty.unsqueeze(-1).to(logits.dtype)
    penalised = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(presence, penalised, logits)


def probs_from_logits(
    logits: torch.Tensor, batch: SamplingBatch, presence: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sampling transform: ``logits`` [N, V] -> probabilities [N, V] (float32).

    ``allowed`` [N, V] bool (a grammar's mask; None: every token) restricts each row to its allowed
    tokens before temperature and truncation, so the result is the row's distribution over them.
    """
    logits = logits.float()
    if batch.use_penalty:
        if presence is None:
            raise ValueError("repetition_penalty needs the context tokens (presence mask)")
        logits = apply_repetition_penalty(logits, presence, batch.repetition_penalty)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    if batch.all_greedy:
        return _one_hot_argmax(logits)
    logits = logits / batch.temperature.unsqueeze(-1)
    if batch.use_top_k:
        logits = _top_k(logits, batch.top_k)
    probs = torch.softmax(logits, dim=-1)
    if batch.use_top_p:
        probs = _top_p(probs, batch.top_p)
    if batch.use_min_p:
        probs = _min_p(probs, batch.min_p)
    if batch.any_greedy:
        probs = torch.where(batch.greedy.unsqueeze(-1), _one_hot_argmax(logits), probs)
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def _top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth = sorted_logits.gather(-1, (k - 1).unsqueeze(-1))
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p``; renormalise."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p.unsqueeze(-1)
    keep_sorted[..., 0] = True
    keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
    kept = probs * keep
    return kept / kept.sum(dim=-1, keepdim=True)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = probs.max(dim=-1, keepdim=True).values * min_p.unsqueeze(-1)
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)
