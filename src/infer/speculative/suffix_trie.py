"""Suffix tries with counts: what continued each short token string, and how often (suffix decoding).

A :class:`SuffixTrie` stores a set of token sequences. Each sequence ``s`` contributes every window
``s[i : i + depth]`` as a path from the root, so a node's ``count`` is the number of occurrences of
its path (a string of at most ``depth`` tokens) in the stored sequences, and among the occurrences
that continued, ``count(child) / sum(counts of the children)`` is the empirical probability that
the path goes on with the child's token. Sequences grow incrementally (a running request gains
tokens every round) and can be removed again.

Costs, with D = ``depth``, n = stored tokens, L = one sequence's length:

* appending a token to a sequence: O(D), one node per window that is still open;
* removing a sequence: O(L·D), the reverse walk;
* :meth:`SuffixTrie.match` (the longest suffix of a context that occurred with a continuation):
  O(D log D), a binary search over the suffix length (a suffix that occurred with a continuation
  implies that all its shorter suffixes did);
* :meth:`SuffixTrie.expand` (the best N-node draft tree): O(N log N) plus the children visited;
* memory: at most n·D nodes, fewer when the sequences share substrings. Nodes live in flat arrays
  (seven 4-byte fields) plus one dict entry each, not in per-node objects.

Windows end at ``depth`` tokens, and every appended token costs a node per open window, so the
depth is the cost of the trie. A draft may run deeper than the windows: each node remembers where
its path first occurred (sequence and end position), and :meth:`SuffixTrie.expand` continues a path
that reached the windows' depth by copying what followed that occurrence, as prompt lookup does
(the first, not the latest: it has the most text after it, as the windows from it would have).

:class:`SuffixStore` keeps one trie per isolation key (a tenant's ``cache_salt``) under one
memory bound: when the stored tokens or sequences exceed it, the oldest finished sequences are
removed first. Only token ids are stored.
"""

from __future__ import annotations

import heapq
from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

ROOT = 0
_NONE = -1
_TOKEN_BITS = 32  # an edge key packs (parent node, token): token ids must fit in 32 bits


