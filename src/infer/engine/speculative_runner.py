"""Speculative decoding inside continuous batching: propose, verify in one target pass, commit.

Prefill is the target runner's own; only decode changes. A round, per request (Leviathan et al.,
Algorithm 1): **propose**: the drafter drafts t_1..t_K within the budget's limits, and a request's
grammar filters that proposal into the one verified (``speculative.grammar_filter``: forbidden
drafts dropped, forced tokens drafted); **verify**: one ragged target pass over [g, t_1..t_K] gives
p_1..p_{K+1} through the request's own sampling transform, and ``verification.verify`` keeps a path
of the drafts and adds one target token (a tree of guesses, ``Proposal.parents``, is fed with a tree
attention mask and depth-based positions); **commit**: the target cache keeps g and the accepted
drafts (a tree's path, scattered through the pass's rows, compacted into consecutive positions
first), the drafter and the budget hear the outcome, and the emitted tokens go out. With no drafter
at all (``NoDrafter``) only the grammar drafts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infer.cache.protocol import CachePoolProtocol, copy_positions
from infer.core.model_runner import RaggedPass
from infer.core.request import Request, StepOutput
from infer.core.timing import RoundTimes, device_clock
from infer.engine.continuous_runner import ContinuousRunner, PrefillChunk, StepResult
from infer.engine.target_states import TargetStates
from infer.phases import PHASES
from infer.sampling.sampler import logprobs_at_rows
from infer.sampling.transforms import SamplingBatch, argmax_only, greedy_tokens
from infer.speculative.budget import BudgetController
from infer.speculative.drafter import Drafter, NoDrafter, Proposal
from infer.speculative.grammar_filter import GRAMMAR_MAX_DRAFT, GrammarRound, filter_proposal
from infer.speculative.tree import TreeMaskCache, tree_depths
from infer.speculative.verification import DraftLayout, Verdict, target_distributions, verify


class SpeculativeRunner:
    """Same interface as ``ContinuousRunner``; the scheduler cannot tell them apart.

    The runner drives ``drafter`` only through the drafter contract (``infer.speculative.drafter``)
    and asks ``budget`` how much every round drafts, feeding it the round's timings and outcome.
    """

    def __init__(self, target: ContinuousRunner, drafter: Drafter, budget: BudgetController,
                 grammar_drafting: bool = False) -> None:
        self.target = target
        self.drafter = drafter
        self.budget = budget
        self.grammar_drafting = grammar_drafting
        # No drafter: a round of requests without a grammar is a plain step and nothing more.
        self._grammar_only = isinstance(drafter, NoDrafter)
        # Verification writes g plus every node; a tree verifies more nodes than it can accept; a
        # request with a grammar, up to GRAMMAR_MAX_DRAFT nodes with grammar drafting.
        self.max_draft_tokens = 0 if self._grammar_only else max(budget.max_draft_tokens,
                                                                 drafter.info.max_draft_tokens or 0)
        self.grammar_max_draft_tokens = max(self.max_draft_tokens, GRAMMAR_MAX_DRAFT if grammar_drafting else 0)
        self.tree_masks = TreeMaskCache()
        self.device = target.pool.device
        self.states = TargetStates(drafter)  # what the drafter reads of the target's passes
        if drafter.info.aux_layers:  # every target pass keeps the layer inputs the drafter reads
            target.runner.aux_layers = drafter.info.aux_layers
        self.round_times = RoundTimes()
        self.last_pass_rows = 0  # token rows the last verification pass computed (what the budget costs)

    def reset_round_times(self) -> None:
        self.round_times = RoundTimes()

    # -- runner interface ------------------------------------------------------------------------
    def step(self, prefill: list[PrefillChunk], decode: list[Request]) -> StepResult:
        if prefill:
            self._choose_capture()
        return self.states.keep(self.target.prefill(prefill)) + self.speculative_decode(decode)

    def _choose_capture(self) -> None:
        """Whether the next target pass captures the layer inputs the drafter reads: not while the
        budget will keep every round plain for longer than the drafter looks back (an EAGLE head
        resting between probes), since those states would never be fed. Capturing changes no
        arithmetic, only the copies and the drafter's bookkeeping a plain round pays."""
        layers, window = self.drafter.info.aux_layers, self.drafter.info.aux_window
        if layers:
            wanted = window is None or self.budget.plain_rounds_ahead() < window
            self.target.runner.aux_layers = layers if wanted else ()

    def release(self, request: Request) -> None:
        self.target.release(request)
        self.drafter.release(request)
        self.budget.release(request)
        self.states.drop(request)

    def rollback(self, request: Request, num_computed_tokens: int) -> None:
        # The drafter's state and the kept hidden state may be ahead of the rolled-back target:
        # drop them; a drafter rebuilds a released request's state on its next round, and without a
        # hidden state the request's next round is a plain step that provides one.
        self.target.rollback(request, num_computed_tokens)
        self.drafter.release(request)
        self.states.drop(request)

    def free_kv_tokens(self) -> int:
        return min(pool.free_kv_tokens() for pool in self.kv_pools().values())

    def kv_pools(self) -> dict[str, CachePoolProtocol]:
        pools = self.target.kv_pools()
        if self.drafter.kv_pool is not None:
            pools["draft"] = self.drafter.kv_pool
        return pools

    def admission(self, running: list[Request]) -> Callable[[Request], bool]:
        # Verification writes up to max_draft_tokens + 1 positions past the kept length before rollback (a
        # grammar's request up to grammar_max_draft_tokens + 1), so room is kept for that whenever a grammar is
        # among the requests; without a drafter a batch without one is admitted as plain.
        target, drafter = self.target.admission(running), self.drafter.admission(running)
        counted, grammar_running = 0, False  # running requests looked at; whether one has a grammar

        def fits(request: Request) -> bool:
            nonlocal counted, grammar_running
            grammar_running = grammar_running or any(r.grammar is not None for r in running[counted:])
            counted = len(running)
            grammar = request.grammar is not None or grammar_running
            extra = (self.grammar_max_draft_tokens if grammar else self.max_draft_tokens) + 1
            if self._grammar_only and not grammar:
                extra = 0
            return target.fits(request, extra) and (drafter is None or drafter.fits(request, extra))

        return fits

    # -- one speculative round -------------------------------------------------------------------
    def speculative_decode(self, requests: list[Request]) -> StepResult:
        if not requests:
            return []
        if self._grammar_only and not (self.grammar_drafting and any(r.grammar is not None for r in requests)):
            return self.states.keep(self.target.decode(requests))
        # Drafting and rejection between the passes, threaded as the backend wants (Backend.host_policy).
        with self.target.runner.host_work():
            return self._round(requests)

    def _round(self, requests: list[Request]) -> StepResult:
        """Algorithm 1 for the batch: propose (the drafter within the budgets, then the grammar's
        filter), verify in one target pass and commit; a round with nothing to verify is a plain step.
        The round is timed here for the budget's cost fit: a verification from the end of the
        drafter's call, costed by the rows its pass computed (sum_b (1 + k_b), the pass being ragged;
        a CUDA graph replay, padded to its bucket, only takes equal runs: the same count)."""
        since = PHASES.mark()
        budgets = self._budgets(requests)
        self._choose_capture()
        proposal, grammar, start = self._propose(requests, budgets) if budgets is not None else (None, None, 0.0)
        PHASES.add("drafting", since)
        verifies = proposal is not None and any(proposal.num_tokens)
        if not verifies:  # nothing worth drafting (or nothing found): a plain decode step, still one pass
            for request, count in zip(requests, grammar.drafted if grammar is not None else [], strict=False):
                if count:  # the grammar dropped every draft: the drafter keeps none of them
                    self.drafter.accepted(request, count, 0)
            start = device_clock(self.device)
        result = self.verify(requests, proposal, grammar) if proposal is not None and verifies else self._plain(requests)
        elapsed = device_clock(self.device) - start
        self.budget.observe_target(self.last_pass_rows if verifies else len(requests), elapsed)
        self.round_times.add(verifies, elapsed)
        return result

    def _forcing(self, requests: list[Request]) -> bool:
        """Whether the grammar drafts this round what it forces (whether or not the drafter found anything)."""
        return self.grammar_drafting and any(r.grammar is not None and r.draft_room for r in requests)

    def _budgets(self, requests: list[Request]) -> list[int] | None:
        """Each request's budget this round, clamped (``_clamp``); None: a plain round. Rounds that
        cannot draft skip the drafter's matching and the budget's decision (a few percent of a small
        model's decode step, paid by every round): every request turned speculation off, or the
        drafter found nothing to continue for any (class 0 neither drafts nor probes), and the grammar
        forces nothing. A drafter catches up with the tokens it skipped when it next looks."""
        classes = self.drafter.match_classes(requests) if any(r.draft_room for r in requests) else []
        if classes is not None and not any(classes):
            return [0] * len(requests) if self._forcing(requests) else None
        return [self._clamp(r, n) for r, n in zip(requests, self.budget.budgets(requests, classes), strict=True)]

    def _propose(self, requests: list[Request], budgets: list[int]) -> tuple[Proposal | None, GrammarRound | None, float]:
        """The drafter's proposal within ``budgets``, then the grammar's filter from it to the proposal
        verified (``filter_proposal``), and the device clock when the drafter's call ended. The call is
        timed for the budget: a drafter that runs one step per token reports its clean per-step time
        (None: no clean sample this round); otherwise drafting is one call per round."""
        batch, drafting = len(requests), any(budgets)
        start = device_clock(self.device)
        proposal = self.drafter.propose(requests, budgets, self.states.rows(requests)) if drafting else None
        drafted = device_clock(self.device)
        if drafting:
            self.round_times.drafter_calls += 1
            self.round_times.propose_seconds += drafted - start
        grammar = None
        if proposal is None and self._forcing(requests):
            proposal = Proposal(torch.zeros(batch, 0, dtype=torch.long, device=self.device), [0] * batch, None)
        if proposal is not None and any(r.grammar is not None for r in requests):
            proposal, grammar = filter_proposal(requests, proposal, self.target.runner.vocab_size, self.device,
                                                self.grammar_max_draft_tokens if self.grammar_drafting else None)
        if drafting and proposal is not None and any(proposal.num_tokens):  # (the grammar alone makes no call)
            seconds = proposal.step_seconds if self.drafter.info.cost_per_token else drafted - start
            if seconds is not None:
                self.budget.observe_draft_step(batch, seconds)
        return proposal, grammar, drafted

    def _plain(self, requests: list[Request]) -> StepResult:
        """A round without drafts: a plain decode step."""
        result = self.states.keep(self.target.decode(requests))
        zeros = [0] * len(requests)
        self.budget.observe_round(requests, zeros, zeros, zeros)
        for request in requests:
            request.metrics.record_round(0, 0, 0)
        return result

    def verify(self, requests: list[Request], proposal: Proposal, grammar: GrammarRound | None = None) -> StepResult:
        """One ragged target pass over [g, node_1..node_k] per request (each request's own rows), one
        verdict (``_judge``), one commit (``_commit``), for chains and trees alike."""
        since = PHASES.mark()
        pool = self.target.pool
        drafts = DraftLayout.of(proposal.tokens, proposal.num_tokens, proposal.parents, proposal.probs,
                                lambda: [pool.seq_len(r.slot) for r in requests])  # type: ignore[arg-type]
        mask = positions = None
        if drafts.parents is not None:
            mask = self.tree_masks(drafts.parents, drafts.counts)  # [B, W+1, W+1] ancestor-or-self, row 0 = g
            depths = tree_depths(mask)
            drafts.depths = depths.tolist()
            # Node at depth d sits at RoPE position start + d, where it would be if its path were kept.
            positions = torch.tensor(drafts.starts, device=self.device).unsqueeze(1) + depths
        # Ragged: request b's rows [g, node_1..node_kb] back to back, sum_b (1 + k_b) rows through the
        # model and the LM head; only the sampling step sees them padded to [B, 1 + max k].
        runs = [[r.output_token_ids[-1]] + drafts.nodes[b][: drafts.counts[b]] for b, r in enumerate(requests)]
        ragged = self.target.runner.forward_ragged([r.slot for r in requests], runs, positions=positions,  # type: ignore[misc]
                                                   tree_mask=mask, logits=True)
        self.last_pass_rows = ragged.rows
        since = PHASES.add("verify pass", since)
        verdict, processed, sampling = self._judge(requests, drafts, mask, ragged, grammar)
        PHASES.add("rejection", since)
        return self._commit(requests, drafts, ragged, verdict, processed, sampling, grammar)

    def _judge(self, requests: list[Request], drafts: DraftLayout, mask: torch.Tensor | None, ragged: RaggedPass,
               grammar: GrammarRound | None) -> tuple[Verdict, torch.Tensor, SamplingBatch | None]:
        """The verdict on every request's drafts, with the processed logits [B, R, V] its logprobs come
        from and the sampling batch (None: a greedy round, which builds no distribution)."""
        logits = ragged.logits  # [N, V]
        assert logits is not None
        params = [r.params for r in requests]
        if argmax_only(params):
            # Greedy rows only compare nodes with the target's argmax, read once as host lists; no
            # processor applies: logprobs come from the raw logits.
            processed = ragged.padded(logits) if any(p.logprobs is not None for p in params) else logits
            return verify(drafts, ragged.split(greedy_tokens(logits).tolist())), processed, None
        sampling = SamplingBatch.from_params(params, self.device)
        allowed = None if grammar is None else grammar.allowed[:, : drafts.tokens.shape[1] + 1]
        probs, processed = target_distributions(ragged.padded(logits), sampling, [r.all_token_ids for r in requests],
                                                [r.output_token_ids for r in requests], drafts.tokens, mask, allowed)
        sources = [r.random_source() for r in requests]
        return verify(drafts, probs, [p.greedy for p in params], sources), processed, sampling

    def _commit(self, requests: list[Request], drafts: DraftLayout, ragged: RaggedPass, verdict: Verdict,
                processed: torch.Tensor, sampling: SamplingBatch | None, grammar: GrammarRound | None) -> StepResult:
        """A verdict's bookkeeping: the target cache compacted (a tree's accepted path moves right
        after g) and rolled back to g + the kept nodes, the drafter's hidden state and layer inputs,
        logprobs, the drafter's rollback, the budget and the metrics; then the emitted tokens.
        With a ``grammar``, the drafter and its budget hear of their own nodes only (what it proposed,
        and which of those the kept paths hold); the request's metrics count every verified node, the
        grammar's too."""
        counts, paths, kept = drafts.counts, verdict.paths, verdict.num_accepted
        since = PHASES.mark()
        if drafts.starts:
            moves = []
            for r, start, path in zip(requests, drafts.starts, paths, strict=True):
                keep = [(start + 1 + node, start + 1 + j) for j, node in enumerate(path) if node != j]
                if keep:
                    moves.append((r.slot, [src for src, _ in keep], [dst for _, dst in keep]))
            copy_positions(self.target.pool, moves)  # type: ignore[arg-type]
        for request, n in zip(requests, kept, strict=True):
            # The target cache now holds g and the accepted drafts; the final token stays pending.
            self.target.pool.truncate_to(request.slot, request.num_computed_tokens + 1 + n)  # type: ignore[arg-type]
        PHASES.add("KV truncation", since)
        self.states.keep_verified(requests, ragged, verdict)
        logprobs = logprobs_at_rows([r.params for r in requests], processed, sampling, verdict.kept_rows,
                                    verdict.tokens)
        # A chain "proposes" its length; a tree of depth d, d positions; of which `kept` survive.
        depths = drafts.depths
        judged = counts if depths is None else [max(d[1: 1 + n], default=0) for d, n in zip(depths, counts, strict=True)]
        own_nodes, own_judged, own_kept = counts, judged, kept
        if grammar is not None:
            own_nodes, own_judged, own_kept = grammar.drafter_part(paths, depths)
        outputs: StepResult = []
        for b, request in enumerate(requests):
            request.num_computed_tokens += 1 + kept[b]
            # A drafter's kept nodes are a prefix of its chain (the grammar adds nodes only below them).
            self.drafter.accepted(request, counts[b] if grammar is None else grammar.drafted[b], own_kept[b])
            request.metrics.record_round(judged[b], kept[b], counts[b])
            found = logprobs[b] if logprobs is not None else [None] * len(verdict.tokens[b])
            outputs.extend((request, StepOutput(t, lp)) for t, lp in zip(verdict.tokens[b], found, strict=True))
        self.budget.observe_round(requests, own_nodes, own_judged, own_kept)
        return outputs

    def _clamp(self, request: Request, budget: int) -> int:
        """Never verify past the context (overflow guard) nor more than the request allows (its
        ``max_draft_tokens``, or none with speculation off); a chain never drafts past the tokens the
        request may still emit (a tree's depth is capped by its drafter); a drafter that reads hidden
        states waits for the request's first one."""
        if self.states.waiting(request):
            return 0
        if self.drafter.info.tree:
            return min(budget, request.draft_room)
        return min(budget, request.draft_room, request.tokens_left)
