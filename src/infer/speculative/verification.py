"""Lossless verification of a round's drafts: one entry point, ``verify``, over one flat layout.

A round's drafts are a tree per request (``DraftLayout``): node i has parent ``parents[b, i]``
(-1: the root, the last accepted token g that the pass feeds first), so node i is pass row i + 1;
a chain of K drafts is the tree whose node i has parent i - 1 (``parents`` None). ``verify``
returns one ``Verdict`` for every shape and kind of row:

* **greedy** rows accept while a node equals the target's argmax at its parent's row and emit the
  argmax where they stop. A batch of greedy rows without processors is judged from the argmax
  tokens alone, read once as host lists (``greedy_verdict``): no distribution is formed.
* **seeded** rows (a ``KeyedDraw``) are walked like greedy rows, with the target's keyed sample at
  each position (the inverse CDF of p at a uniform keyed by seed and position) in place of its
  argmax: a node is taken iff its token is that sample, which happens with probability p(token),
  and the emitted tokens are plain decoding's, with and without speculation.
* **sampled** rows: a chain (Leviathan et al. 2023, Algorithm 1) accepts drafted token ``t_i``
  (proposed from ``q_i``) with probability ``min(1, p_i(t_i) / q_i(t_i))``; at the first rejection,
  position ``n``, the correction token is drawn from ``norm(max(0, p_n - q_n))``; if every draft is
  accepted a bonus token is drawn from ``p_{K+1}`` (``verify_drafts``, batched tensor operations).
  A tree's children are deterministic guesses (one-hot q) tried in turn by multi-candidate
  recursive rejection (SpecInfer, Miao et al. 2024): child c is accepted with probability
  ``p_res(c)``, p at the node with the rejected siblings removed and renormalised; when every child
  is rejected the final token is drawn from ``p_res`` (``verify_tree``). A chain keeps its own
  sampler because a draft model's q is not one-hot and its draws stay batched on the device.

Every emitted token is distributed exactly as if sampled from the target directly, which is what
makes speculative decoding lossless. A request's random draws come from its own source (so they do
not depend on what it is batched with). A chain's verification reads nothing back from the device
until its result's ``to_host``, the round's one host sync: the final token is drawn as plain
sampling draws it (``sampler.inverse_cdf``: one uniform from the row's source, the same draw
``sample_from_probs`` makes) and whether its distribution was drawable is checked on the device.
On the CPU a keyed row draws its samples up to its first mismatch (reading its drafts); elsewhere
it draws every position it may reach at once, reading nothing (``host_reads_are_free``): the same
tokens either way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from infer.sampling.sampler import (
    KeyedDraw,
    RandomSource,
    context_presence,
    invalid_rows,
    inverse_cdf,
    keyed_sample,
    on_device,
    output_counts,
    row_uniforms,
    sample_rows,
)
from infer.sampling.transforms import SamplingBatch, drafts_on_path, probs_from_processed, process_logits


@dataclass
class Verdict:
    """What verification kept of one round's drafts, per request, whatever their shape (a chain is
    the tree whose node i has parent i - 1): ``paths[b]`` the accepted nodes, root to leaf;
    ``tokens[b]`` their tokens followed by the final (correction or bonus) token; ``last_rows[b]``
    the pass row whose distribution produced the final token (0 = g, i + 1 = node i)."""

    paths: list[list[int]]
    tokens: list[list[int]]
    last_rows: list[int]

    @classmethod
    def of_chain(cls, accepted: Sequence[int], emitted: list[list[int]]) -> Verdict:
        """A chain's verdict from its accepted counts and emitted tokens (``VerificationResult.to_host``)."""
        return cls([list(range(n)) for n in accepted], emitted, list(accepted))

    @property
    def num_accepted(self) -> list[int]:
        return [len(p) for p in self.paths]

    @property
    def kept_rows(self) -> list[list[int]]:
        """Per request the pass rows the cache keeps (g's and its accepted nodes'), in token order: row
        j produced emitted token j (an accepted node was judged by its parent's row, the final token
        by the last row)."""
        return [[0] + [node + 1 for node in path] for path in self.paths]


