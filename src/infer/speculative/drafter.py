"""The drafter contract: every way of guessing tokens (draft model, n-gram, Medusa) is a ``Drafter``.

The engine's speculative runner (``engine/speculative_runner.py``) drives a drafter through this
interface and nothing else:

* ``info`` (a :class:`DrafterInfo`, set in ``__init__``) declares what the drafter is: chains or
  trees, the most nodes one round can verify, whether it needs the target's hidden states, whether
  its cost grows with every drafted token, and a prior for that cost.
* ``propose(requests, budgets, hidden_states) -> Proposal`` drafts for a batch. ``budgets[b]`` is
  the most nodes request ``b`` may get this round (a chain's length or a tree's node count), as
  decided by the runner's budget controller and already clamped so verification fits the
  request's context and its own ``max_draft_tokens`` (``Request.draft_room``); a chain is also clamped to the tokens the request
  may still emit (``Request.tokens_left``), by which a tree drafter caps its depth itself. 0 means
  "do not draft for it". ``requests[b].all_token_ids`` ends with the last
  accepted token. ``hidden_states`` is the target's last hidden state per request ([B, hidden],
  the position whose logits produced the newest token) when ``info.uses_hidden_states``, else None.
* ``info.aux_layers`` (EAGLE-3): the target layers whose inputs the drafter reads (vLLM's layer
  ids, ``models.layers.AuxCapture``). The runner then has every target pass capture them and calls
  ``observe_states(request, position, states)`` with those of each token the target's cache keeps
  (prompt chunks, plain steps, a verification's g and accepted drafts), in order: ``states[i]`` is
  the token at ``position + i``. A token served from the prefix cache is never computed, so never
  observed; a drafter must draft (or decline) without it.
* ``accepted(request, num_proposed, num_accepted)`` after verification, so a stateful drafter can
  roll back to what was kept.
* ``release(request)`` once the request is gone: free everything held for it.
* Capacity: ``kv_pool`` (its own KV pool, None if it has none) and ``admission`` (room to finish
  one more request); the scheduler admits a request only if every pool can hold it.
* Timing: the runner times every round and feeds its budget controller. A drafter with
  ``info.cost_per_token`` (one step per drafted token) reports its own per-step time as
  ``Proposal.step_seconds``, apart from set-up work such as catching its cache up (None: no clean
  sample this round); for any other drafter the runner's timing of ``propose`` stands.

Porting a drafter: subclass ``Drafter``, set ``self.info`` in ``__init__``, implement
``propose`` (and ``accepted``/``release`` if it keeps per-request state), build it in
``make_drafter`` in ``engine/drafters.py``. Nothing in this package imports the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.cache.protocol import CachePoolProtocol
from infer.core.request import Request

if TYPE_CHECKING:
    from infer.core.model_runner import Admission


@dataclass
class Proposal:
    """Draft tokens for a batch of requests (row b has ``num_tokens[b]`` valid entries)."""

    tokens: torch.Tensor  # [B, N] long, padded with 0 past num_tokens[b]
    num_tokens: list[int]
    # Draft distributions q_i after the request's sampling transform, [B, N, V]; None when every
    # proposal is a deterministic guess (one-hot q), as for n-gram lookup.
    probs: torch.Tensor | None
    # A tree of guesses instead of a chain (Medusa): parents[b, i] is the index of node i's parent
    # node in the same row, -1 for the root (the last accepted token); parents come before their
    # children. None is a chain (node i's parent is i - 1), verified by the chain path.
    parents: torch.Tensor | None = None
    # Seconds per sequential draft step measured by the drafter itself, when it can tell them
    # apart from set-up work (the draft model's first step also catches its cache up); None: the
    # runner's own timing of the whole call stands.
    step_seconds: float | None = None


@dataclass(frozen=True)
class DrafterInfo:
    """What the runner and its budget controller need to know about a drafter."""

    tree: bool = False  # proposals are trees (budgets count nodes; sized on a ladder of tree sizes)
    # The round's draft limit: most nodes one round can verify (None: a chain's, its budget).
    max_draft_tokens: int | None = None
    uses_hidden_states: bool = False  # propose() reads the target's last hidden state per request
    # One sequential step per drafted token (a draft model), so drafting costs grow with the budget;
    # False: one call per round whatever the budget (n-gram lookup, Medusa heads).
    cost_per_token: bool = False
    cost_hint: float = 0.0  # prior for one draft step's time over one target decode step
    aux_layers: tuple[int, ...] = ()  # target layer inputs observe_states receives (EAGLE-3); () none
    # Of those, a round feeds only the newest aux_window positions' (None: every one), so a pass more
    # than aux_window rounds before the next round that may draft need not capture them.
    aux_window: int | None = None


class Drafter(ABC):
    """Guesses up to ``budgets[b]`` next tokens for each request; learns what was accepted."""

    info: DrafterInfo = DrafterInfo()

    @abstractmethod
    def propose(self, requests: list[Request], budgets: list[int], hidden_states: torch.Tensor | None) -> Proposal:
        """Draft for every request (see the module docstring for the arguments)."""

    def match_classes(self, requests: list[Request]) -> list[int] | None:
        """Before a round, per request, a class of the draft it would make now (for prompt lookup:
        how many tokens of context matched), for the budget to learn acceptance per class: a draft
        after a long match is accepted far more often than one after a single token. None: the
        drafter has no such classes (its acceptance is learned per request only)."""
        return None

    def observe_states(self, request: Request, position: int, states: torch.Tensor) -> None:
        """The target's captured layer inputs ([n, aux]) of the request's tokens at ``position`` onward,
        now kept in its cache (only with ``info.aux_layers``)."""

    def accepted(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Verification kept ``num_accepted`` of the ``num_proposed`` drafts of ``request``."""

    def release(self, request: Request) -> None:
        """The request is gone: free anything held for it (a draft KV slot, an index)."""

    @property
    def kv_pool(self) -> CachePoolProtocol | None:
        """The drafter's own KV pool (a draft model's), or None."""
        return None

    def admission(self, running: list[Request]) -> Admission | None:
        """One step's checks of whether the drafter can finish a request besides every running one
        (``Admission.fits(request, extra)``: ``extra`` tokens per request of room beyond
        ``max_total_tokens`` for a round's overrun), or None: it holds nothing per token."""
        return None


class NoDrafter(Drafter):
    """Proposes nothing: the drafter of an engine without a speculator, whose speculative rounds draft
    only what a request's grammar forces (the runner's grammar drafting)."""

    def __init__(self) -> None:
        self.info = DrafterInfo()

    def match_classes(self, requests: list[Request]) -> list[int]:
        return [0] * len(requests)  # nothing to draft: the budget is never asked

    def propose(self, requests: list[Request], budgets: list[int], hidden_states: torch.Tensor | None) -> Proposal:
        return Proposal(torch.zeros(len(requests), 0, dtype=torch.long), [0] * len(requests), None)


def pad_proposals(guesses: list[list[int]], device: torch.device) -> Proposal:
    """A one-hot Proposal from per-request token lists of different lengths."""
    width = max((len(g) for g in guesses), default=0)
    tokens = torch.zeros(len(guesses), width, dtype=torch.long)
    for b, guess in enumerate(guesses):
        if guess:
            tokens[b, : len(guess)] = torch.as_tensor(guess, dtype=torch.long)
    return Proposal(tokens.to(device), [len(g) for g in guesses], None)
