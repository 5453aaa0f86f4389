"""Candidate trees for tree speculation (Medusa): shape, attention mask, positions, lossless acceptance.

A *static* tree fixes, once, which guesses are verified: node ``(r_1, .., r_d)`` is "head 1's
rank-r_1 token, then head 2's rank-r_2 token, ..., head d's rank-r_d token". Each round fills the
shape with the heads' current top-s tokens, so the tree's topology (and its attention mask) never
changes, only its tokens.

Conventions used throughout (per request row ``b``):

* nodes ``0 .. N_b-1`` are listed parents-first (``parents[b, i] < i``); ``-1`` is the root, the
  last accepted token ``g`` that the verification pass feeds first;
* a verification pass feeds ``[g, node_0, .., node_{N-1}]``, so node ``i`` is pass row ``i + 1``;
  the target distribution at row ``j`` predicts the token after that row's path;
* a chain of K drafts is the tree with ``parents = [-1, 0, 1, .., K-2]``.

Acceptance is exact. Greedy rows keep the longest path whose every token equals the target's
argmax at its parent. Sampled rows walk down from the root with multi-candidate recursive
rejection sampling: the children of a node are deterministic guesses (one-hot q), tried in turn;
child ``c`` is accepted with probability ``p_res(c)``, where ``p_res`` is the target distribution
at the node with the already rejected siblings removed and renormalised; on acceptance the walk
descends into ``c``; when every child is rejected the final token is drawn from ``p_res``. Each
emitted token is therefore distributed exactly as the target's (SpecInfer, Miao et al. 2024,
with one-hot proposals). Seeded rows (a ``KeyedDraw``) are walked like greedy rows, with the
target's keyed sample at each node's position in place of its argmax (see ``rejection.py``):
a child is taken iff its token is that sample, which happens with probability p(child), as by
the multi-candidate rejection, and the emitted tokens are plain decoding's.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from infer.sampling.sampler import KeyedDraw, RandomSource, sample_rows
from infer.speculative.rejection import Verdict, keyed_walk

# ---------------------------------------------------------------------------------------------- shape


@dataclass(frozen=True)
class CandidateTree:
    """A static tree over head ranks; ``paths[i]`` is node i's rank path (its length is the depth)."""

    paths: tuple[tuple[int, ...], ...]

    def __post_init__(self) -> None:
        index = {p: i for i, p in enumerate(self.paths)}
        if len(index) != len(self.paths):
            raise ValueError("candidate tree has duplicate nodes")
        for i, path in enumerate(self.paths):
            if not path or min(path) < 0:
                raise ValueError(f"tree node {i}: rank path {path} must be non-empty and non-negative")
            if len(path) > 1 and index.get(path[:-1], len(self.paths)) >= i:
                raise ValueError(f"tree node {i} {path}: its parent must be listed before it")

    @property
    def size(self) -> int:
        return len(self.paths)

    @cached_property
    def parents(self) -> list[int]:
        index = {p: i for i, p in enumerate(self.paths)}
        return [index[p[:-1]] if len(p) > 1 else -1 for p in self.paths]

    @cached_property
    def depths(self) -> list[int]:
        return [len(p) for p in self.paths]

    @cached_property
    def heads(self) -> list[int]:
        """Which head's candidates fill node i (head k guesses the token at depth k + 1)."""
        return [len(p) - 1 for p in self.paths]

    @cached_property
    def ranks(self) -> list[int]:
        return [p[-1] for p in self.paths]

    @property
    def max_depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def top_k(self) -> int:
        """Candidates needed per head (the largest rank used, plus one)."""
        return max(self.ranks, default=-1) + 1

    def subtree(self, max_depth: int, max_nodes: int) -> list[int]:
        """Node indices of the best part of the tree within a depth and a size limit.

        Filtering by depth keeps every node's ancestors, and a prefix of a parents-first list is
        again a tree, so the result is a valid tree that keeps the highest-ranked nodes.
        """
        return [i for i, d in enumerate(self.depths) if d <= max_depth][: max(0, max_nodes)]


def default_rank_accuracy(num_heads: int, top_k: int = 10) -> list[list[float]]:
    """A prior for P(head k's rank-r candidate is right) when the heads were never calibrated.

    Later heads and lower ranks are less often right; the numbers are typical of trained Medusa
    heads and only shape the default tree.
    """
    return [[0.6 * 0.7**k * 0.45**r for r in range(top_k)] for k in range(num_heads)]