@dataclass
class DraftLayout:
    """A round's drafts as the verifier reads them: request b's ``counts[b]`` nodes (``tokens`` [B, W],
    ``nodes`` the same as host lists), the draft distributions of a chain's nodes (``probs`` [B, W, V];
    None: deterministic proposals, one-hot q) and, unless every request's tree is a chain (node i's
    parent i - 1: ``parents`` None), the trees' ``parents`` [B, W], the cache lengths ``starts`` their
    nodes follow and each pass row's depth (``depths``, set with the pass's tree mask)."""

    tokens: torch.Tensor
    nodes: list[list[int]]
    counts: list[int]
    parents: torch.Tensor | None = None
    probs: torch.Tensor | None = None
    starts: list[int] | None = None
    depths: list[list[int]] | None = None

    @classmethod
    def of(cls, tokens: torch.Tensor, counts: list[int], parents: torch.Tensor | None, probs: torch.Tensor | None,
           starts: Callable[[], list[int]]) -> DraftLayout:
        """A proposal in the flat layout. A round whose trees are all chains (suffix decoding's usual
        draft) is laid out as a chain, without the tree's mask, positions and compaction: a tree of one
        child per node is a chain to the tree verifier too, so both accept with the same probabilities,
        and a seeded request's keyed draws give the same tokens."""
        width = max(counts, default=0)
        tokens = tokens[:, :width]
        if parents is not None:
            rows = parents.tolist()
            if all(all(parent == i - 1 for i, parent in enumerate(rows[b][:count])) for b, count in enumerate(counts)):
                parents = None
        if parents is None:
            return cls(tokens, tokens.tolist(), counts, probs=None if probs is None else probs[:, :width])
        return cls(tokens, tokens.tolist(), counts, parents[:, :width], starts=starts())


def verify(drafts: DraftLayout, target: torch.Tensor | Sequence[Sequence[int]], greedy: Sequence[bool] = (),
           sources: Sequence[RandomSource] = ()) -> Verdict:
    """The verdict on a round's drafts. ``target``: the target's distributions at the pass rows
    (``target_distributions``: [B, W + 1, V]), with each row's ``greedy`` flag and random source; or,
    for a batch of greedy rows without processors, the argmax token of every pass row per request
    (host lists, ``choices[b][r]``: row 0 is g, row i + 1 node i)."""
    parents = None if drafts.parents is None else drafts.parents.tolist()
    if not isinstance(target, torch.Tensor):
        return greedy_verdict(drafts.nodes, drafts.counts, parents, target)
    if drafts.parents is not None:
        return verify_tree(drafts.tokens, drafts.counts, drafts.parents, target, greedy, sources)
    return Verdict.of_chain(*verify_drafts(drafts.tokens, drafts.counts, target, drafts.probs, greedy,
                                           sources).to_host())


