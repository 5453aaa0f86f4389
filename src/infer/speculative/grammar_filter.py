"""The grammar's filter between a drafter's proposal and the proposal verified.

With a grammar (``SamplingParams.structured_output``), drafts are checked against the request's
grammar state before verification: a chain is cut at its first forbidden token, a tree loses every
forbidden node and its subtree, so a forbidden token is never verified. Verification then masks the
target's p_i to the tokens allowed after each row's path, and a kept draft's q_i is restricted to
them and renormalised (``restrict_q``): p and q are the constrained distributions and rejection
sampling stays exact for them.

Grammar drafting (``grammar_drafting``, on by default): the same walk drafts the tokens the grammar
forces (``GrammarMatcher.draft``): where it forces a token, that token is the draft there (a
drafter's other guess is dropped, and its continuation with it), and where the drafter proposed
nothing more, the forced text is drafted on, so a key, its quotes and the brace after a value cost
one target pass. Such a draft is a deterministic proposal, verified as n-gram drafts are (q
one-hot), so it may be rejected (a forced text the grammar lets the target tokenize another way)
and the output is still the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infer.core.request import Request
from infer.sampling.grammar import GrammarDraft, unpack_bitmasks
from infer.speculative.drafter import Proposal

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


def restrict_q(probs: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """A kept draft t_i was drawn from q_i and found allowed: it is distributed as q_i restricted to
    the allowed tokens (``allowed`` [B, W, V]), renormalised, and that is the q it is judged by."""
    probs = probs * allowed
    return probs / probs.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)


def filter_proposal(requests: list[Request], proposal: Proposal, vocab: int, device: torch.device,
                    forcing_limit: int | None) -> tuple[Proposal, GrammarRound]:
    """Drop the drafts a request's grammar forbids (a chain is cut at the first, a tree loses the
    node and its subtree), draft what it forces (grammar drafting: ``forcing_limit``, the most nodes
    a request verifies then; None: off) and find the allowed tokens at every verification row."""
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
        if forcing_limit is not None and request.draft_room:
            limit = min(request.draft_room, forcing_limit)
            room, depth = max(0, limit - count), min(limit, request.tokens_left)
        parents = None if parents_host is None else parents_host[b][:count]
        walks.append(request.grammar.draft(tokens_host[b][:count], parents, room, depth or 0))
    width = max(len(w.tokens) for w in walks)
    tokens = torch.zeros(len(requests), width, dtype=torch.long)
    parents_out = None if parents_host is None else torch.full((len(requests), width), -1, dtype=torch.long)
    probs = None if proposal.probs is None else proposal.probs.new_zeros(len(requests), width, proposal.probs.shape[-1])
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
    allowed = unpack_bitmasks(bitmask, vocab, device)
    if probs is not None:
        probs = restrict_q(probs, allowed[:, :width])
    pruned = Proposal(tokens.to(device), [len(w.tokens) for w in walks], probs,
                      None if parents_out is None else parents_out.to(device), proposal.step_seconds)
    return pruned, GrammarRound(allowed, drafted, [w.origin for w in walks])