def build_tree(rank_accuracy: Sequence[Sequence[float]], num_nodes: int) -> CandidateTree:
    """Greedy best-first expansion: the ``num_nodes`` rank paths with the highest estimated probability.

    A path's score is the product of its ranks' accuracies (heads treated as independent). The
    expected number of accepted tokens is the sum of the kept paths' scores, so taking paths in
    score order maximises it for the node budget. Accuracies are made non-increasing in rank first,
    which makes every child score at most its parent's and every sibling at most its elder's: the
    frontier holds only each kept node's first child and next sibling, and nodes come out parents
    first.
    """
    if num_nodes < 1:
        raise ValueError(f"a candidate tree needs at least one node, got num_nodes={num_nodes}")
    acc: list[list[float]] = []
    for k, row in enumerate(rank_accuracy):
        if not row:
            raise ValueError(f"rank_accuracy[{k}] is empty")
        clean, floor = [], 1.0
        for a in row:
            floor = min(floor, max(float(a), 1e-9))  # positive, non-increasing
            clean.append(floor)
        acc.append(clean)
    if not acc:
        raise ValueError("rank_accuracy must cover at least one head")
    paths: list[tuple[int, ...]] = []
    counter = 0  # tie-breaker: first pushed first (shallower, lower rank)
    frontier: list[tuple[float, int, tuple[int, ...], float]] = [(-acc[0][0], counter, (0,), acc[0][0])]
    while frontier and len(paths) < num_nodes:
        _, _, path, score = heapq.heappop(frontier)
        paths.append(path)
        depth, rank = len(path), path[-1]
        parent_score = score / acc[depth - 1][rank]
        if rank + 1 < len(acc[depth - 1]):  # next sibling
            counter += 1
            s = parent_score * acc[depth - 1][rank + 1]
            heapq.heappush(frontier, (-s, counter, path[:-1] + (rank + 1,), s))
        if depth < len(acc):  # first child
            counter += 1
            s = score * acc[depth][0]
            heapq.heappush(frontier, (-s, counter, path + (0,), s))
    return CandidateTree(tuple(paths))


# --------------------------------------------------------------------------- mask and positions


def tree_attention_mask(parents: torch.Tensor, num_nodes: Sequence[int]) -> torch.Tensor:
    """[B, N+1, N+1] bool: pass row i may attend to pass row j iff j is i or one of its ancestors.

    Row 0 is the root g; row i + 1 is node i. Padding nodes (``i >= num_nodes[b]``) hang off the
    root so their rows stay well defined; nothing ever descends from them.
    """
    batch, n = parents.shape
    device = parents.device
    valid = torch.arange(n, device=device).unsqueeze(0) < torch.tensor(list(num_nodes), device=device).unsqueeze(1)
    parent_row = torch.where(valid, parents.long() + 1, torch.zeros_like(parents, dtype=torch.long))
    step = torch.zeros(batch, n + 1, n + 1, device=device)
    step[:, 1:].scatter_(2, parent_row.unsqueeze(2), 1.0)  # step[b, i, parent(i)] = 1
    reach = torch.eye(n + 1, device=device).expand(batch, -1, -1).clone()
    mask = reach.clone()
    for _ in range(n):  # walk up one level per iteration: at most the tree depth
        reach = torch.bmm(reach, step)
        if not bool(reach.any()):
            break
        mask += reach
    return mask > 0