@dataclass
class DraftTree:
    """A tree of guessed continuations, parents first: node i follows ``parents[i]`` (-1: the context)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    # Estimated probability that the path to node i is what comes next (product of the frequencies
    # along it); the sum over nodes estimates the tokens a round would accept.
    scores: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)


class SuffixTrie:
    """Every substring of length <= ``depth`` of the stored sequences, with its number of occurrences."""

    def __init__(self, depth: int) -> None:
        if depth < 2:
            raise ValueError(f"depth={depth} must be >= 2 (a match plus at least one guessed token)")
        self.depth = depth
        # Node fields, indexed by node id; node 0 is the root (the empty string).
        self._count = array("i", [0])
        self._token = array("i", [_NONE])
        self._parent = array("i", [_NONE])
        self._first_child = array("i", [_NONE])
        self._next_sibling = array("i", [_NONE])
        # Where the node's path first occurred: its sequence's handle and the position after its end.
        self._occ_seq = array("i", [_NONE])
        self._occ_end = array("i", [0])
        self._handles: dict[Hashable, int] = {}  # sequence id -> a small int the nodes can hold
        self._by_handle: dict[int, list[int]] = {}
        self._next_handle = 0
        self._edges: dict[int, int] = {}  # (parent << 32) | token -> child
        self._free: list[int] = []  # ids of deleted nodes, reused first
        self._sequences: dict[Hashable, list[int]] = {}
        # Per sequence, the deepest node of each window that can still grow (at most depth - 1 of
        # them, oldest window first): appending a token adds one child to each, and one to the root.
        self._open: dict[Hashable, list[int]] = {}
        self.num_tokens = 0

    # -- size ------------------------------------------------------------------------------------
    @property
    def num_nodes(self) -> int:
        """Nodes in use, the root excluded."""
        return len(self._count) - 1 - len(self._free)

    @property
    def num_sequences(self) -> int:
        return len(self._sequences)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._sequences

    def sequence_length(self, seq_id: Hashable) -> int:
        return len(self._sequences.get(seq_id, ()))

    # -- building --------------------------------------------------------------------------------
    def extend(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        """Append ``tokens`` to sequence ``seq_id`` (a new sequence if unknown) and count its new windows."""
        seq = self._sequences.setdefault(seq_id, [])
        open_nodes = self._open.setdefault(seq_id, [])
        handle = self._handles.get(seq_id)
        if handle is None:
            handle = self._handles[seq_id] = self._next_handle
            self._by_handle[handle] = seq
            self._next_handle += 1
        count = self._count
        for token in tokens:
            if not 0 <= token < 1 << _TOKEN_BITS:
                raise ValueError(f"token id {token} is out of range for the suffix trie")
            grown = []
            end = len(seq) + 1
            for node in open_nodes + [ROOT]:
                child = self._child_or_new(node, token, handle, end)
                count[child] += 1
                grown.append(child)
            seq.append(token)
            self.num_tokens += 1
            # The oldest window reached full depth when the sequence holds `depth` tokens past it.
            open_nodes[:] = grown[1:] if len(grown) >= self.depth else grown

    def remove(self, seq_id: Hashable) -> None:
        """Forget sequence ``seq_id``: every window it contributed is uncounted, emptied nodes freed."""
        seq = self._sequences.pop(seq_id, None)
        self._open.pop(seq_id, None)
        if seq is None:
            return
        # Nodes that still point at it (first seen there, kept by later sequences) copy nothing now.
        self._by_handle.pop(self._handles.pop(seq_id), None)
        self.num_tokens -= len(seq)
        count = self._count
        for start in range(len(seq)):
            path = self._path_nodes(seq[start: start + self.depth])
            for node in path:
                count[node] -= 1
            for node in reversed(path):  # deepest first: a node's children are gone before it
                if count[node] == 0:
                    self._delete(node)

    # -- queries ---------------------------------------------------------------------------------
    def count(self, path: Sequence[int]) -> int:
        """Occurrences of ``path`` (at most ``depth`` tokens) in the stored sequences; 0 if absent."""
        if len(path) > self.depth:
            raise ValueError(f"a path of {len(path)} tokens is deeper than the trie ({self.depth})")
        node = self._walk(path)
        return 0 if node == _NONE else self._count[node]

    def continuations(self, path: Sequence[int]) -> dict[int, int]:
        """Token -> how often ``path`` was followed by it."""
        node = self._walk(path)
        return {} if node == _NONE else {self._token[c]: self._count[c] for c in self._children(node)}

    def match(self, context: Sequence[int], max_length: int) -> tuple[int, int]:
        """The longest suffix of ``context`` (at most ``max_length`` tokens) that occurred followed by
        another token: ``(node, length)``, or ``(ROOT, 0)`` when not even the last token did."""
        lo, hi, best = 0, min(max_length, len(context), self.depth - 1), ROOT
        end = len(context)
        while lo < hi:  # invariant: the suffix of length lo matches (with a continuation)
            mid = (lo + hi + 1) // 2
            node = self._walk(context[end - mid:])
            if node != _NONE and self._first_child[node] != _NONE:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo

    def expand(self, node: int, max_nodes: int, max_depth: int, min_prob: float, node_depth: int = 0) -> DraftTree:
        """The draft tree of at most ``max_nodes`` nodes and ``max_depth`` levels below ``node`` with
        the highest estimated path probabilities, none below ``min_prob``.

        Best-first: a path's score is the product of the continuation frequencies along it, which
        never grows with depth, so popping the best frontier node always yields parents before
        their children and the kept nodes are the ``max_nodes`` most probable paths. ``node_depth``:
        the length of ``node``'s path (the match); a path that reaches the windows' ``depth`` goes
        on as a chain copied from its first occurrence, at its score.
        """
        tree = DraftTree()
        if max_nodes <= 0 or max_depth <= 0:
            return tree
        # (-score, tie, node, parent index, depth); node _NONE: a copied token (``copied``'s head)
        frontier: list[tuple[float, int, int, int, int]] = []
        copied: dict[int, list[int]] = {}  # tie -> the copied tokens still to place
        tie = 0

        def push_children(parent_node: int, score: float, index: int, depth: int) -> None:
            nonlocal tie
            kids = self._children(parent_node)
            total = sum(self._count[c] for c in kids)
            for child in kids:
                child_score = score * self._count[child] / total
                if child_score >= min_prob:
                    tie += 1
                    heapq.heappush(frontier, (-child_score, tie, child, index, depth + 1))

        def push_copy(tokens: list[int], score: float, index: int, depth: int) -> None:
            nonlocal tie
            if tokens and depth < max_depth:
                tie += 1
                copied[tie] = tokens
                heapq.heappush(frontier, (-score, tie, _NONE, index, depth + 1))

        push_children(node, 1.0, -1, 0)
        while frontier and len(tree) < max_nodes:
            neg_score, key, child, parent_index, depth = heapq.heappop(frontier)
            if child == _NONE:
                rest = copied.pop(key)
                tree.tokens.append(rest[0])
            else:
                tree.tokens.append(self._token[child])
            tree.parents.append(parent_index)
            tree.scores.append(-neg_score)
            if depth >= max_depth:
                continue
            if child == _NONE:
                push_copy(rest[1:], -neg_score, len(tree) - 1, depth)
            elif node_depth + depth >= self.depth:  # the windows end here: copy what followed
                push_copy(self._continuation(child, max_depth - depth), -neg_score, len(tree) - 1, depth)
            else:
                push_children(child, -neg_score, len(tree) - 1, depth)
        return tree

    def _continuation(self, node: int, length: int) -> list[int]:
        """Up to ``length`` tokens that followed the first occurrence of ``node``'s path."""
        seq = self._by_handle.get(self._occ_seq[node])
        if seq is None:
            return []
        end = self._occ_end[node]
        return seq[end: end + length]

    # -- nodes -----------------------------------------------------------------------------------
    def _walk(self, path: Iterable[int]) -> int:
        node = ROOT
        edges = self._edges
        for token in path:
            node = edges.get((node << _TOKEN_BITS) | token, _NONE)
            if node == _NONE:
                return _NONE
        return node

    def _path_nodes(self, path: Sequence[int]) -> list[int]:
        nodes, node = [], ROOT
        for token in path:
            node = self._edges[(node << _TOKEN_BITS) | token]
            nodes.append(node)
        return nodes

    def _children(self, node: int) -> list[int]:
        kids = []
        child = self._first_child[node]
        while child != _NONE:
            kids.append(child)
            child = self._next_sibling[child]
        return kids

    def _child_or_new(self, node: int, token: int, handle: int, end: int) -> int:
        """The child of ``node`` by ``token``, made (first occurring in sequence ``handle``, its path
        ending before position ``end``) if new."""
        key = (node << _TOKEN_BITS) | token
        child = self._edges.get(key, _NONE)
        if child != _NONE:
            return child
        if self._free:
            child = self._free.pop()
            self._count[child], self._token[child], self._parent[child] = 0, token, node
            self._first_child[child], self._next_sibling[child] = _NONE, self._first_child[node]
            self._occ_seq[child], self._occ_end[child] = handle, end
        else:
            child = len(self._count)
            self._count.append(0)
            self._token.append(token)
            self._parent.append(node)
            self._first_child.append(_NONE)
            self._next_sibling.append(self._first_child[node])
            self._occ_seq.append(handle)
            self._occ_end.append(end)
        self._first_child[node] = child
        self._edges[key] = child
        return child

    def _delete(self, node: int) -> None:
        parent = self._parent[node]
        # Unlink from the parent's child list (short: most nodes have one or two children).
        if self._first_child[parent] == node:
            self._first_child[parent] = self._next_sibling[node]
        else:
            prev = self._first_child[parent]
            while self._next_sibling[prev] != node:
                prev = self._next_sibling[prev]
            self._next_sibling[prev] = self._next_sibling[node]
        del self._edges[(parent << _TOKEN_BITS) | self._token[node]]
        self._parent[node] = self._first_child[node] = self._next_sibling[node] = _NONE
        self._free.append(node)


