"""Candidate trees for tree speculation (Medusa): their shape, attention mask and positions.

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

A tree's acceptance is ``verification.verify``'s, as a chain's is.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

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
