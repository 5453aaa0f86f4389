"""How many tokens to draft per round: fixed, entropy-adaptive, or goodput-optimal (Theorem 3.8)."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch

from infer.engine.request import Request


def expected_speedup(alpha: float, k: int, cost: float) -> float:
    """Leviathan et al. Theorem 3.8: (1 - α^(K+1)) / ((1 - α)(cK + 1)); K = 0 is plain decoding (1.0)."""
    if k == 0:
        return 1.0
    tokens = k + 1 if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (cost * k + 1)


class LengthPolicy(ABC):
    """Chooses each request's draft length before a round and learns from its outcome."""

    def __init__(self, max_length: int) -> None:
        self.max_length = max_length

    @abstractmethod
    def lengths(self, requests: list[Request], cost: float) -> list[int]:
        """Draft length per request; ``cost`` is the current effective draft/target cost ratio."""

    def keep_drafting(self, requests: list[Request], draft_logits: torch.Tensor, step: int) -> torch.Tensor | None:
        """Rows that should draft another token after ``step`` drafts (None: all of them)."""
        return None

    def update(self, request: Request, proposed: int, accepted: int) -> None:
        """Learn from one verified round."""

    def release(self, request: Request) -> None:
        """Forget a finished request."""


class FixedLength(LengthPolicy):
    def lengths(self, requests: list[Request], cost: float) -> list[int]:
        return [self.max_length] * len(requests)


class EntropyLength(LengthPolicy):
    """Entropy-adaptive draft length (EGAG): stop drafting once the draft model is unsure.

    After at least ``gamma_min`` drafts, a row stops when the EMA-smoothed normalised entropy of
    its draft distribution, H(q)/log|V|, exceeds ``threshold``: a flat q rarely survives
    verification, so further drafts would be wasted work.
    """

    def __init__(self, max_length: int, gamma_min: int, threshold: float, ema_beta: float = 0.5) -> None:
        super().__init__(max_length)
        self.gamma_min = max(1, gamma_min)
        self.threshold = threshold
        self.beta = ema_beta
        self._ema: dict[str, float] = {}

    def lengths(self, requests: list[Request], cost: float) -> list[int]:
        return [self.max_length] * len(requests)

    def keep_drafting(self, requests: list[Request], draft_logits: torch.Tensor, step: int) -> torch.Tensor | None:
        log_probs = torch.log_softmax(draft_logits.float(), dim=-1)
        entropy = -(log_probs.exp() * log_probs).sum(-1) / math.log(draft_logits.shape[-1])
        keep = []
        for request, h in zip(requests, entropy.tolist(), strict=True):
            prev = self._ema.get(request.request_id, h)
            smoothed = self.beta * prev + (1 - self.beta) * h
            self._ema[request.request_id] = smoothed
            keep.append(step < self.gamma_min or smoothed <= self.threshold)
        return torch.tensor(keep, dtype=torch.bool)

    def release(self, request: Request) -> None:
        self._ema.pop(request.request_id, None)


class GoodputLength(LengthPolicy):
    """Pick the K in [0, max_length] that maximises Theorem 3.8 for the batch's acceptance rates.

    α is an exponential moving average of the request's per-token acceptance, starting from the
    acceptance this drafter has recently achieved across requests (a fixed prior until it has any:
    a new request is most likely like the last ones, and short requests would otherwise spend
    their few rounds climbing from a pessimistic prior); ``cost`` comes from the runner's measured timings and grows with batch size, because a
    verification pass of K+1 tokens per request gets dearer as the batch fills. K = 0 (plain
    decoding) is chosen whenever speculation cannot pay; every ``probe_every`` plain rounds one
    round drafts two tokens so a request whose text turns predictable can win speculation back.
    """

    def __init__(self, max_length: int, prior_alpha: float = 0.6, ema: float = 0.3, probe_every: int = 16) -> None:
        super().__init__(max_length)
        self.prior_alpha = prior_alpha
        self.ema = ema
        self.probe_every = probe_every
        self.alpha: dict[str, float] = {}
        self.recent_alpha = prior_alpha  # EMA over every request's rounds: where new requests start
        self._plain_rounds: dict[str, int] = {}

    def lengths(self, requests: list[Request], cost: float) -> list[int]:
        # One K for the whole batch: drafting runs as many steps as the longest draft and the
        # verification pass is padded to it, so a round costs what its longest draft costs. Pick
        # the K that maximises the batch's expected tokens per unit of time (Theorem 3.8 summed
        # over requests; for one request it is the theorem itself).
        alphas = [self.alpha.get(r.request_id, self.recent_alpha) for r in requests]
        best = max(range(self.max_length + 1),
                   key=lambda k: sum(expected_speedup(a, k, 0.0) for a in alphas) / (cost * k + 1))
        if best > 0:
            return [best] * len(requests)
        out = []
        for request in requests:
            waited = self._plain_rounds.get(request.request_id, 0) + 1
            self._plain_rounds[request.request_id] = waited
            probe = 0
            if waited >= self.probe_every:
                # Two drafts, so the draft model's single-token step gets timed too (the first
                # step of a round also catches the draft cache up and is not a clean sample).
                probe, self._plain_rounds[request.request_id] = min(2, self.max_length), 0
            out.append(probe)
        return out

    def update(self, request: Request, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        # Per-token acceptance of this round: accepted drafts over drafts actually judged (the
        # first rejection ends a round, so later drafts were never tested).
        judged = accepted + (1 if accepted < proposed else 0)
        observed = accepted / judged
        prev = self.alpha.get(request.request_id, self.recent_alpha)
        self.alpha[request.request_id] = (1 - self.ema) * prev + self.ema * observed
        self.recent_alpha = (1 - self.ema / 4) * self.recent_alpha + self.ema / 4 * observed

    def release(self, request: Request) -> None:
        self.alpha.pop(request.request_id, None)
        self._plain_rounds.pop(request.request_id, None)


def make_length_policy(name: str, spec_length: int, max_length: int, gamma_min: int,
                       entropy_threshold: float) -> LengthPolicy:
    if name == "fixed":
        return FixedLength(spec_length)
    if name == "entropy":
        return EntropyLength(max_length, gamma_min, entropy_threshold)
    if name == "goodput":
        return GoodputLength(max_length)
    raise ValueError(f"unknown spec_length_policy {name!r}")
