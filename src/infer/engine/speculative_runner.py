"""Speculative decoding inside continuous batching: draft, verify in one target pass, roll back.

Prefill is the target runner's own; only decode changes. Per round and per request (Leviathan
et al., Algorithm 1): the drafter drafts t_1..t_K with distributions q_i; one batched target pass
over [g, t_1..t_K] gives p_1..p_{K+1} through the same sampling transform; the rejection sampler
keeps a prefix and adds one target token; both caches roll back to what was kept.

With a grammar (``SamplingParams.structured_output``), drafts are checked against the request's
grammar state before verification: a chain is cut at its first forbidden token, a tree loses every
forbidden node and its subtree, so a forbidden token is never verified. Verification then masks the
target's p_i (and renormalises the draft's q_i) to the tokens allowed after each row's path: p and
q are the constrained distributions and rejection sampling stays exact for them.

Grammar drafting (``grammar_drafting``, on by default): the same walk drafts the tokens the grammar
forces (``GrammarMatcher.draft``): where it forces a token, that token is the draft there (a
drafter's other guess is dropped, and its continuation with it), and where the drafter proposed
nothing more, the forced text is drafted on, so a key, its quotes and the brace after a value cost
one target pass. Such a draft is a deterministic proposal, verified as n-gram drafts are (q
one-hot), so it may be rejected (a forced text the grammar lets the target tokenize another way)
and the output is still the target's. With no drafter at all (``NoDrafter``) only the grammar drafts.

A proposal may instead be a tree of guesses (Medusa, ``Proposal.parents``): the pass then feeds
[g, node_1..node_N] with a tree attention mask and depth-based positions, ``verify_tree`` keeps one
root-to-node path, and the K/V of that path, scattered through the tree's rows, are compacted into
consecutive positions before the rollback.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.cache.protocol import CachePoolProtocol, copy_positions
from infer.core.model_runner import RaggedPass
from infer.core.request import Request, StepOutput
from infer.core.timing import device_clock
from infer.engine.continuous_runner import ContinuousRunner, PrefillChunk, Sampled, StepResult
from infer.phases import PHASES
from infer.sampling.grammar import GrammarDraft, unpack_bitmasks
from infer.sampling.sampler import TokenLogprobs, context_presence, gather_logprobs, output_counts
from infer.sampling.transforms import (
    SamplingBatch,
    argmax_only,
    drafts_on_path,
    greedy_tokens,
    probs_from_processed,
    process_logits,
)
from infer.speculative.budget import BudgetController
from infer.speculative.drafter import Drafter, NoDrafter, Proposal
from infer.speculative.rejection import Verdict, verify_drafts, verify_greedy
from infer.speculative.tree import TreeMaskCache, tree_depths, verify_tree, verify_tree_greedy

# Most tokens the grammar drafts for one request in a round beyond its drafter's (each costs a
# verification row, and a forced run is seldom longer: a key with its quotes, an enum value).
GRAMMAR_MAX_DRAFT = 32


@dataclass
class GrammarRound:
    """The grammar's part of one round: the tokens allowed at every verification row [B, R, V], each
    request's draft count before the grammar's walk (what its drafter proposed), and per verified
    node the drafter's node it took the place of (-1: drafted by the grammar alone)."""

    allowed: torch.Tensor
    drafted: list[int]
    origin: list[list[int]]

    def drafter_part(self, paths: list[list[int]], depths: list[list[int]] | None) -> tuple[list[int], list[int], list[int]]:
        """The drafter's own share of the round, for its state and its budget: per request the nodes
        it proposed that were verified, the positions they judged (a chain's length; a tree's
        deepest node: ``depths[b][i]``, node i's depth), and those on the kept ``paths``."""
        nodes, judged, kept = [], [], []
        for b, origin in enumerate(self.origin):
            own = [i for i, o in enumerate(origin) if o >= 0]
            nodes.append(len(own))
            judged.append(len(own) if depths is None else max((depths[b][i + 1] for i in own), default=0))
            kept.append(sum(origin[i] >= 0 for i in paths[b]))
        return nodes, judged, kept


