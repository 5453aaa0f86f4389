"""Speculative decoding inside continuous batching: draft, verify in one target pass, roll back.

Prefill is the target runner's own; only decode changes. Per round and per request (Leviathan
et al., Algorithm 1): the proposer drafts t_1..t_K with distributions q_i; one batched target pass
over [g, t_1..t_K] gives p_1..p_{K+1} through the same sampling transform; the rejection sampler
keeps a prefix and adds one target token; both caches roll back to what was kept.

A proposal may instead be a tree of guesses (Medusa, ``Proposal.parents``): the pass then feeds
[g, node_1..node_N] with a tree attention mask and depth-based positions, ``verify_tree`` keeps one
root-to-node path, and the K/V of that path, scattered through the tree's rows, are compacted into
consecutive positions before the rollback.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from infer.cache.protocol import copy_positions
from infer.engine.continuous_runner import ContinuousRunner, PrefillChunk, StepResult
from infer.engine.request import Request, StepOutput
from infer.sampling.transforms import SamplingBatch, presence_with_drafts, probs_from_logits, token_presence
from infer.speculative.cost_model import CostModel
from infer.speculative.length_policy import LengthPolicy, make_length_policy
from infer.speculative.proposer import Proposal, Proposer
from infer.speculative.rejection import verify_drafts
from infer.speculative.tree import TreeMaskCache, tree_depths, verify_tree

if TYPE_CHECKING:
    from infer.engine.engine import Engine


class SpeculativeRunner:
    """Same interface as ``ContinuousRunner``; the scheduler cannot tell them apart."""

    def __init__(self, target: ContinuousRunner, proposer: Proposer, policy: LengthPolicy, max_draft: int) -> None:
        self.target = target
        self.proposer = proposer
        self.policy = policy
        self.max_draft = max_draft
        # A tree verifies more tokens than it can accept: reserve room for all of them.
        self.max_verify = max(max_draft, proposer.max_verify_nodes or 0)
        self.tree_masks = TreeMaskCache()
        self.costs = CostModel(proposer.relative_cost_hint)
        self.device = target.pool.device
        if proposer.wants_hidden:  # plain prefill/decode passes hand it the target's hidden state
            target.hidden_listener = proposer.observe_hidden

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
        # Verification writes up to max_verify + 1 positions past the kept length before rollback.
        extra = self.max_verify + 1
        return self.target.can_admit(request, running, extra) and self.proposer.can_admit(request, running, extra)

    # -- one speculative round -------------------------------------------------------------------
    def speculative_decode(self, requests: list[Request]) -> StepResult:
        if not requests:
            return []
        lengths = [self._clamp(r, k) for r, k in
                   zip(requests, self.policy.lengths(requests, self.costs.effective_cost(len(requests))), strict=True)]
        start = self._now()
        proposal = self.proposer.propose(requests, lengths) if any(lengths) else None
        drafted = self._now()
        if proposal is None or not any(proposal.num_tokens):
            # Nothing worth drafting (or nothing found): a plain decode step, still one target pass.
            result = self.target.decode(requests)
            self.costs.observe_target(len(requests), self._now() - drafted)
            for request in requests:
                request.metrics.record_round(0, 0)
        else:
            steps = max(proposal.num_tokens)
            # A drafter that times its own single-token steps (the draft model: its first step may
            # also catch up a whole prompt) reports them; otherwise the whole drafting time is used.
            step_seconds = getattr(self.proposer, "last_step_seconds", None)
            if step_seconds is None and not hasattr(self.proposer, "last_step_seconds"):
                step_seconds = (drafted - start) / steps
            if step_seconds is not None:
                self.costs.observe_draft_step(len(requests), step_seconds)
            result = self.verify(requests, proposal)
            self.costs.observe_target(len(requests) + sum(proposal.num_tokens), self._now() - drafted)
        self.proposer.round_finished(len(result), self._now() - start)
        return result

    def verify(self, requests: list[Request], proposal: Proposal) -> StepResult:
        """One batched target pass over [g, t_1..t_k] per request, rejection sampling, rollback."""
        if proposal.parents is not None:
            return self.verify_tree(requests, proposal)
        width = 1 + max(proposal.num_tokens)
        drafts = proposal.tokens[:, : width - 1]
        hidden = self.target.runner.forward([r.slot for r in requests], self._runs(requests, drafts, proposal.num_tokens))  # type: ignore[misc]
        target_probs, sampling = self._target_probs(requests, hidden, drafts)
        draft_probs = None if proposal.probs is None else proposal.probs[:, : width - 1]
        verdict = verify_drafts(
            drafts, torch.tensor(proposal.num_tokens, device=self.device), target_probs, draft_probs,
            sampling.greedy, [r.generator for r in requests],
        )
        accepted = verdict.num_accepted.tolist()
        emitted = [row[: kept + 1] for row, kept in zip(verdict.output_tokens.tolist(), accepted, strict=True)]
        return self._finish_round(requests, proposal.num_tokens, proposal.num_tokens, accepted, emitted)

    def verify_tree(self, requests: list[Request], proposal: Proposal) -> StepResult:
        """One batched target pass over [g, tree nodes] with tree attention, tree acceptance, and
        KV compaction of the accepted path, then rollback."""
        assert proposal.parents is not None
        runner, pool = self.target.runner, self.target.pool
        counts = proposal.num_tokens
        width = max(counts, default=0)
        tokens, parents = proposal.tokens[:, :width], proposal.parents[:, :width]
        slots: list[int] = [r.slot for r in requests]  # type: ignore[misc]
        starts = [pool.seq_len(s) for s in slots]
        mask = self.tree_masks(parents, counts)  # [B, W+1, W+1] ancestor-or-self, row 0 = g
        depths = tree_depths(mask)
        # Node at depth d sits at RoPE position start + d, where it would be if its path were kept.
        positions = torch.tensor(starts, device=self.device).unsqueeze(1) + depths
        hidden = runner.forward(slots, self._runs(requests, tokens, counts), positions=positions, tree_mask=mask)
        target_probs, sampling = self._target_probs(requests, hidden, tokens, mask)
        verdict = verify_tree(tokens, counts, parents, target_probs, sampling.greedy,
                              [r.generator for r in requests], mask)
        batch = len(requests)
        # Compaction: the accepted path's K/V move to start + 1 .. start + kept, right after g.
        moves = []
        for b, path in enumerate(verdict.paths):
            src = [starts[b] + 1 + i for i in path]
            dst = [starts[b] + 1 + j for j in range(len(path))]
            keep = [k for k in range(len(path)) if src[k] != dst[k]]
            if keep:
                moves.append((slots[b], [src[k] for k in keep], [dst[k] for k in keep]))
        copy_positions(pool, moves)
        if self.proposer.wants_hidden:
            last = torch.tensor(verdict.last_rows, device=self.device)
            self.proposer.observe_hidden(requests, hidden[torch.arange(batch, device=self.device), last])
        depth_lists = depths.tolist()
        # Per-depth metrics: a tree of depth d "proposes" d positions, of which `kept` survive.
        tree_depth = [max(depth_lists[b][1: 1 + counts[b]], default=0) for b in range(batch)]
        kept = [len(path) for path in verdict.paths]
        return self._finish_round(requests, counts, tree_depth, kept, verdict.tokens)

    # -- shared by chain and tree rounds ---------------------------------------------------------
    @staticmethod
    def _runs(requests: list[Request], nodes: torch.Tensor, counts: list[int]) -> list[list[int]]:
        """Per request the pending token g followed by its drafted nodes."""
        node_lists = nodes.tolist()
        return [[r.output_token_ids[-1]] + node_lists[b][: counts[b]] for b, r in enumerate(requests)]

    def _target_probs(self, requests: list[Request], hidden: torch.Tensor, nodes: torch.Tensor,
                      ancestors: torch.Tensor | None = None) -> tuple[torch.Tensor, SamplingBatch]:
        """Target distributions [B, R, V] of the verification rows through the request's own transform.

        Row i's repetition-penalty context is the request's tokens plus the drafted tokens on its
        path: t_1..t_i for a chain, the node's ancestors (``ancestors`` [B, R, R]) for a tree.
        """
        logits = self.target.runner.logits(hidden)  # [B, R, V]
        batch, rows, vocab = logits.shape
        sampling = SamplingBatch.from_params([r.params for r in requests], self.device)
        presence = None
        if sampling.use_penalty:
            base = token_presence([r.all_token_ids for r in requests], vocab, self.device)
            if ancestors is None:
                presence = presence_with_drafts(base, nodes)
            else:
                on_path = torch.zeros(batch, rows, vocab, device=self.device)
                on_path[:, 1:].scatter_(2, nodes.unsqueeze(2), 1.0)
                presence = (torch.bmm(ancestors.float(), on_path) > 0) | base.unsqueeze(1)
            presence = presence.flatten(0, 1)
        probs = probs_from_logits(logits.flatten(0, 1), sampling.repeat_rows(rows), presence)
        return probs.view(batch, rows, vocab), sampling

    def _finish_round(self, requests: list[Request], proposed: list[int], judged: list[int], kept: list[int],
                      emitted: list[list[int]]) -> StepResult:
        """Roll the target cache back to g + the kept drafts, inform proposer/policy/metrics, emit."""
        outputs: StepResult = []
        for b, request in enumerate(requests):
            # The target cache now holds g and the accepted drafts; the final token stays pending.
            request.num_computed_tokens += 1 + kept[b]
            self.target.pool.truncate_to(request.slot, request.num_computed_tokens)  # type: ignore[arg-type]
            self.proposer.accepted(request, proposed[b], kept[b])
            self.policy.update(request, judged[b], kept[b])
            request.metrics.record_round(judged[b], kept[b])
            outputs.extend((request, StepOutput(t)) for t in emitted[b])
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
        from infer.speculative.medusa import load_medusa_proposer

        say(f"loading Medusa heads for {config.model}")

        proposer = load_medusa_proposer(engine, max_draft)
    else:
        raise ValueError(f"unknown speculator {config.speculator!r}")
    runner = SpeculativeRunner(target, proposer, policy, max_draft)
    keep_drafting = getattr(policy, "keep_drafting", None)
    if hasattr(proposer, "continue_fn") and config.spec_length_policy == "entropy":
        proposer.continue_fn = keep_drafting
    return runner