def greedy_verdict(nodes: Sequence[Sequence[int]], counts: Sequence[int], parents: Sequence[Sequence[int]] | None,
                   choices: Sequence[Sequence[int]]) -> Verdict:
    """The verdict on greedy rows from the target's argmax alone: ``choices[b][r]`` is the argmax of
    pass row ``r`` (0: the root, node i: row i + 1); ``parents`` None: every row a chain. The kept
    path ends at the deepest node whose every node matches its parent row's argmax (the first such
    node on a tie, as ``verify_tree``), and the final token is its row's argmax: what the sampled
    verifiers give greedy rows, without forming a [B, W + 1, V] distribution or consuming randomness.

    Host lists, not tensors: the caller reads the argmax tokens once (the round's one wait for the
    device) and the comparison is a few steps per node, where the same on tensors took a dozen small
    operators, each costing more than the whole comparison."""
    if not (len(nodes) == len(counts) == len(choices)) or (parents is not None and len(parents) != len(nodes)):
        raise ValueError(f"nodes, counts, parents and choices must have one row per request, got {len(nodes)}, "
                         f"{len(counts)}, {'-' if parents is None else len(parents)} and {len(choices)}")
    paths, last_rows, out_tokens = [], [], []
    for b, (tokens, count, choice) in enumerate(zip(nodes, counts, choices, strict=True)):
        if len(choice) < count + 1 or len(tokens) < count:
            raise ValueError(f"a row with {count} drafts needs {count} draft tokens and {count + 1} target tokens, "
                             f"got {len(tokens)} and {len(choice)}")
        parent = list(range(-1, count - 1)) if parents is None else parents[b]
        depth = [0] * count  # a matching node's depth; 0: it or an ancestor does not match
        best = -1
        for i in range(count):
            up = parent[i]
            if tokens[i] == choice[up + 1] and (up < 0 or depth[up]):
                depth[i] = 1 + (depth[up] if up >= 0 else 0)
                if best < 0 or depth[i] > depth[best]:
                    best = i
        path = []
        node = best
        while node >= 0:
            path.append(node)
            node = parent[node]
        path.reverse()
        paths.append(path)
        last_rows.append(best + 1)
        out_tokens.append([tokens[i] for i in path] + [choice[best + 1]])
    return Verdict(paths=paths, tokens=out_tokens, last_rows=last_rows)


def target_distributions(logits: torch.Tensor, sampling: SamplingBatch, contexts: Sequence[Sequence[int]],
                         outputs: Sequence[Sequence[int]], nodes: torch.Tensor, ancestors: torch.Tensor | None = None,
                         allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Target distributions [B, R, V] of the verification rows' ``logits`` [B, R, V] through each
    request's own transform, and the processed logits [B, R, V] they came from (for logprobs).

    Row i's penalty context is the request's tokens (``contexts``, of which ``outputs`` generated)
    plus the drafted tokens on its path: t_1..t_i for a chain, the node's ancestors (``ancestors``
    [B, R, R]) for a tree. ``allowed`` [B, R, V]: the grammar's tokens at each row (None: no grammar).
    """
    batch, rows, vocab = logits.shape
    device = logits.device
    presence = counts = None
    base = context_presence(sampling, contexts, vocab, device)
    generated = output_counts(sampling, outputs, vocab, device)
    if base is not None or generated is not None:
        if ancestors is None:
            path = drafts_on_path(nodes, vocab)  # [B, R, V] drafted tokens before each row
        else:
            on_path = torch.zeros(batch, rows, vocab, device=device)
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


# ------------------------------------------------------------------------------------- chains


@dataclass
class VerificationResult:
    """Outcome of verifying one round of drafts for a batch.

    ``num_accepted[b]`` drafts were accepted in row ``b``; ``output_tokens[b]`` holds those drafts
    followed by the correction (or bonus) token, then ``-1`` padding. ``invalid[b]`` marks a row
    whose sampled distribution held inf, nan or a negative value, or summed to 0 (found on the device;
    ``to_host`` raises for it, as ``torch.multinomial`` would have).
    """

    num_accepted: torch.Tensor  # [B] long, 0..num_draft[b]
    output_tokens: torch.Tensor  # [B, K+1] long, -1 past position num_accepted[b]
    invalid: torch.Tensor | None = None  # [B] bool, None: nothing sampled

    def tokens_for(self, b: int) -> list[int]:
        """Host list of the ``num_accepted[b] + 1`` tokens emitted by row ``b``."""
        n = int(self.num_accepted[b])
        return [int(t) for t in self.output_tokens[b, : n + 1].tolist()]

    def to_host(self) -> tuple[list[int], list[list[int]]]:
        """Each row's accepted count and its emitted tokens (the accepted drafts and the final token),
        read in one transfer: the round's one host sync."""
        parts = [self.num_accepted[:, None], self.output_tokens]
        if self.invalid is not None:
            parts.append(self.invalid[:, None].long())
        rows = torch.cat(parts, dim=1).tolist()
        if self.invalid is not None and any(row[-1] for row in rows):
            raise RuntimeError("rejection sampling: a probability distribution contains inf, nan or a negative "
                               "value, or sums to 0")
        return [row[0] for row in rows], [row[1: row[0] + 2] for row in rows]


