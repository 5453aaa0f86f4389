"""What a drafter reads of the target's passes: each request's newest hidden state (Medusa's
heads) and the captured layer inputs of the positions the target's cache keeps (EAGLE-3)."""

from __future__ import annotations

import torch

from infer.core.model_runner import RaggedPass
from infer.core.request import Request
from infer.engine.continuous_runner import Sampled, StepResult
from infer.speculative.drafter import Drafter
from infer.speculative.verification import Verdict


class TargetStates:
    """The target's states a ``drafter`` reads, kept per request between rounds."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        # Per request the hidden state of the row whose logits produced its newest token.
        self.hidden: dict[str, torch.Tensor] | None = {} if drafter.info.uses_hidden_states else None

    def waiting(self, request: Request) -> bool:
        """Whether the drafter reads hidden states and has none for ``request`` yet (its round is plain)."""
        return self.hidden is not None and request.request_id not in self.hidden

    def drop(self, request: Request) -> None:
        if self.hidden is not None:
            self.hidden.pop(request.request_id, None)

    def keep(self, sampled: Sampled) -> StepResult:
        """A plain pass's (prefill or decode) states handed on; its outputs returned."""
        if sampled.hidden is not None:
            self._store([request for request, _ in sampled.outputs], sampled.hidden)
        for request, position, states in sampled.states:
            self.drafter.observe_states(request, position, states)
        return sampled.outputs

    def keep_verified(self, requests: list[Request], ragged: RaggedPass, verdict: Verdict) -> None:
        """A verification pass's states: the hidden state of the row that gave each final token, and
        the captured layer inputs of the rows the target's cache keeps (``verdict.kept_rows[b]``: g and
        the accepted drafts, in token order), before the requests' computed counts move on."""
        if self.hidden is not None:
            self._store(requests, ragged.rows_at(verdict.last_rows))
        if ragged.aux is None:
            return
        for b, request in enumerate(requests):
            index = torch.tensor([ragged.offsets[b] + row for row in verdict.kept_rows[b]], device=ragged.aux.device)
            self.drafter.observe_states(request, request.num_computed_tokens, ragged.aux[index])

    def rows(self, requests: list[Request]) -> torch.Tensor | None:
        """[B, H] for the drafter; a request without one (its budget is 0) gets a row of zeros."""
        if self.hidden is None:
            return None
        rows = [self.hidden.get(r.request_id) for r in requests]
        known = next(row for row in rows if row is not None)
        return torch.stack([known.new_zeros(known.shape) if row is None else row for row in rows])

    def _store(self, requests: list[Request], hidden: torch.Tensor) -> None:
        if self.hidden is None:  # (a pass may return hidden states no drafter of this runner reads)
            return
        for request, row in zip(requests, hidden.detach().clone(), strict=True):  # a copy frees the pass
            self.hidden[request.request_id] = row
