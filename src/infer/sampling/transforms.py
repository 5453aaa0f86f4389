"""Logits -> probability distribution, vectorised over a batch of rows with per-row parameters.

Order of transforms (as in vLLM): repetition penalty, presence and frequency penalties, logit
bias, the grammar's allowed-token mask, temperature, top-k, top-p, min-p. Every one is a function
of the logits and the tokens so far, applied alike to the target's p and a draft model's q, so
speculative decoding samples exactly the transformed target distribution. Greedy rows
(temperature 0) become a one-hot distribution on the argmax of the penalised logits, so greedy and
sampled rows flow through the same code and the same rejection sampler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
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
    presence_penalty: torch.Tensor  # [N] float
    frequency_penalty: torch.Tensor  # [N] float
    greedy: torch.Tensor  # [N] bool
    logit_bias: list[dict[int, float]]  # per row (host)
    any_greedy: bool
    all_greedy: bool
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    use_penalty: bool
    use_counts: bool = False  # presence/frequency penalty: needs the generated tokens' counts
    use_logit_bias: bool = False

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device | str) -> SamplingBatch:
        greedy = [p.greedy for p in params]
        # The float parameters as one [6, N] tensor (one host-to-device copy; rows are views).
        floats = torch.tensor([[1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)],
                               [p.top_p for p in params], [p.min_p for p in params],
                               [p.repetition_penalty for p in params], [p.presence_penalty for p in params],
                               [p.frequency_penalty for p in params]], dtype=torch.float32, device=device)
        return cls(
            temperature=floats[0],
            top_k=torch.tensor([min(p.top_k, _TOP_K_CAP) for p in params], dtype=torch.long, device=device),
            top_p=floats[1],
            min_p=floats[2],
            repetition_penalty=floats[3],
            presence_penalty=floats[4],
            frequency_penalty=floats[5],
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            logit_bias=[p.logit_bias for p in params],
            any_greedy=any(greedy),
            all_greedy=all(greedy),
            use_top_k=any(p.top_k > 0 and not g for p, g in zip(params, greedy, strict=True)),
            use_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy, strict=True)),
            use_min_p=any(p.min_p > 0.0 and not g for p, g in zip(params, greedy, strict=True)),
            use_penalty=any(p.repetition_penalty != 1.0 for p in params),
            use_counts=any(p.counts_output for p in params),
            use_logit_bias=any(p.logit_bias for p in params),
        )

    def select(self, rows: torch.Tensor) -> SamplingBatch:
        """The rows ``rows`` (an index tensor; may repeat rows). Flags stay safe over-approximations."""
        picked = {name: getattr(self, name)[rows]
                  for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "presence_penalty",
                               "frequency_penalty", "greedy")}
        bias = [self.logit_bias[i] for i in rows.tolist()] if self.use_logit_bias else [{}] * rows.shape[0]
        return SamplingBatch(**picked, logit_bias=bias, any_greedy=self.any_greedy, all_greedy=self.all_greedy,
                             use_top_k=self.use_top_k, use_top_p=self.use_top_p, use_min_p=self.use_min_p,
                             use_penalty=self.use_penalty, use_counts=self.use_counts,
                             use_logit_bias=self.use_logit_bias)

    def repeat_rows(self, n: int) -> SamplingBatch:
        """Each row repeated ``n`` times consecutively (row b -> rows b*n .. b*n+n-1)."""
        return self.select(torch.arange(self.greedy.shape[0], device=self.greedy.device).repeat_interleave(n))


def argmax_only(params: Sequence[SamplingParams]) -> bool:
    """Every row greedy without a penalty, a logit bias or a grammar: each distribution is the one-hot
    argmax of the raw logits, so a caller may take the argmax and skip forming distributions."""
    return all(p.greedy and p.repetition_penalty == 1.0 and not p.counts_output and not p.logit_bias
               and p.structured_output is None for p in params)


def token_presence(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, V] bool mask of the tokens each row has seen (prompt + generated), for the repetition penalty."""
    presence = torch.zeros(len(token_lists), vocab_size, dtype=torch.bool, device=device)
    for row, tokens in enumerate(token_lists):
        if len(tokens):
            presence[row, torch.as_tensor(list(tokens), dtype=torch.long, device=device)] = True
    return presence