def host_reads_are_free(device: torch.device) -> bool:
    """Whether reading a tensor on ``device`` from the host costs no wait (the CPU): there a keyed
    row stops drawing at its first mismatch, which needs its drafts on the host."""
    return device.type == "cpu"


def _draw_uniforms(
    num_draft_host: list[int],
    sampled: list[int],
    generators: Sequence[RandomSource],
    k: int,
    device: torch.device,
) -> torch.Tensor:
    """Uniforms [B, K] for the accept test; rows not in ``sampled`` stay 0 and draw nothing."""
    batch = len(num_draft_host)
    if k == 0 or not sampled:
        return torch.zeros(batch, k, device=device)
    shared = [b for b in sampled if generators[b] is None]
    # The global RNG has no per-request reproducibility anyway, so one batched draw is fine.
    shared_draw = torch.rand(len(shared), k, device=device) if shared else None
    zeros = torch.zeros(k, device=device)
    rows = []
    shared_at = {b: i for i, b in enumerate(shared)}
    sampled_set = set(sampled)
    for b in range(batch):
        if b in shared_at:
            assert shared_draw is not None
            rows.append(shared_draw[shared_at[b]])
        elif b in sampled_set:
            # Draw exactly num_draft[b] uniforms so a request's random stream depends only on its own
            # draft count, not on the batch-wide padding K.
            own = torch.rand(num_draft_host[b], generator=generators[b], device=device)  # type: ignore[arg-type]
            rows.append(torch.nn.functional.pad(own, (0, k - num_draft_host[b])))
        else:
            rows.append(zeros)
    return torch.stack(rows)


def keyed_walk(probs: torch.Tensor, draw: KeyedDraw, children: Sequence[Sequence[int]],
               tokens: Sequence[int]) -> tuple[list[int], int, int]:
    """A seeded row's verdict, for a chain or a tree: from the root row down, the target's keyed
    sample at each row's position (``probs`` [R, V], the row's pass rows; ``children[r]`` the nodes
    below pass row r, node i being row i + 1 with token ``tokens[i]``), descending into the child
    that holds it. Returns the accepted path, the last row and its sample (the final token); only
    the rows visited draw noise."""
    path: list[int] = []
    row = 0
    while True:
        token = int(keyed_sample(probs[row: row + 1].float(), [draw.at(len(path))])[0])
        child = next((c for c in children[row] if tokens[c] == token), -1)
        if child < 0:
            return path, row, token
        path.append(child)
        row = child + 1


