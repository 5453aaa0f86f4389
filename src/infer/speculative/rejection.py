"""Batched, lossless verification of drafted tokens (Leviathan et al. 2023, Algorithm 1).

For each row, drafted token ``t_i`` (proposed from ``q_i``) is accepted with probability
``min(1, p_i(t_i) / q_i(t_i))``. At the first rejection, position ``n``, the correction token is
drawn from ``norm(max(0, p_n - q_n))``; if every draft is accepted a bonus token is drawn from
``p_{num_draft + 1}``. Every emitted token is then distributed exactly as if it had been sampled
from the target model directly, which is what makes speculative decoding lossless.

All per-token work is tensor ops over the whole batch. The only Python loops are over rows, to
draw random numbers from each request's own ``torch.Generator`` (so a request's draws do not
depend on what it is batched with). Nothing is read back to the host while verifying when the
caller gives the draft counts and greedy flags as host lists (the runner does): the correction or
bonus token is drawn as plain sampling draws it (``sampler.inverse_cdf``: one uniform from the
row's source, the same draw ``sample_from_probs`` makes), whether its distribution was drawable is
checked on the device and read with the verdict, and the verdict comes back in one read
(``VerificationResult.to_host``): one wait for the device per round.

A row whose randomness is a ``KeyedDraw`` (a seeded request) is verified differently: the token
the target samples at each position is fixed by the position's keyed uniform (the inverse CDF of
p there), so the row accepts its drafts while each equals the target's sample at
its position and then emits that sample. That is plain decoding's token at every position, so
the output is the same with and without speculation and distributed exactly as p; a one-hot
draft t is accepted with probability p(t), as by rejection sampling. On the CPU a keyed row draws
its samples up to its first mismatch (reading its drafts); elsewhere it draws every position it may
reach at once, reading nothing (``host_reads_are_free``): the same tokens either way.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from infer.sampling.sampler import (
    KeyedDraw,
    RandomSource,
    invalid_rows,
    inverse_cdf,
    keyed_sample,
    on_device,
    row_uniforms,
)


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
    def of_chain(cls, accepted: Sequence[int], emitted: list[list[int]]) -> "Verdict":
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
    chosen = target_probs.argmax(dim=2)  # [B, K+1]
    keyed_invalid: dict[int, torch.Tensor] = {}
    if keyed and host_reads_are_free(device):
        # On the CPU a keyed row's samples are drawn only up to its first mismatch (each costs a V-wide
        # noise draw); the positions after it cannot be accepted whatever ``chosen`` holds there.
        drafts_host = safe_drafts.tolist()
        for b in keyed:
            draw = generators[b]
            assert isinstance(draw, KeyedDraw)
            count = num_draft_host[b]
            path, _, token = keyed_walk(target_probs[b], draw, [[j] for j in range(count)] + [[]], drafts_host[b])
            chosen[b, : len(path) + 1] = torch.tensor([*drafts_host[b][: len(path)], token], device=device)
    elif keyed:
        # Elsewhere every position a keyed row may reach is drawn at once (the positions past its first
        # mismatch are never read): more work, no host read.
        picked = []
        for b in range(batch):
            draw = generators[b]
            if b not in keyed:
                picked.append(chosen[b])
                continue
            assert isinstance(draw, KeyedDraw)
            reach = num_draft_host[b] + 1
            probs = target_probs[b, :reach].float()
            keyed_invalid[b] = invalid_rows(probs).any()
            picked.append(torch.cat([inverse_cdf(probs, row_uniforms([draw.at(j) for j in range(reach)], device)),
                                     chosen[b, reach:]]))
        chosen = torch.stack(picked)
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


def _result(drafts: torch.Tensor, num_accepted: torch.Tensor, final: torch.Tensor) -> VerificationResult:
    """Each row's accepted drafts, then ``final`` at its stop position, -1 after: [B, K+1]."""
    batch, k = drafts.shape
    positions = torch.arange(k + 1, device=drafts.device)[None, :]
    padded = torch.cat([drafts, drafts.new_full((batch, 1), -1)], dim=1)
    output = torch.where(positions < num_accepted[:, None], padded, torch.full_like(padded, -1))
    output.scatter_(1, num_accepted[:, None], final[:, None])
    return VerificationResult(num_accepted=num_accepted, output_tokens=output)


def verify_greedy(draft_tokens: Sequence[Sequence[int]], num_draft: Sequence[int],
                  target_tokens: Sequence[Sequence[int]]) -> tuple[list[int], list[list[int]]]:
    """``verify_drafts`` for a batch whose rows are all greedy, from the target's argmax tokens alone.

    ``target_tokens[b]`` holds the argmax of p_1..p_{k+1} for row b's ``k = num_draft[b]`` drafts
    (after any repetition penalty). A draft is accepted while it equals the target's argmax, and the
    row then emits the argmax at its stop position: what ``verify_drafts`` does for a greedy row,
    without forming any distribution or consuming randomness. Returns what
    ``VerificationResult.to_host`` gives: each row's accepted count and emitted tokens.

    Host lists, not tensors: the caller reads the argmax tokens once (the round's one wait for the
    device) and the comparison is a few steps per draft, where the same on tensors took a dozen small
    operators, each costing more than the whole comparison (a CPU round's verification paid them
    every time).
    """
    if not (len(draft_tokens) == len(num_draft) == len(target_tokens)):
        raise ValueError(f"draft_tokens, num_draft and target_tokens must have one row per request, got "
                         f"{len(draft_tokens)}, {len(num_draft)} and {len(target_tokens)}")
    accepted: list[int] = []
    emitted: list[list[int]] = []
    for drafts, count, target in zip(draft_tokens, num_draft, target_tokens, strict=True):
        if len(target) < count + 1 or len(drafts) < count:
            raise ValueError(f"a row with {count} drafts needs {count} draft tokens and {count + 1} target tokens, "
                             f"got {len(drafts)} and {len(target)}")
        kept = 0
        while kept < count and drafts[kept] == target[kept]:
            kept += 1
        accepted.append(kept)
        emitted.append([*drafts[:kept], target[kept]])
    return accepted, emitted