@dataclass
class DraftLayout:
    """A round's drafts as the verifier reads them: request b's ``counts[b]`` nodes (``tokens`` [B, W],
    ``nodes`` the same as host lists) and, unless every request's tree is a chain (node i's parent
    i - 1: ``parents`` None), the trees' ``parents`` [B, W], the cache lengths ``starts`` their
    nodes follow and each pass row's depth (``depths``, set with the pass's tree mask)."""

    tokens: torch.Tensor
    nodes: list[list[int]]
    counts: list[int]
    parents: torch.Tensor | None
    starts: list[int] | None = None
    depths: list[list[int]] | None = None


@dataclass
class RoundTimes:
    """Where the speculative rounds' wall time went, summed since the runner was made or the last
    ``reset_round_times`` (benchmarks read it to compare rounds with Theorem 3.8's cost model)."""

    rounds: int = 0  # speculative rounds, plain fallback rounds included
    drafter_calls: int = 0
    propose_seconds: float = 0.0  # inside the drafter
    verify_rounds: int = 0  # rounds that verified drafts
    verify_seconds: float = 0.0  # target pass, rejection sampling, rollback and bookkeeping of those rounds
    plain_seconds: float = 0.0  # rounds that fell back to a plain decode step (nothing drafted)


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
        self.max_verify = 0 if self._grammar_only else max(budget.max_budget, drafter.info.max_nodes or 0)
        self.grammar_verify = max(self.max_verify, GRAMMAR_MAX_DRAFT if grammar_drafting else 0)
        self.tree_masks = TreeMaskCache()
        self.device = target.pool.device
        # The target's last hidden state per request, for a drafter that reads it (Medusa).
        self._hidden: dict[str, torch.Tensor] | None = {} if drafter.info.uses_hidden_states else None
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
        return self._keep_hidden(self.target.prefill(prefill)) + self.speculative_decode(decode)

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
        if self._hidden is not None:
            self._hidden.pop(request.request_id, None)

    def rollback(self, request: Request, num_computed_tokens: int) -> None:
        # The drafter's state and the kept hidden state may be ahead of the rolled-back target:
        # drop them; a drafter rebuilds a released request's state on its next round, and without a
        # hidden state the request's next round is a plain step that provides one.
        self.target.rollback(request, num_computed_tokens)
        self.drafter.release(request)
        if self._hidden is not None:
            self._hidden.pop(request.request_id, None)

    def free_kv_tokens(self) -> int:
        return min(pool.free_kv_tokens() for pool in self.kv_pools().values())

    def kv_pools(self) -> dict[str, CachePoolProtocol]:
        pools = self.target.kv_pools()
        if self.drafter.kv_pool is not None:
            pools["draft"] = self.drafter.kv_pool
        return pools

    def can_admit(self, request: Request, running: list[Request]) -> bool:
        # Verification writes up to max_verify + 1 positions past the kept length before rollback (a
        # grammar's request up to grammar_verify + 1), so room is kept for that whenever a grammar is
        # among the requests; without a drafter a batch without one is admitted as plain.
        grammar = request.grammar is not None or any(r.grammar is not None for r in running)
        extra = (self.grammar_verify if grammar else self.max_verify) + 1
        if self._grammar_only and not grammar:
            extra = 0
        return self.target.can_admit(request, running, extra) and self.drafter.can_admit(request, running, extra)

    # -- one speculative round -------------------------------------------------------------------
    def speculative_decode(self, requests: list[Request]) -> StepResult:
        if not requests:
            return []
        if self._grammar_only and not (self.grammar_drafting and any(r.grammar is not None for r in requests)):
            return self._keep_hidden(self.target.decode(requests))
        # Drafting and rejection between the passes, threaded as the backend wants (Backend.host_policy).
        with self.target.runner.host_work():
            return self._round(requests)

    def _round(self, requests: list[Request]) -> StepResult:
        """Algorithm 1 for the batch: propose (the drafter within the budgets, then the grammar's
        filter), verify in one target pass and commit; a round with nothing to verify is a plain step."""
        since = PHASES.mark()
        self.round_times.rounds += 1
        budgets = self._budgets(requests)
        self._choose_capture()
        proposal, grammar, drafted = self._propose(requests, budgets) if budgets is not None else (None, None, 0.0)
        PHASES.add("drafting", since)
        if proposal is None or not any(proposal.num_tokens):
            # Nothing worth drafting (or nothing found): a plain decode step, still one target pass.
            if grammar is not None:  # the grammar dropped every draft: the drafter keeps none of them
                for request, count in zip(requests, grammar.drafted, strict=True):
                    if count:
                        self.drafter.accepted(request, count, 0)
            return self._plain(requests)
        result = self.verify(requests, proposal, grammar)
        # The verification round's time from the end of the drafter's call, costed by the rows the pass
        # computed: sum_b (1 + k_b), the pass being ragged (a CUDA graph replay, padded to its bucket,
        # only takes equal runs: the same count).
        elapsed = device_clock(self.device) - drafted
        self.round_times.verify_rounds += 1
        self.round_times.verify_seconds += elapsed
        self.budget.observe_target(self.last_pass_rows, elapsed)
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
        verified (``_check_grammar``), and the device clock when the drafter's call ended. The call is
        timed for the budget: a drafter that runs one step per token reports its clean per-step time
        (None: no clean sample this round); otherwise drafting is one call per round."""
        batch, drafting = len(requests), any(budgets)
        start = device_clock(self.device)
        proposal = self.drafter.propose(requests, budgets, self._hidden_of(requests)) if drafting else None
        drafted = device_clock(self.device)
        if drafting:
            self.round_times.drafter_calls += 1
            self.round_times.propose_seconds += drafted - start
        grammar = None
        if proposal is None and self._forcing(requests):
            proposal = Proposal(torch.zeros(batch, 0, dtype=torch.long, device=self.device), [0] * batch, None)
        if proposal is not None and any(r.grammar is not None for r in requests):
            proposal, grammar = self._check_grammar(requests, proposal)
        if drafting and proposal is not None and any(proposal.num_tokens):  # (the grammar alone makes no call)
            seconds = proposal.step_seconds if self.drafter.info.cost_per_token else drafted - start
            if seconds is not None:
                self.budget.observe_draft_step(batch, seconds)
        return proposal, grammar, drafted

    def _plain(self, requests: list[Request]) -> StepResult:
        """A round without drafts: a plain decode step, timed for the budget's cost fit."""
        start = device_clock(self.device)
        result = self._keep_hidden(self.target.decode(requests))
        elapsed = device_clock(self.device) - start
        self.round_times.plain_seconds += elapsed
        batch = len(requests)
        self.budget.observe_target(batch, elapsed)
        zeros = [0] * batch
        self.budget.observe_round(requests, zeros, zeros, zeros)
        for request in requests:
            request.metrics.record_round(0, 0, 0)
        return result

    def verify(self, requests: list[Request], proposal: Proposal, grammar: GrammarRound | None = None) -> StepResult:
        """One ragged target pass over [g, node_1..node_k] per request (each request's own rows), one
        verdict (``_judge``), one commit (``_commit``), for chains and trees alike."""
        since = PHASES.mark()
        drafts = self._layout(requests, proposal)
        mask = None
        positions = None
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
        verdict, processed, sampling = self._judge(requests, proposal, drafts, mask, ragged, grammar)
        PHASES.add("rejection", since)
        return self._commit(requests, drafts, ragged, verdict, processed, sampling, grammar)

    def _layout(self, requests: list[Request], proposal: Proposal) -> DraftLayout:
        """The proposal in the verifier's flat layout. A round whose trees are all chains (suffix
        decoding's usual draft) is verified as a chain, without the tree's mask, positions and
        compaction: a tree of one child per node is a chain to the tree verifier too, so both accept
        with the same probabilities, and a seeded request's keyed draws give the same tokens."""
        counts = proposal.num_tokens
        width = max(counts, default=0)
        tokens = proposal.tokens[:, :width]
        if proposal.parents is None or _all_chains(proposal):
            return DraftLayout(tokens, tokens.tolist(), counts, None)
        pool = self.target.pool
        return DraftLayout(tokens, tokens.tolist(), counts, proposal.parents[:, :width],
                           [pool.seq_len(r.slot) for r in requests])  # type: ignore[arg-type]

    def _judge(self, requests: list[Request], proposal: Proposal, drafts: DraftLayout, mask: torch.Tensor | None,
               ragged: RaggedPass, grammar: GrammarRound | None) -> tuple[Verdict, torch.Tensor, SamplingBatch | None]:
        """The verdict on every request's drafts, with the processed logits [B, R, V] its logprobs come
        from and the sampling batch (None: a greedy round, which builds no distribution). Greedy,
        seeded (keyed) and sampled rows are kinds of row inside the chain and the tree verifiers; a
        chain keeps its own draws (``verify_drafts``: its accept uniforms, a draft model's q)."""
        logits = ragged.logits  # [N, V]
        assert logits is not None
        counts = drafts.counts
        if argmax_only([r.params for r in requests]):
            # Greedy rows only compare nodes with the target's argmax, read once as host lists: no
            # distributions needed.
            choices = ragged.split(greedy_tokens(logits).tolist())
            if drafts.parents is None:
                verdict = Verdict.of_chain(*verify_greedy(drafts.nodes, counts, choices))
            else:
                verdict = verify_tree_greedy(drafts.nodes, counts, drafts.parents.tolist(), choices)
            # no processor applies: logprobs come from the raw logits
            processed = ragged.padded(logits) if any(r.params.logprobs is not None for r in requests) else logits
            return verdict, processed, None
        sampling = SamplingBatch.from_params([r.params for r in requests], self.device)
        allowed = None if grammar is None else grammar.allowed[:, : drafts.tokens.shape[1] + 1]
        target_probs, processed = self._target_probs(requests, ragged.padded(logits), drafts.tokens, sampling, mask,
                                                     allowed)
        sources = [r.random_source() for r in requests]
        if drafts.parents is not None:
            return verify_tree(drafts.tokens, counts, drafts.parents, target_probs, sampling.greedy, sources,
                               mask), processed, sampling
        draft_probs = None if proposal.probs is None else proposal.probs[:, : drafts.tokens.shape[1]]
        if draft_probs is not None and allowed is not None:
            # A kept draft t_i was drawn from q_i and found allowed: it is distributed as q_i
            # restricted to the allowed tokens, renormalised, and that is the q it is judged by.
            draft_probs = draft_probs * allowed[:, :-1]
            draft_probs = draft_probs / draft_probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
        # Counts and greedy flags go as host lists and the verdict comes back in one read
        # (``to_host``): rejection sampling waits for the device once per round.
        result = verify_drafts(drafts.tokens, counts, target_probs, draft_probs, [r.params.greedy for r in requests],
                               sources)
        return Verdict.of_chain(*result.to_host()), processed, sampling

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
        if self._hidden is not None:  # the row whose logits gave the final token
            self._store_hidden(requests, ragged.rows_at(verdict.last_rows))
        self._observe_kept(requests, ragged, verdict.kept_rows)
        logprobs = self._logprobs(requests, processed, sampling, verdict.kept_rows, verdict.tokens)
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

    # -- shared by chain and tree rounds ---------------------------------------------------------
    def _target_probs(self, requests: list[Request], logits: torch.Tensor, nodes: torch.Tensor,
                      sampling: SamplingBatch, ancestors: torch.Tensor | None = None,
                      allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Target distributions [B, R, V] of the verification rows' ``logits`` [B, R, V] through the
        request's own transform, and the processed logits [B, R, V] they came from (for logprobs).

        Row i's penalty context is the request's tokens plus the drafted tokens on its path:
        t_1..t_i for a chain, the node's ancestors (``ancestors`` [B, R, R]) for a tree.
        ``allowed`` [B, R, V]: the grammar's tokens at each row (None: no grammar).
        """
        batch, rows, vocab = logits.shape
        presence = counts = None
        base = context_presence(sampling, [r.all_token_ids for r in requests], vocab, self.device)
        generated = output_counts(sampling, [r.output_token_ids for r in requests], vocab, self.device)
        if base is not None or generated is not None:
            if ancestors is None:
                path = drafts_on_path(nodes, vocab)  # [B, R, V] drafted tokens before each row
            else:
                on_path = torch.zeros(batch, rows, vocab, device=self.device)
                on_path[:, 1:].scatter_(2, nodes.unsqueeze(2), 1.0)
                path = torch.bmm(ancestors.float(), on_path)
            if base is not None:
                presence = ((path > 0) | base.unsqueeze(1)).flatten(0, 1)
            if generated is not None:
                counts = (path + generated.unsqueeze(1)).flatten(0, 1)
        repeated = sampling.repeat_rows(rows)
        processed = process_logits(logits.flatten(0, 1), repeated, presence,
                                   None if allowed is None else allowed.flatten(0, 1), counts)
        probs = probs_from_processed(processed, repeated)
        return probs.view(batch, rows, vocab), processed.view(batch, rows, vocab)

    @staticmethod
    def _logprobs(requests: list[Request], processed: torch.Tensor, sampling: SamplingBatch | None, rows: list[list[int]],
                  emitted: list[list[int]]) -> list[list[TokenLogprobs | None]] | None:
        """Each emitted token's logprobs from the verification row whose distribution produced it
        (``rows[b][i]`` for ``emitted[b][i]``): the target's processed distribution, as a plain
        step computes it, so logprobs do not depend on speculation."""
        want = [b for b, r in enumerate(requests) if r.params.logprobs is not None]
        if not want:
            return None
        picks = [(b, row, token) for b in want for row, token in zip(rows[b], emitted[b], strict=True)]
        device = processed.device
        index = torch.tensor([b for b, _, _ in picks], device=device)
        chosen = processed[index, torch.tensor([row for _, row, _ in picks], device=device)]
        if sampling is None:
            sampling = SamplingBatch.from_params([r.params for r in requests], device)
        found = iter(gather_logprobs(chosen, sampling.select(index), [t for _, _, t in picks],
                                     [requests[b].params.logprobs for b, _, _ in picks]))
        return [[next(found) for _ in emitted[b]] if b in want else [None] * len(emitted[b])
                for b in range(len(requests))]

    def _check_grammar(self, requests: list[Request], proposal: Proposal) -> tuple[Proposal, GrammarRound]:
        """Drop the drafts a request's grammar forbids (a chain is cut at the first, a tree loses the
        node and its subtree), draft what it forces (with grammar drafting) and find the allowed
        tokens at every verification row."""
        vocab = self.target.runner.vocab_size
        drafted = list(proposal.num_tokens)
        tokens_host = proposal.tokens.tolist()
        parents_host = None if proposal.parents is None else proposal.parents.tolist()
        walks: list[GrammarDraft] = []
        words = (vocab + 31) // 32
        for b, request in enumerate(requests):
            count = drafted[b]
            if request.grammar is None:
                walks.append(GrammarDraft(tokens_host[b][:count], list(range(-1, count - 1)) if parents_host is None
                                          else parents_host[b][:count], list(range(count)), [False] * count,
                                          torch.full((count + 1, words), -1, dtype=torch.int32)))
                continue
            room = depth = None
            if self.grammar_drafting and request.draft_room:
                limit = min(request.draft_room, self.grammar_verify)
                room, depth = max(0, limit - count), min(limit, request.tokens_left)
            parents = None if parents_host is None else parents_host[b][:count]
            walks.append(request.grammar.draft(tokens_host[b][:count], parents, room, depth or 0))
        width = max(len(w.tokens) for w in walks)
        tokens = torch.zeros(len(requests), width, dtype=torch.long)
        parents_out = None if parents_host is None else torch.full((len(requests), width), -1, dtype=torch.long)
        probs = None if proposal.probs is None else proposal.probs.new_zeros(len(requests), width,
                                                                              proposal.probs.shape[-1])
        bitmask = torch.full((len(requests), width + 1, max(words, *(w.masks.shape[1] for w in walks))), -1,
                             dtype=torch.int32)
        for b, walk in enumerate(walks):
            bitmask[b, : len(walk.tokens) + 1, : walk.masks.shape[1]] = walk.masks
            if not walk.tokens:
                continue
            tokens[b, : len(walk.tokens)] = torch.tensor(walk.tokens)
            if parents_out is not None:
                parents_out[b, : len(walk.tokens)] = torch.tensor(walk.parents)
            if probs is not None and proposal.probs is not None:
                # The grammar's choice is a deterministic proposal, a one-hot q, even where the drafter
                # had drawn the same token; a drafter's kept node keeps its own q.
                own = [i for i, forced in enumerate(walk.forced) if not forced]
                if own:
                    probs[b, own] = proposal.probs[b, [walk.origin[i] for i in own]]
                chosen = [i for i, forced in enumerate(walk.forced) if forced]
                probs[b, chosen, [walk.tokens[i] for i in chosen]] = 1.0
        pruned = Proposal(tokens.to(self.device), [len(w.tokens) for w in walks], probs,
                          None if parents_out is None else parents_out.to(self.device), proposal.step_seconds)
        return pruned, GrammarRound(unpack_bitmasks(bitmask, vocab, self.device), drafted, [w.origin for w in walks])

    def _clamp(self, request: Request, budget: int) -> int:
        """Never verify past the context (overflow guard) nor more than the request allows (its
        ``max_draft_tokens``, or none with speculation off); a chain never drafts past the tokens the
        request may still emit (a tree's depth is capped by its drafter); a drafter that reads hidden
        states waits for the request's first one."""
        if self._hidden is not None and request.request_id not in self._hidden:
            return 0
        if self.drafter.info.tree:
            return min(budget, request.draft_room)
        return min(budget, request.draft_room, request.tokens_left)

    # -- hidden states for a drafter that reads them ---------------------------------------------
    def _keep_hidden(self, sampled: Sampled) -> StepResult:
        if sampled.hidden is not None:
            self._store_hidden([request for request, _ in sampled.outputs], sampled.hidden)
        for request, position, states in sampled.states:
            self.drafter.observe_states(request, position, states)
        return sampled.outputs

    def _observe_kept(self, requests: list[Request], ragged: RaggedPass, kept_rows: list[list[int]]) -> None:
        """Hand the drafter the captured layer inputs of the pass rows the target's cache keeps
        (``kept_rows[b]``: g and the accepted drafts of request b, in token order)."""
        if ragged.aux is None:
            return
        for b, request in enumerate(requests):
            index = torch.tensor([ragged.offsets[b] + row for row in kept_rows[b]], device=ragged.aux.device)
            self.drafter.observe_states(request, request.num_computed_tokens, ragged.aux[index])

    def _store_hidden(self, requests: list[Request], hidden: torch.Tensor) -> None:
        """Keep each request's hidden state ``hidden`` [B, H]: the row whose logits produced its newest token."""
        if self._hidden is None:
            return
        for request, row in zip(requests, hidden.detach().clone(), strict=True):  # a copy frees the pass
            self._hidden[request.request_id] = row

    def _hidden_of(self, requests: list[Request]) -> torch.Tensor | None:
        """[B, H] for the drafter; a request without one (its budget is 0) gets a row of zeros."""
        if self._hidden is None:
            return None
        rows = [self._hidden.get(r.request_id) for r in requests]
        known = next(row for row in rows if row is not None)
        return torch.stack([known.new_zeros(known.shape) if row is None else row for row in rows])


def _all_chains(proposal: Proposal) -> bool:
    """Every row's tree is a chain: node i's parent is node i - 1 (the root's child first)."""
    assert proposal.parents is not None
    rows = proposal.parents.tolist()
    return all(all(parent == i - 1 for i, parent in enumerate(rows[b][:count]))
               for b, count in enumerate(proposal.num_tokens))