def _draw_final(dist: torch.Tensor, sampled: list[int],
                generators: Sequence[RandomSource]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """One token per row in ``sampled`` from ``dist`` [B, V] float32, drawn as ``sample_from_probs``
    draws it (the same uniform from the same source, so the same token), each with whether its
    distribution was drawable (``invalid_rows``), both on the device: nothing is read back."""
    if not sampled:
        return {}
    rows = dist[on_device(sampled, torch.long, dist.device)] if len(sampled) < dist.shape[0] else dist
    drawn = inverse_cdf(rows, row_uniforms([generators[b] for b in sampled], dist.device))
    bad = invalid_rows(rows)
    return {b: (drawn[i], bad[i]) for i, b in enumerate(sampled)}


def _check_inputs(draft_tokens: torch.Tensor, num_draft: list[int], target_probs: torch.Tensor,
                  draft_probs: torch.Tensor | None, greedy: list[bool],
                  generators: Sequence[RandomSource]) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [B, K], got shape {tuple(draft_tokens.shape)}")
    batch, k = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, k + 1):
        raise ValueError(
            f"target_probs must be [B, K+1, V] = [{batch}, {k + 1}, V], got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[2]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, k, vocab):
        raise ValueError(
            f"draft_probs must be [B, K, V] = [{batch}, {k}, {vocab}], got {tuple(draft_probs.shape)}"
        )
    if len(num_draft) != batch:
        raise ValueError(f"num_draft must be [B] = [{batch}], got {len(num_draft)} entries")
    if any(n < 0 or n > k for n in num_draft):
        raise ValueError(f"num_draft entries must lie in [0, {k}], got {num_draft}")
    if len(greedy) != batch:
        raise ValueError(f"greedy must be [B] = [{batch}], got {len(greedy)} entries")
    if len(generators) != batch:
        raise ValueError(f"generators has {len(generators)} entries for a batch of {batch}")


def _host_list(values: torch.Tensor | Sequence[int] | Sequence[bool], kind: type) -> list:
    if isinstance(values, torch.Tensor):
        if values.dim() != 1:
            raise ValueError(f"expected a [B] tensor, got shape {tuple(values.shape)}")
        return [kind(v) for v in values.tolist()]
    return [kind(v) for v in values]


def verify_drafts(
    draft_tokens: torch.Tensor,
    num_draft: torch.Tensor | Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    greedy: torch.Tensor | Sequence[bool],
    generators: Sequence[RandomSource],
) -> VerificationResult:
    """Verify a batch of drafts against the target model's distributions.

    Args:
        draft_tokens: [B, K] drafted ids; entries past ``num_draft[b]`` are ignored.
        num_draft: [B] number of real drafts per row (0 makes the row a plain decode step).
        target_probs: [B, K+1, V] target distributions p_1..p_{K+1}, after the sampling transform.
        draft_probs: [B, K, V] draft distributions q_i after the same transform, or ``None`` when
            each draft is a deterministic (one-hot) proposal, e.g. from n-gram lookup.
        greedy: [B] rows decoded greedily; they accept while ``argmax p_i == t_i``, emit
            ``argmax p`` at the stop position and consume no randomness.
        generators: per-row generator for the accept uniforms and the final token draw; ``None``
            uses the global RNG of the tensors' device; a ``KeyedDraw`` (at the position of p_1's
            token) verifies the row by its keyed samples (see the module docstring).

    Given ``num_draft`` and ``greedy`` as host sequences (the runner knows both), the verification
    is tensor operations on the device that never wait for it: nothing is read back until the
    result's ``to_host``, the round's one host sync. (Each given as a tensor costs one read.)
    """
    num_draft_host = _host_list(num_draft, int)
    greedy_host = _host_list(greedy, bool)
    _check_inputs(draft_tokens, num_draft_host, target_probs, draft_probs, greedy_host, generators)
    device = target_probs.device
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[2]
    drafts = draft_tokens.to(device=device, dtype=torch.long)
    keyed = [b for b in range(batch) if not greedy_host[b] and isinstance(generators[b], KeyedDraw)]
    sampled = [b for b in range(batch) if not greedy_host[b] and b not in keyed]
    exact_host = [greedy_host[b] or b in keyed for b in range(batch)]
    num_draft_t = on_device(num_draft_host, torch.long, device)
    exact = on_device(exact_host, torch.bool, device)

    # Padding past num_draft may be any id; clamp so the gathers below stay in range.
    safe_drafts = drafts.clamp(0, vocab - 1)
    rows = torch.arange(batch, device=device)
    in_range = torch.arange(k, device=device)[None, :] < num_draft_t[:, None]  # [B, K]

    # Probabilities of each draft under p and q; only these gathers are upcast, never [B, K, V].
    target_draft = target_probs[:, :k]
    p_tok = target_draft.gather(2, safe_drafts.unsqueeze(2)).squeeze(2).float()
    if draft_probs is None:
        q_tok = torch.ones_like(p_tok)
    else:
        q_tok = draft_probs.to(device).gather(2, safe_drafts.unsqueeze(2)).squeeze(2).float()

    u = _draw_uniforms(num_draft_host, sampled, generators, k, device)
    # u < p/q written multiplicatively so q == 0 cannot divide by zero.
    stochastic_ok = u * q_tok < p_tok
    # Greedy and keyed rows know the target's token at every position: its argmax, its keyed sample.
    chosen, keyed_invalid = _keyed_targets(target_probs.argmax(dim=2), target_probs, safe_drafts, keyed,
                                           num_draft_host, generators)
    ok = torch.where(exact[:, None], chosen[:, :k] == safe_drafts, stochastic_ok) & in_range
    # Accepted prefix length = number of leading ones.
    num_accepted = ok.long().cumprod(dim=1).sum(dim=1)

    stop_p = target_probs[rows, num_accepted].float()  # [B, V], p at the stop position
    final_dist = stop_p
    if k > 0:
        stop = num_accepted.clamp(max=k - 1)  # only meaningful where the row rejected
        if draft_probs is None:
            # One-hot q: max(0, p - q) is p with the rejected token removed.
            residual = stop_p.scatter(1, safe_drafts[rows, stop].unsqueeze(1), 0.0)
        else:
            residual = (stop_p - draft_probs.to(device)[rows, stop].float()).clamp_min(0.0)
        mass = residual.sum(dim=1, keepdim=True)
        # Zero residual mass means p == q where rejection has probability 0; fall back to p.
        residual = torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), stop_p)
        # Greedy and keyed rows keep p: their answer is the target's token there, whatever was rejected.
        resample = (num_accepted < num_draft_t) & ~exact
        final_dist = torch.where(resample[:, None], residual, stop_p)

    final = chosen.gather(1, num_accepted[:, None]).squeeze(1)
    invalid = None
    if sampled or keyed:
        drawn = _draw_final(final_dist, sampled, generators)
        final = torch.stack([drawn[b][0] if b in drawn else final[b] for b in range(batch)])
        no = torch.zeros((), dtype=torch.bool, device=device)
        invalid = torch.stack([drawn[b][1] if b in drawn else keyed_invalid.get(b, no) for b in range(batch)])
    result = _result(drafts, num_accepted, final)
    result.invalid = invalid
    return result


