"""The drafter interface: every way of guessing tokens (draft model, n-gram, Medusa) is a Proposer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from infer.engine.request import Request


@dataclass
class Proposal:
    """Draft tokens for a batch of requests (row b has ``num_tokens[b]`` valid entries)."""

    tokens: torch.Tensor  # [B, K] long, padded with 0 past num_tokens[b]
    num_tokens: list[int]
    # Draft distributions q_i after the request's sampling transform, [B, K, V]; None when every
    # proposal is a deterministic guess (one-hot q), as for n-gram lookup.
    probs: torch.Tensor | None
    # A tree of guesses instead of a chain (Medusa): parents[b, i] is the index of node i's parent
    # node in the same row, -1 for the root (the last accepted token); parents come before their
    # children. None is a chain (node i's parent is i - 1), verified by the chain path.
    parents: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return int(self.tokens.shape[1])

    @property
    def is_tree(self) -> bool:
        return self.parents is not None


class Proposer(ABC):
    """Guesses up to ``max_tokens[b]`` next tokens for each request; learns what was accepted."""

    name: str = "proposer"
    # Set by drafters that guess from the target's own last hidden state (Medusa): the runner then
    # calls ``observe_hidden`` after every target pass that produced a token for a request.
    wants_hidden: bool = False
    # The most nodes one round may verify when that exceeds the draft length (a tree); the runner
    # reserves KV room for them. None: a chain of at most max_draft tokens.
    max_verify_nodes: int | None = None

    @abstractmethod
    def propose(self, requests: list[Request], max_tokens: list[int]) -> Proposal:
        """Draft for every request. ``requests[b].all_token_ids`` ends with the last accepted token.

        ``max_tokens[b]`` bounds the tokens one round can accept: a chain's length, a tree's depth.
        """

    def accepted(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Called after verification so a stateful drafter can roll back to what was kept."""

    def observe_hidden(self, requests: list[Request], hidden: torch.Tensor) -> None:
        """The target's final hidden state [B, hidden] at the position whose logits produced each
        request's newest token (called only when ``wants_hidden``)."""

    def round_finished(self, num_tokens: int, seconds: float) -> None:
        """A whole round (drafting, verification, rollback) emitted ``num_tokens`` in ``seconds``."""

    def release(self, request: Request) -> None:
        """The request is gone: free anything held for it (a draft KV slot)."""

    def can_admit(self, request: Request, running: list[Request], extra: int) -> bool:
        """Whether the drafter has room for one more request (a draft KV pool may not)."""
        return True

    def free_kv_tokens(self) -> int | None:
        """Free tokens in the drafter's own KV pool, or None if it has none."""
        return None

    @property
    def relative_cost_hint(self) -> float:
        """A prior for c (draft step time / target step time) until the runner has measured it."""
        return 0.0


def pad_proposals(guesses: list[list[int]], device: torch.device) -> Proposal:
    """A one-hot Proposal from per-request token lists of different lengths."""
    width = max((len(g) for g in guesses), default=0)
    tokens = torch.zeros(len(guesses), width, dtype=torch.long)
    for b, guess in enumerate(guesses):
        if guess:
            tokens[b, : len(guess)] = torch.as_tensor(guess, dtype=torch.long)
    return Proposal(tokens.to(device), [len(g) for g in guesses], None)