class SuffixStore:
    """One :class:`SuffixTrie` per isolation key under a shared bound on stored tokens and sequences.

    Sequences are added live (``extend`` as tokens are accepted) and marked ``finish``-ed when their
    request ends; when the bound is exceeded, the oldest finished sequences are removed until it
    holds again. Running sequences are never evicted (their drafts need them), so the bound can be
    exceeded by at most the running requests' own tokens.
    """

    def __init__(self, depth: int, max_tokens: int, max_sequences: int) -> None:
        if max_tokens < 0 or max_sequences < 0:
            raise ValueError(f"max_tokens={max_tokens} and max_sequences={max_sequences} must be >= 0")
        self.depth = depth
        self.max_tokens = max_tokens
        self.max_sequences = max_sequences
        self.tries: dict[Hashable, SuffixTrie] = {}
        self._finished: OrderedDict[tuple[Hashable, Hashable], None] = OrderedDict()  # oldest first
        self.evicted_sequences = 0

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.tries.values())

    @property
    def num_sequences(self) -> int:
        return sum(t.num_sequences for t in self.tries.values())

    @property
    def num_nodes(self) -> int:
        return sum(t.num_nodes for t in self.tries.values())

    def trie(self, key: Hashable) -> SuffixTrie | None:
        return self.tries.get(key)

    def extend(self, key: Hashable, seq_id: Hashable, tokens: Sequence[int]) -> SuffixTrie:
        trie = self.tries.get(key)
        if trie is None:
            trie = self.tries[key] = SuffixTrie(self.depth)
        if tokens:
            trie.extend(seq_id, tokens)
        return trie

    def finish(self, key: Hashable, seq_id: Hashable) -> None:
        """The sequence is complete: keep it for later drafts, as the first to go when over the bound."""
        trie = self.tries.get(key)
        if trie is None or seq_id not in trie:
            return
        self._finished[(key, seq_id)] = None
        self._evict()

    def remove(self, key: Hashable, seq_id: Hashable) -> None:
        trie = self.tries.get(key)
        if trie is None:
            return
        trie.remove(seq_id)
        self._finished.pop((key, seq_id), None)
        if not trie.num_sequences:
            del self.tries[key]

    def _evict(self) -> None:
        tokens, sequences = self.num_tokens, self.num_sequences
        while self._finished and (tokens > self.max_tokens or sequences > self.max_sequences):
            key, seq_id = next(iter(self._finished))
            trie = self.tries[key]
            tokens -= trie.sequence_length(seq_id)
            sequences -= 1
            self.remove(key, seq_id)
            self.evicted_sequences += 1