def _keyed_targets(chosen: torch.Tensor, target_probs: torch.Tensor, drafts: torch.Tensor, keyed: list[int],
                   num_draft: list[int], generators: Sequence[RandomSource]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The target's token at every position [B, K+1] of a chain round: ``chosen`` (the argmax) with
    each keyed row's keyed samples in place, and per keyed row drawn on the device whether its
    distributions were drawable (checked with the verdict)."""
    device = target_probs.device
    keyed_invalid: dict[int, torch.Tensor] = {}
    if keyed and host_reads_are_free(device):
        # On the CPU a keyed row's samples are drawn only up to its first mismatch (each costs a V-wide
        # noise draw); the positions after it cannot be accepted whatever ``chosen`` holds there.
        drafts_host = drafts.tolist()
        for b in keyed:
            draw = generators[b]
            assert isinstance(draw, KeyedDraw)
            count = num_draft[b]
            path, _, token = keyed_walk(target_probs[b], draw, [[j] for j in range(count)] + [[]], drafts_host[b])
            chosen[b, : len(path) + 1] = torch.tensor([*drafts_host[b][: len(path)], token], device=device)
    elif keyed:
        # Elsewhere every position a keyed row may reach is drawn at once (the positions past its first
        # mismatch are never read): more work, no host read.
        picked = []
        for b in range(chosen.shape[0]):
            draw = generators[b]
            if b not in keyed:
                picked.append(chosen[b])
                continue
            assert isinstance(draw, KeyedDraw)
            reach = num_draft[b] + 1
            probs = target_probs[b, :reach].float()
            keyed_invalid[b] = invalid_rows(probs).any()
            picked.append(torch.cat([inverse_cdf(probs, row_uniforms([draw.at(j) for j in range(reach)], device)),
                                     chosen[b, reach:]]))
        chosen = torch.stack(picked)
    return chosen, keyed_invalid


def _result(drafts: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> VerificationResult:
    """Each row's accepted drafts, then ``final`` at its stop position, -1 after: [B, K+1]."""
    batch, k = drafts.shape
    positions = torch.arange(k + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, drafts.new_full((batch, 1), -1)], dim=1)
    output = torch.where(positions < num_accepted[:, None], padded, torch.full_like(padded, -1))
    output.scatter_(1, num_accepted[:, None], final[:, None])
    return VerificationResult(num_accepted=num_accepted, output_tokens=output)