class TreeMaskCache:
    """``tree_attention_mask`` with each row's mask remembered by its shape: a static tree only ever
    produces a handful of shapes (its depth- and size-limited subtrees), so steady-state rounds just
    stack cached rows instead of walking the tree again."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[tuple[int, tuple[int, ...]], torch.Tensor] = OrderedDict()

    def __call__(self, parents: torch.Tensor, num_nodes: Sequence[int]) -> torch.Tensor:
        width = parents.shape[1]
        host = parents.tolist()
        rows = []
        for b, count in enumerate(num_nodes):
            key = (width, tuple(host[b][:count]))
            row = self._rows.get(key)
            if row is None:
                row = tree_attention_mask(parents[b: b + 1], [count])[0]
                self._rows[key] = row
                if len(self._rows) > self.capacity:
                    self._rows.popitem(last=False)
            else:
                self._rows.move_to_end(key)
            rows.append(row)
        return torch.stack(rows)


def tree_depths(mask: torch.Tensor) -> torch.Tensor:
    """[B, N+1] depth of each pass row (root 0) from its ancestor mask: ancestors counted."""
    return mask.sum(dim=-1) - 1


# ------------------------------------------------------------------------------------ acceptance


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
    greedy: torch.Tensor,
    generators: Sequence[RandomSource],
    mask: torch.Tensor | None = None,
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
        mask: ``tree_attention_mask(parents, num_nodes)`` if the caller already has it.
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
    greedy_host = greedy.tolist()
    keyed = {b for b in range(batch) if not greedy_host[b] and isinstance(generators[b], KeyedDraw)}
    # Greedy and keyed rows know the target's token at every pass row: its argmax, its keyed sample.
    exact_host = [bool(g) or b in keyed for b, g in enumerate(greedy_host)]
    host_tokens, host_parents, host_p = tokens.tolist(), parents.tolist(), p_node.tolist()

    paths: list[list[int]] = []
    last_rows: list[int] = []
    rejected_at_last: list[list[int]] = []
    keyed_final: dict[int, int] = {}
    sampled = [b for b in range(batch) if not exact_host[b]]
    uniforms: dict[int, list[float]] = {}
    shared = [b for b in sampled if generators[b] is None and counts[b] > 0]
    if shared:
        draws = torch.rand(len(shared), n, dtype=torch.float64).tolist()
        uniforms.update(zip(shared, draws, strict=True))
    for b in sampled:
        gen = generators[b]
        if isinstance(gen, torch.Generator) and counts[b] > 0:
            # Exactly num_nodes[b] uniforms per round: the stream depends on this request alone.
            uniforms[b] = torch.rand(counts[b], generator=gen, device=gen.device, dtype=torch.float64).tolist()

    best_host, best_depth_host = [0] * batch, [0] * batch
    if len(sampled) + len(keyed) < batch and n > 0:
        argmax = target_probs.argmax(dim=2)  # [B, N+1]
        ok = (tokens == argmax.gather(1, parent_row)) & valid  # node matches its parent's argmax
        full = mask.to(device) if mask is not None else tree_attention_mask(parents, counts)
        among = full[:, 1:, 1:]  # ancestor-or-self among nodes
        path_ok = ~(among & ~ok.unsqueeze(1)).any(dim=2) & ok
        depth = among.sum(dim=2)
        score = torch.where(path_ok, depth, torch.zeros_like(depth))
        best_depth, best = score.max(dim=1)
        best_host, best_depth_host = best.tolist(), best_depth.tolist()
    for b in range(batch):
        kids = _children(host_parents[b], counts[b])
        draw = generators[b]
        if b in keyed and isinstance(draw, KeyedDraw):
            # Walk down while a child is the target's keyed sample at its position; the sample
            # where none is becomes the final token.
            path, row, keyed_final[b] = keyed_walk(target_probs[b], draw, kids, host_tokens[b])
            paths.append(path)
            last_rows.append(row)
            rejected_at_last.append([])
            continue
        if exact_host[b]:
            path = []
            node = best_host[b] if best_depth_host[b] > 0 else -1
            while node >= 0:
                path.append(node)
                node = host_parents[b][node]
            path.reverse()
            paths.append(path)
            last_rows.append(path[-1] + 1 if path else 0)
            rejected_at_last.append([])
            continue
        u = uniforms.get(b, [])
        trial = 0
        row, path = 0, []
        removed: list[int] = []
        while True:
            removed = []
            removed_mass = 0.0
            chosen = -1
            for child in kids[row]:
                token = host_tokens[b][child]
                if token in removed:  # a duplicate guess: already rejected, probability 0 now
                    continue
                left = 1.0 - removed_mass
                ratio = host_p[b][child] / left if left > 0 else 0.0
                accept = u[trial] < min(1.0, ratio)
                trial += 1
                if accept:
                    chosen = child
                    break
                removed.append(token)
                removed_mass += host_p[b][child]
            if chosen < 0:
                break
            path.append(chosen)
            row = chosen + 1
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


def verify_tree_greedy(node_tokens: Sequence[Sequence[int]], num_nodes: Sequence[int],
                       parents: Sequence[Sequence[int]], choices: Sequence[Sequence[int]]) -> Verdict:
    """``verify_tree`` for a batch of greedy rows without processors, from the target's argmax alone.

    ``choices[b][r]`` is the argmax of pass row ``r`` (0: the root, node i: row i + 1). The kept
    path ends at the deepest node whose every node matches its parent row's argmax (the first such
    node on a tie, as ``verify_tree``), and the final token is its row's argmax: the same verdict,
    without forming a [B, N+1, V] distribution.
    """
    paths, last_rows, out_tokens = [], [], []
    for tokens, count, parent, choice in zip(node_tokens, num_nodes, parents, choices, strict=True):
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
        last = best + 1
        paths.append(path)
        last_rows.append(last)
        out_tokens.append([tokens[i] for i in path] + [choice[last]])
    return Verdict(paths=paths, tokens=out_tokens, last_rows=last_rows)