def token_counts(token_lists: Sequence[Sequence[int]], vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """[N, V] float: how many times each row has generated each token (presence/frequency penalty)."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.float32, device=device)
    for row, tokens in enumerate(token_lists):
        if len(tokens):
            ids = torch.as_tensor(list(tokens), dtype=torch.long, device=device)
            counts[row].index_add_(0, ids, torch.ones(len(ids), device=device))
    return counts


def drafts_on_path(draft_tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, K+1, V] float: how often each token occurs among the drafts t_1..t_i before position i."""
    batch, k = draft_tokens.shape
    out = torch.zeros(batch, k + 1, vocab_size, device=draft_tokens.device)
    if k:
        hits = torch.zeros(batch, k, vocab_size, device=draft_tokens.device)
        hits.scatter_(2, draft_tokens.clamp(min=0).unsqueeze(-1), 1.0)
        out[:, 1:] = hits.cumsum(dim=1)
    return out


def apply_repetition_penalty(logits: torch.Tensor, presence: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """CTRL-style penalty (as in transformers): divide positive, multiply negative seen logits."""
    pen = penalty.unsqueeze(-1).to(logits.dtype)
    penalised = torch.where(logits > 0, logits / pen, logits * pen)
    return torch.where(presence, penalised, logits)


def probs_from_logits(
    logits: torch.Tensor, batch: SamplingBatch, presence: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None, counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The sampling transform: ``logits`` [N, V] -> probabilities [N, V] (float32).

    ``presence`` [N, V] bool: tokens in the prompt or generated (repetition penalty); ``counts``
    [N, V] float: times each token was generated (presence/frequency penalty). ``allowed`` [N, V]
    bool (a grammar's mask; None: every token) restricts each row to its allowed tokens before
    temperature and truncation, so the result is the row's distribution over them.
    """
    return probs_from_processed(process_logits(logits, batch, presence, allowed, counts), batch)


def process_logits(
    logits: torch.Tensor, batch: SamplingBatch, presence: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None, counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logit processors (penalties, logit bias, grammar mask): [N, V] float32 logits."""
    logits = logits.float()
    if batch.use_penalty:
        if presence is None:
            raise ValueError("repetition_penalty needs the context tokens (presence mask)")
        logits = apply_repetition_penalty(logits, presence, batch.repetition_penalty)
    if batch.use_counts:
        if counts is None:
            raise ValueError("presence_penalty and frequency_penalty need the generated tokens' counts")
        logits = (logits - batch.frequency_penalty.unsqueeze(-1) * counts
                  - batch.presence_penalty.unsqueeze(-1) * (counts > 0).float())
    if batch.use_logit_bias:
        logits = _add_logit_bias(logits, batch.logit_bias)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return logits


def probs_from_processed(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Temperature, truncation and greedy one-hot on processed logits: the probabilities [N, V]."""
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


def processed_logprobs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The log-probabilities requests see as ``logprobs``: processed logits over the temperature
    (1 on greedy rows), before top-k/top-p/min-p truncation, so every allowed token has one."""
    return torch.log_softmax(logits / batch.temperature.unsqueeze(-1), dim=-1)


def _add_logit_bias(logits: torch.Tensor, bias: list[dict[int, float]]) -> torch.Tensor:
    vocab = logits.shape[-1]
    entries = [(row, token, value) for row, biases in enumerate(bias) for token, value in biases.items()
               if token < vocab]
    if not entries:
        return logits
    rows, tokens, values = zip(*entries, strict=True)
    device = logits.device
    return logits.index_put((torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                            torch.tensor(values, dtype=logits.dtype, device=device), accumulate=True)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``: the first index of the largest value (of the first NaN where one is
    there), int64. A CPU float32 row goes through NumPy's argmax, which runs a vocabulary row several
    times faster than PyTorch's CPU reduction (a greedy step takes one per request); the same index
    either way, and plain and speculative decoding both take their greedy tokens here."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() >= 1 and logits.shape[-1] \
            and not logits.requires_grad:
        return torch.from_numpy(np.argmax(logits.numpy(), axis=-1).astype(np.int64, copy=False))
    return logits.argmax(dim=-1)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(logits, dtype=torch.float32)
    return out.scatter_(-1, greedy_tokens(logits).unsqueeze(-1), 1.0)


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