# -------------------------------------------------------------------------------------- trees


def _children(parents: list[int], count: int) -> list[list[int]]:
    """Children per pass row (index 0 = root), in node order."""
    kids: list[list[int]] = [[] for _ in range(count + 1)]
    for i in range(count):
        kids[parents[i] + 1].append(i)
    return kids


def residual_after_rejections(probs: torch.Tensor, rejected: Sequence[Sequence[int]]) -> torch.Tensor:
    """Target distributions [B, V] with each row's rejected candidate tokens removed (unnormalised).

    One-hot proposals make ``max(0, p - q)`` exactly "p without the rejected token", and rejections
    compose. A row whose whole mass was rejected (probability zero, up to rounding) falls back to p.
    """
    rows = [b for b, removed in enumerate(rejected) for _ in removed]
    if not rows:
        return probs
    cols = [t for removed in rejected for t in removed]
    residual = probs.clone()
    residual[torch.tensor(rows, device=probs.device), torch.tensor(cols, device=probs.device)] = 0.0
    mass = residual.sum(dim=1, keepdim=True)
    return torch.where(mass > 0, residual, probs)


def verify_tree(
    node_tokens: torch.Tensor,
    num_nodes: Sequence[int],
    parents: torch.Tensor,
    target_probs: torch.Tensor,
    greedy: torch.Tensor | Sequence[bool],
    generators: Sequence[RandomSource],
) -> Verdict:
    """Accept a path of each row's tree and draw the final token, losslessly.

    Args:
        node_tokens: [B, N] candidate token per node (padding past ``num_nodes[b]`` ignored).
        num_nodes: real nodes per row; 0 makes the row a plain decode step.
        parents: [B, N] parent node index, -1 for children of the root; parents come first.
        target_probs: [B, N+1, V] target distributions of the pass rows after the sampling transform.
        greedy: [B] rows decoded greedily (no randomness consumed).
        generators: per-row generators for sampled rows (None: the global RNG; a ``KeyedDraw`` at
            the position of the root row's token: the row is walked by its keyed samples).
    """
    batch, n = node_tokens.shape
    if tuple(target_probs.shape[:2]) != (batch, n + 1):
        raise ValueError(f"target_probs must be [B, N+1, V] = [{batch}, {n + 1}, V], got {tuple(target_probs.shape)}")
    if tuple(parents.shape) != (batch, n) or len(num_nodes) != batch or len(generators) != batch:
        raise ValueError("node_tokens, parents, num_nodes and generators must describe the same batch")
    device = target_probs.device
    vocab = target_probs.shape[2]
    tokens = node_tokens.to(device=device, dtype=torch.long).clamp(0, vocab - 1)
    parents = parents.to(device=device, dtype=torch.long)
    counts = list(num_nodes)
    valid = torch.arange(n, device=device).unsqueeze(0) < torch.tensor(counts, device=device).unsqueeze(1)
    parent_row = torch.where(valid, parents + 1, torch.zeros_like(parents))
    rows = torch.arange(batch, device=device).unsqueeze(1)
    # p_parent(token) for every node: the only per-node numbers the sampled walk needs.
    p_node = target_probs[rows, parent_row, tokens].double()  # [B, N]
    greedy_host = _host_list(greedy, bool)
    keyed = {b for b in range(batch) if not greedy_host[b] and isinstance(generators[b], KeyedDraw)}
    # Greedy and keyed rows know the target's token at every pass row: its argmax, its keyed sample.
    exact_host = [bool(g) or b in keyed for b, g in enumerate(greedy_host)]
    host_tokens, host_parents, host_p = tokens.tolist(), parents.tolist(), p_node.tolist()

    sampled = [b for b in range(batch) if not exact_host[b]]
    uniforms = _tree_uniforms(sampled, counts, generators, n)
    greedy_paths: dict[int, list[int]] = {}
    if len(sampled) + len(keyed) < batch:
        # Greedy rows: the deepest path whose every node is the argmax at its parent (greedy_verdict).
        rows_greedy = [b for b in range(batch) if exact_host[b] and b not in keyed]
        argmax = target_probs.argmax(dim=2).tolist()  # [B, N+1]
        found = greedy_verdict([host_tokens[b] for b in rows_greedy], [counts[b] for b in rows_greedy],
                               [host_parents[b] for b in rows_greedy], [argmax[b] for b in rows_greedy])
        greedy_paths = dict(zip(rows_greedy, found.paths, strict=True))
    paths: list[list[int]] = []
    last_rows: list[int] = []
    rejected_at_last: list[list[int]] = []
    keyed_final: dict[int, int] = {}
    for b in range(batch):
        kids = _children(host_parents[b], counts[b])
        draw = generators[b]
        removed: list[int] = []
        if b in keyed and isinstance(draw, KeyedDraw):
            # Walk down while a child is the target's keyed sample at its position; the sample
            # where none is becomes the final token.
            path, row, keyed_final[b] = keyed_walk(target_probs[b], draw, kids, host_tokens[b])
        elif exact_host[b]:
            path = greedy_paths[b]
            row = path[-1] + 1 if path else 0
        else:
            path, row, removed = _sampled_walk(kids, host_tokens[b], host_p[b], uniforms.get(b, []))
        paths.append(path)
        last_rows.append(row)
        rejected_at_last.append(removed)

    final_rows = torch.tensor(last_rows, device=device)
    final_p = target_probs[torch.arange(batch, device=device), final_rows].float()  # [B, V]
    # Greedy and keyed rows rejected nothing at their last row: they take the target's token there.
    final = sample_rows(residual_after_rejections(final_p, rejected_at_last), exact_host, generators)
    final_host = final.tolist()
    for b, token in keyed_final.items():
        final_host[b] = token
    out_tokens = [[host_tokens[b][i] for i in paths[b]] + [final_host[b]] for b in range(batch)]
    return Verdict(paths=paths, tokens=out_tokens, last_rows=last_rows)


