"""Speculative decoding inside continuous batching: draft, verify in one target pass, roll back.

Prefill is the target runner's own; only decode changes. Per round and per request (Leviathan
et al., Algorithm 1): the proposer drafts t_1..t_K with distributions q_i; one batched target pass
over [g, t_1..t_K] gives p_1..p_{K+1} through the same sampling transform; the rejection sampler
keeps a prefix and adds one target token; both caches roll back to what was kept.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from infer.engine.continuous_runner import ContinuousRunner, PrefillChunk, StepResult
from infer.engine.request import Request, StepOutput
from infer.sampling.transforms import SamplingBatch, presence_with_drafts, probs_from_logits, token_presence
from infer.speculative.cost_model import CostModel
from infer.speculative.length_policy import LengthPolicy, make_length_policy
from infer.speculative.proposer import Proposal, Proposer
from infer.speculative.rejection import verify_drafts

if TYPE_CHECKING:
    from infer.engine.engine import Engine


class SpeculativeRunner:
    """Same interface as ``ContinuousRunner``; the scheduler cannot tell them apart."""

    def __init__(self, target: ContinuousRunner, proposer: Proposer, policy: LengthPolicy, max_draft: int) -> None:
        self.target = target
        self.proposer = proposer
        self.policy = policy
        self.max_draft = max_draft
        self.costs = CostModel(proposer.relative_cost_hint)
        self.device = target.pool.device

    # -- runner interface ------------------------------------------------------------------------
    def step(self, prefill: list[PrefillChunk], decode: list[Request]) -> StepResult:
        return self.target.prefill(prefill) + self.speculative_decode(decode)

    def free_slot(self, request: Request) -> None:
        self.target.free_slot(request)
        self.proposer.release(request)

    def cleanup_request(self, request: Request) -> None:
        self.policy.release(request)

    def free_kv_tokens(self) -> int:
        draft_free = self.proposer.free_kv_tokens()
        target_free = self.target.free_kv_tokens()
        return target_free if draft_free is None else min(target_free, draft_free)

    def can_admit(self, request: Request, running: list[Request]) -> bool:
        # Verification writes up to max_draft + 1 positions past the kept length before rollback.
        extra = self.max_draft + 1
        return self.target.can_admit(request, running, extra) and self.proposer.can_admit(request, running, extra)

    # -- one speculative round -------------------------------------------------------------------
    def speculative_decode(self, requests: list[Request]) -> StepResult:
        if not requests:
            return []
        lengths = [self._clamp(r, k) for r, k in
                   zip(requests, self.policy.lengths(requests, self.costs.effective_cost(len(requests))), strict=True)]
        if not any(lengths):  # nothing worth drafting: a plain decode step
            start = self._now()
            out = self.target.decode(requests)
            self.costs.observe_target(len(requests), self._now() - start)
            return out
        start = self._now()
        proposal = self.proposer.propose(requests, lengths)
        drafted = self._now()
        steps = max(proposal.num_tokens)
        if steps and getattr(self.proposer, "last_catchup_tokens", 0) <= 2:  # skip rounds with a lazy prefill
            self.costs.observe_draft_step(len(requests), (drafted - start) / steps)
        result = self.verify(requests, proposal)
        self.costs.observe_target(len(requests) + sum(proposal.num_tokens), self._now() - drafted)
        return result

    def verify(self, requests: list[Request], proposal: Proposal) -> StepResult:
        """One batched target pass over [g, t_1..t_k] per request, rejection sampling, rollback."""
        runner = self.target.runner
        draft_lists = proposal.tokens.tolist()
        runs = [[r.output_token_ids[-1]] + draft_lists[b][: proposal.num_tokens[b]] for b, r in enumerate(requests)]
        hidden = runner.forward([r.slot for r in requests], runs)  # type: ignore[misc]
        logits = runner.logits(hidden)  # [B, W+1, V]
        batch, width, vocab = logits.shape
        sampling = SamplingBatch.from_params([r.params for r in requests], self.device)
        presence = None
        if sampling.use_penalty:  # position i's penalty context includes the drafts before it
            base = token_presence([r.all_token_ids for r in requests], vocab, self.device)
            presence = presence_with_drafts(base, proposal.tokens[:, : width - 1]).flatten(0, 1)
        target_probs = probs_from_logits(logits.flatten(0, 1), sampling.repeat_rows(width), presence)
        draft_probs = None if proposal.probs is None else proposal.probs[:, : width - 1]
        verdict = verify_drafts(
            proposal.tokens[:, : width - 1], torch.tensor(proposal.num_tokens, device=self.device),
            target_probs.view(batch, width, vocab), draft_probs, sampling.greedy, [r.generator for r in requests],
        )
        accepted = verdict.num_accepted.tolist()
        emitted = verdict.output_tokens.tolist()
        outputs: StepResult = []
        for b, request in enumerate(requests):
            kept, proposed = accepted[b], proposal.num_tokens[b]
            # The target cache now holds g and the accepted drafts; the final token stays pending.
            request.num_computed_tokens += 1 + kept
            self.target.pool.truncate_to(request.slot, request.num_computed_tokens)  # type: ignore[arg-type]
            self.proposer.accepted(request, proposed, kept)
            self.policy.update(request, proposed, kept)
            request.metrics.record_round(proposed, kept)
            outputs.extend((request, StepOutput(t)) for t in emitted[b][: kept + 1])
        return outputs

    def _clamp(self, request: Request, k: int) -> int:
        """Never draft past the context (overflow guard) or past the request's remaining budget."""
        room_in_context = request.max_seq_len - request.num_tokens
        room_in_budget = request.params.max_tokens - len(request.output_token_ids) - 1
        return max(0, min(k, self.max_draft, room_in_context, room_in_budget))

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


def build_speculative_runner(engine: Engine, target: ContinuousRunner, say: Callable[[str], None]) -> SpeculativeRunner:
    """Make the proposer named by the engine config and wrap the target runner with it."""
    config = engine.config
    max_draft = config.max_draft_length
    policy = make_length_policy(config.spec_length_policy, config.spec_length, max_draft, config.gamma_min,
                                config.entropy_threshold)
    proposer: Proposer
    if config.speculator == "ngram":
        from infer.speculative.ngram import NgramProposer

        proposer = NgramProposer(config.ngram_min, config.ngram_max, engine.device)
    elif config.speculator == "draft":
        from infer.speculative.draft_model import load_draft_proposer

        say(f"loading draft model {config.draft_model}")
        proposer = load_draft_proposer(engine, max_draft)
    elif config.speculator == "medusa":
        from infer.speculative.medusa import load_medusa_proposer  # type: ignore[import-not-found]

        proposer = load_medusa_proposer(engine, max_draft)
    else:
        raise ValueError(f"unknown speculator {config.speculator!r}")
    runner = SpeculativeRunner(target, proposer, policy, max_draft)
    keep_drafting = getattr(policy, "keep_drafting", None)
    if hasattr(proposer, "continue_fn") and config.spec_length_policy == "entropy":
        proposer.continue_fn = keep_drafting
    return runner
