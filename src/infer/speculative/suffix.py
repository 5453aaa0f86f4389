"""Suffix decoding (Oliaro et al., 2024): a model-free drafter that learns from every request it has seen.

Every request's prompt and accepted tokens go into a :class:`~infer.speculative.suffix_trie.SuffixStore`
as they arrive, and stay after it finishes (oldest evicted first under a memory bound), so a
request drafts from its own prompt and output *and* from what earlier requests of the same
tenant wrote. Each round, per request: find the longest suffix of its tokens (up to
``max_match``) that occurred before with a continuation, then expand the tree of likeliest
continuations below it, best first by empirical path probability (product of continuation
frequencies), keeping no node below ``min_prob``. The node budget grows with the match length
(``nodes_per_matched_token``, capped by ``tree_size``): a long match is a confident one. No match
means no draft, and the round is a plain decode step.

Guesses are deterministic (one-hot q), so the tree verifier's multi-candidate rejection keeps
sampled output distributed exactly as the target's, and greedy output is token-identical to plain
decoding. Drafts for a request come only from requests with the same ``cache_salt`` (scope
``"salt"``), or only from the request itself (scope ``"request"``).

Budgets: ``budgets[b]`` is the tree's *depth* (a chain's length, as for n-gram lookup, so the
budget controller's fixed and goodput rules apply unchanged: goodput may choose 0, a plain step);
the node count is the drafter's own, at most ``tree_size`` (``info.max_draft_tokens``, the KV room the
runner reserves) and never past the request's context.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch

from infer.core.request import Request
from infer.speculative.drafter import Drafter, DrafterInfo, Proposal
from infer.speculative.suffix_trie import DraftTree, SuffixStore, SuffixTrie

# Whose earlier requests a request may draft from: those with the same cache_salt, or none.
SCOPES = ("salt", "request")
# Match lengths from this on share one class of drafts (``match_classes``): past it acceptance no
# longer grows much with the length.
LONG_MATCH = 8
# Tree levels the tries hold below a max_match-long match. Past them a draft goes on as a chain
# copied from the path's first occurrence (``SuffixTrie.expand``): every appended token costs a trie
# node per level, and a draft that deep has long stopped branching.
BRANCH_DEPTH = 8


class SuffixDrafter(Drafter):
    """Drafts a tree per request from a suffix store shared by the engine's requests (per tenant)."""

    def __init__(self, max_depth: int, tree_size: int = 24, max_match: int = 16, min_prob: float = 0.1,
                 max_tokens: int = 65536, max_requests: int = 1024, scope: str = "salt",
                 nodes_per_matched_token: float = 2.0, device: torch.device | str = "cpu") -> None:
        if scope not in SCOPES:
            raise ValueError(f"suffix scope {scope!r} is invalid: use one of {', '.join(SCOPES)}")
        for name, value in (("max_depth", max_depth), ("tree_size", tree_size), ("max_match", max_match)):
            if value < 1:
                raise ValueError(f"suffix {name}={value} must be >= 1")
        if not 0.0 < min_prob <= 1.0:
            raise ValueError(f"suffix min_prob={min_prob} must be in (0, 1]")
        self.device = torch.device(device)
        self.max_depth = max_depth
        self.tree_size = tree_size
        self.max_match = max_match
        self.min_prob = min_prob
        self.nodes_per_matched_token = nodes_per_matched_token
        self.info = DrafterInfo(max_draft_tokens=tree_size)  # budgets are depths (see the module docstring)
        self.scope = scope
        # A match of max_match tokens leaves BRANCH_DEPTH levels below it (deeper drafts are copied).
        self.store = SuffixStore(max_match + min(max_depth, BRANCH_DEPTH), max_tokens, max_requests)  # scope "salt"
        self._local: dict[str, SuffixTrie] = {}  # each running request's own prompt and output
        # This round's matches per request (match_classes), with the request's length when found.
        self._matched: dict[str, tuple[int, SuffixTrie, int, int]] = {}
        # Drafting statistics over the drafter's life, warm-up requests included (``infer bench``).
        self.drafted_rounds = 0  # request-rounds that got a non-empty tree
        self.drafted_nodes = 0

    def _shared_key(self, request: Request) -> Hashable:
        return ("salt", request.cache_salt)

    @staticmethod
    def _tokens_after(request: Request, seen: int) -> list[int]:
        """The request's tokens (prompt, then accepted output) from position ``seen`` on."""
        prompt_len = len(request.prompt_token_ids)
        return request.prompt_token_ids[seen:] + request.output_token_ids[max(0, seen - prompt_len):]

    def _sync(self, request: Request) -> None:
        """Add the tokens accepted since the last round to the request's own trie and the shared one."""
        rid = request.request_id
        local = self._local.get(rid)
        if local is None:
            local = self._local[rid] = SuffixTrie(self.store.depth)
        local.extend(rid, self._tokens_after(request, local.sequence_length(rid)))
        if self.scope == "salt":
            self._sync_shared(request)

    def _sync_shared(self, request: Request) -> None:
        key = self._shared_key(request)
        shared = self.store.trie(key)
        seen = 0 if shared is None else shared.sequence_length(request.request_id)
        self.store.extend(key, request.request_id, self._tokens_after(request, seen))

    def draft(self, request: Request, max_depth: int, max_nodes: int) -> DraftTree:
        """The request's draft tree under the limits, from whichever of its own trie and the shared
        trie promises more accepted tokens (its tokens must already be in both)."""
        if max_depth <= 0 or max_nodes <= 0:
            return DraftTree()
        best = DraftTree()
        for trie, node, length in self._matches(request):
            if length == 0:
                continue
            budget = min(max_nodes, max(1, math.ceil(self.nodes_per_matched_token * length)))
            tree = trie.expand(node, budget, min(max_depth, self.max_depth), self.min_prob, node_depth=length)
            if sum(tree.scores) > sum(best.scores):
                best = tree
        if best.tokens:
            self.drafted_rounds += 1
            self.drafted_nodes += len(best)
        return best

    def _tail(self, request: Request) -> list[int]:
        """The request's last ``max_match`` tokens (the context a draft continues)."""
        tail = request.output_token_ids[-self.max_match:]
        if len(tail) < self.max_match:
            tail = request.prompt_token_ids[len(tail) - self.max_match:] + tail
        return tail

    def _tries(self, request: Request) -> list[SuffixTrie]:
        """The tries the request drafts from: its own, and its tenant's where the scope shares."""
        tries = [self._local[request.request_id]]
        shared = self.store.trie(self._shared_key(request)) if self.scope == "salt" else None
        if shared is not None:
            tries.append(shared)
        return tries

    def _matches(self, request: Request) -> list[tuple[SuffixTrie, int, int]]:
        """``(trie, node, length)``: the longest match of the request's context in each of its tries
        (the one ``match_classes`` found at the request's current length is kept: the tries only
        grow in between, so the node found then is still the match)."""
        known = self._matched.get(request.request_id)
        tail = self._tail(request)
        return [known[1:] if known is not None and known[0] == request.num_tokens and known[1] is trie
                else (trie, *trie.match(tail, self.max_match)) for trie in self._tries(request)]

    def match_classes(self, requests: list[Request]) -> list[int]:
        """Per request, the longest context matched (0: none, no draft), at most ``LONG_MATCH``, kept
        for this round's ``propose``. With the tenant's trie (scope "salt") only that one is brought
        up to date and matched: it holds the request's own tokens too, so no match in the request's
        own trie is longer, and that trie is extended only when the request drafts."""
        tries = []
        for request in requests:  # every request's tokens first: later matches see them
            if self.scope == "salt":
                self._sync_shared(request)
                tries.append(self.store.trie(self._shared_key(request)))
            else:
                self._sync(request)
                tries.append(self._local[request.request_id])
        self._matched = {}
        classes = []
        for request, trie in zip(requests, tries, strict=True):
            assert trie is not None  # (just extended)
            node, length = trie.match(self._tail(request), self.max_match)
            self._matched[request.request_id] = (request.num_tokens, trie, node, length)
            classes.append(min(length, LONG_MATCH))
        return classes

    def propose(self, requests: list[Request], budgets: list[int], hidden_states: torch.Tensor | None) -> Proposal:
        trees = []
        for request, depth in zip(requests, budgets, strict=True):
            self._sync(request)
            # Verification writes every node: at most tree_size, never past the context nor past the
            # request's own max_draft_tokens.
            trees.append(self.draft(request, depth, min(self.tree_size, request.draft_room)))
        width = max((len(t) for t in trees), default=0)
        tokens = torch.zeros(len(requests), width, dtype=torch.long)
        parents = torch.full((len(requests), width), -1, dtype=torch.long)
        for b, tree in enumerate(trees):
            if tree.tokens:
                tokens[b, : len(tree)] = torch.tensor(tree.tokens, dtype=torch.long)
                parents[b, : len(tree)] = torch.tensor(tree.parents, dtype=torch.long)
        return Proposal(tokens.to(self.device), [len(t) for t in trees], None, parents.to(self.device))

    def release(self, request: Request) -> None:
        self._local.pop(request.request_id, None)
        self._matched.pop(request.request_id, None)
        if self.scope != "salt":
            return
        key = self._shared_key(request)
        if not request.is_finished:
            # Rolled back after a failed step: it runs on and is stored again from its next round.
            self.store.remove(key, request.request_id)
        elif request.output_token_ids:  # it ran (a request aborted while waiting stores nothing)
            self._sync_shared(request)  # the tokens accepted in its last round
            self.store.finish(key, request.request_id)

    @property
    def mean_tree_size(self) -> float | None:
        """Nodes per drafted tree (rounds without a match excluded)."""
        return self.drafted_nodes / self.drafted_rounds if self.drafted_rounds else None