def _tree_uniforms(sampled: list[int], counts: list[int], generators: Sequence[RandomSource],
                   n: int) -> dict[int, list[float]]:
    """The accept uniforms of the sampled rows of a tree round: exactly ``counts[b]`` from a row's own
    generator (its stream depends on this request alone), ``n`` from the global RNG for the rest."""
    uniforms: dict[int, list[float]] = {}
    shared = [b for b in sampled if generators[b] is None and counts[b] > 0]
    if shared:
        draws = torch.rand(len(shared), n, dtype=torch.float64).tolist()
        uniforms.update(zip(shared, draws, strict=True))
    for b in sampled:
        gen = generators[b]
        if isinstance(gen, torch.Generator) and counts[b] > 0:
            uniforms[b] = torch.rand(counts[b], generator=gen, device=gen.device, dtype=torch.float64).tolist()
    return uniforms


def _sampled_walk(kids: list[list[int]], tokens: list[int], p: list[float],
                  u: list[float]) -> tuple[list[int], int, list[int]]:
    """A sampled row's walk down its tree by multi-candidate rejection (see the module docstring):
    ``kids[r]`` the nodes below pass row r, ``p[i]`` node i's probability at its parent, ``u`` its
    uniforms in trial order. Returns the accepted path, the last row and the tokens rejected there."""
    trial, row = 0, 0
    path: list[int] = []
    while True:
        removed: list[int] = []
        removed_mass = 0.0
        chosen = -1
        for child in kids[row]:
            token = tokens[child]
            if token in removed:  # a duplicate guess: already rejected, probability 0 now
                continue
            left = 1.0 - removed_mass
            ratio = p[child] / left if left > 0 else 0.0
            accept = u[trial] < min(1.0, ratio)
            trial += 1
            if accept:
                chosen = child
                break
            removed.append(token)
            removed_mass += p[child]
        if chosen < 0:
            return path, row, removed
        path.append(chosen)
        row = chosen + 1
