"""EAGLE-3 drafting: a draft head over the target's own features grows a dynamic tree each round.

The runner hands the drafter the target's captured layer inputs (``DrafterInfo.aux_layers``) of every
token the target's cache keeps (``observe_states``). Per request the drafter keeps the head's own KV
cache: entry i is the pair (target state at position i, token at i + 1), at RoPE position i, fed
lazily at the start of a round (the prompt the first time, then the tokens the last round kept).
The last pair (the state of the position before the newest token g, and g itself) gives the
root's output: the logits of the first draft token and the state its children read.

The tree (EAGLE-2, Li et al. 2024): every candidate scores the product of the draft probabilities
along its path. Depth by depth, the ``top_k`` best-scoring candidates of the newest depth are run
through the head together (one pass, each row seeing the cache, its ancestors and itself) and each
proposes its ``top_k`` likeliest children. After ``max_depth`` levels the ``budget`` best-scoring
candidates form the proposal: a path's score never grows as it gets longer, so a kept node's parent
is kept too. Tree nodes never enter the head's cache: the next round feeds what the target accepted,
with the target's own states, as vLLM does.

The tree is verified by the engine's tree path (``speculative.verification.verify``) with one-hot
proposals, so the output is exactly the target's whatever the head guesses: greedy output is the
plain output token for token, and sampled output follows the target's distribution.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infer.core.request import Request
from infer.models.config import ModelConfig
from infer.models.eagle3 import CONFIG_FILE, WEIGHTS_FILE, Eagle3Head, attend, default_aux_layers
from infer.speculative.drafter import Drafter, DrafterInfo, Proposal

DEFAULT_TOP_K = 4  # candidates expanded per depth, and children proposed by each
# The most positions one catch-up feeds the head: a request's prompt, or a stretch of plain rounds
# (the tree sizer left speculation off), beyond that is skipped, its oldest positions first. Feeding
# costs the head a pass over every row, so after a long stretch each probe of a tree paid for the
# whole backlog, while the draft hardly reads that far back (docs/speculative.md has the figures).
MAX_BACKLOG = 64
# While the tree sizer rests on plain decoding, only the passes this many rounds before its next probe
# capture the target's layer inputs: capturing costs a resting round a few percent of a decode step
# (docs/speculative.md), and a probe drafting from its last 16 positions did as well as from its
# whole backlog.
CAPTURE_WINDOW = 16


def default_head_dir(target: str | os.PathLike[str]) -> Path:
    """Where ``infer train eagle`` writes and ``--speculator eagle`` looks by default: ``eagle/`` in the
    target's drafters folder (``~/.cache/infer/drafters/<model>/eagle`` for a GGUF or built-in model)."""
    from infer.loader.hub import drafter_dir

    return drafter_dir(target, "eagle")


def load_eagle_head(folder: str | None, target: str, target_config: ModelConfig, dtype: torch.dtype,
                    device: torch.device) -> Eagle3Head:
    """The head in ``folder`` (None: the default folder), checked against the target's sizes, with its
    aux layers resolved (the target's default when the config names none)."""
    path = Path(folder) if folder else default_head_dir(target)
    if not (path / WEIGHTS_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"no EAGLE-3 head in {path} (need {CONFIG_FILE} and {WEIGHTS_FILE}): train one with "
            f"`infer train eagle --target {target}`" + ("" if folder else " or pass its folder as eagle_head"))
    head = Eagle3Head.load(path, dtype, device)
    config = head.config
    problems = []
    if config.vocab_size != target_config.vocab_size:
        problems.append(f"vocabulary {config.vocab_size} (the target's: {target_config.vocab_size})")
    if config.target_hidden_size != target_config.hidden_size:
        problems.append(f"target hidden size {config.target_hidden_size} (the target's: {target_config.hidden_size})")
    if head.embed_tokens is None and config.hidden_size != target_config.hidden_size:
        problems.append(f"hidden size {config.hidden_size} without its own embeddings (the target's are "
                        f"{target_config.hidden_size} wide)")
    layers = target_config.num_hidden_layers
    if config.aux_layers is None:
        config.aux_layers = default_aux_layers(layers)
    elif not all(0 <= i <= layers for i in config.aux_layers):
        problems.append(f"aux layers {list(config.aux_layers)} (the target has {layers} layers)")
    if problems:
        raise ValueError(f"the EAGLE-3 head in {path} was not made for {target}: " + "; ".join(problems)
                         + f"; train one with `infer train eagle --target {target}`")
    return head


@dataclass
class _Sequence:
    """One request's head cache and the target states not fed to it yet."""

    keys: torch.Tensor
    values: torch.Tensor
    length: int = 0  # cache entries in use
    fed_to: int = 0  # every position below was fed (or never observed)
    pending: list[int] = field(default_factory=list)  # the positions observed and not fed yet, in order
    # Their states, row i for pending[i]: one buffer, grown by doubling, that each observed pass is
    # copied into (a round that falls back to a plain step then keeps no tensor of its own alive).
    states: torch.Tensor | None = None

    def observed_to(self) -> int:
        return self.pending[-1] + 1 if self.pending else self.fed_to


@dataclass
class _Tree:
    """Candidates of one round (index 0 .. n-1); ``parent`` -1 is the root."""

    tokens: list[int] = field(default_factory=list)  # draft ids
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    score: list[float] = field(default_factory=list)  # log of the product of draft probabilities on the path

    def add(self, tokens: list[int], logprobs: list[float], parent: int, depth: int, base: float) -> None:
        for token, lp in zip(tokens, logprobs, strict=True):
            self.tokens.append(token)
            self.parent.append(parent)
            self.depth.append(depth)
            self.score.append(base + lp)


class EagleDrafter(Drafter):
    """Drafts a tree of up to ``budgets[b]`` nodes per request with an EAGLE-3 head (see the module doc)."""

    def __init__(self, head: Eagle3Head, embed: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str,
                 max_draft_tokens: int, max_depth: int, cost_hint: float, top_k: int = DEFAULT_TOP_K,
                 max_backlog: int = MAX_BACKLOG, capture_window: int = CAPTURE_WINDOW) -> None:
        if head.config.aux_layers is None:
            raise ValueError("the head's aux layers must be resolved against the target (load_eagle_head)")
        self.head = head
        self.embed = head.embed_tokens if head.embed_tokens is not None else embed
        self.device = torch.device(device)
        self.max_depth, self.top_k = max_depth, top_k
        if max_backlog < 1 or capture_window < 1:
            raise ValueError(f"max_backlog={max_backlog} and capture_window={capture_window} must be >= 1")
        self.max_backlog = max_backlog
        self.dtype = head.norm.weight.dtype  # (the projections may hold quantized blocks)
        self.target_ids = head.target_ids.tolist()
        self.info = DrafterInfo(tree=True, max_draft_tokens=max_draft_tokens, aux_layers=tuple(head.config.aux_layers),
                                cost_hint=cost_hint, aux_window=min(capture_window, max_backlog))
        self._seqs: dict[str, _Sequence] = {}

    # -- state from the runner -------------------------------------------------------------------
    def observe_states(self, request: Request, position: int, states: torch.Tensor) -> None:
        seq = self._seqs.get(request.request_id)
        if seq is None:
            config = self.head.config
            shape = (64, config.num_key_value_heads, config.head_dim)
            seq = self._seqs[request.request_id] = _Sequence(torch.empty(shape, dtype=self.dtype, device=self.device),
                                                             torch.empty(shape, dtype=self.dtype, device=self.device))
        skip = max(seq.observed_to() - position, 0)  # a retried pass repeats positions already held
        new = states.shape[0] - skip
        if new <= 0:
            return
        held = len(seq.pending)
        keep = self.max_backlog
        if held + new > 2 * keep:
            # Far behind: only the newest ``keep`` positions will ever be fed (``_catch_up``), so the
            # buffer restarts with them (held ones first) rather than growing with the backlog.
            older = max(keep - new, 0)
            kept = [seq.states[held - older: held]] if older and seq.states is not None else []
            seq.states = torch.cat([*kept, states[states.shape[0] - min(new, keep):].to(self.dtype)])
            seq.pending = seq.pending[held - older:] + list(range(position + states.shape[0] - min(new, keep),
                                                                  position + states.shape[0]))
            return
        if seq.states is None or held + new > seq.states.shape[0]:
            grown = torch.empty(max(64, 2 * (held + new)), states.shape[1], dtype=self.dtype, device=self.device)
            if held:
                grown[:held] = seq.states[:held]  # type: ignore[index]
            seq.states = grown
        seq.states[held: held + new] = states[skip:]
        seq.pending.extend(range(position + skip, position + skip + new))

    def release(self, request: Request) -> None:
        self._seqs.pop(request.request_id, None)

    # -- drafting ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[Request], budgets: list[int], hidden_states: torch.Tensor | None) -> Proposal:
        depths = [min(self.max_depth, r.tokens_left) for r in requests]
        active = [b for b, r in enumerate(requests) if budgets[b] > 0 and depths[b] > 0 and self._ready(r)]
        trees: list[tuple[list[int], list[int]]] = [([], []) for _ in requests]
        if active:
            roots = self._catch_up([requests[b] for b in active])
            grown = self._grow([requests[b] for b in active], roots, [budgets[b] for b in active],
                               [depths[b] for b in active])
            for b, tree in zip(active, grown, strict=True):
                trees[b] = tree
        width = max((len(tokens) for tokens, _ in trees), default=0)
        tokens = torch.zeros(len(requests), width, dtype=torch.long)
        parents = torch.full((len(requests), width), -1, dtype=torch.long)
        for b, (node_tokens, node_parents) in enumerate(trees):
            if node_tokens:
                tokens[b, : len(node_tokens)] = torch.tensor(node_tokens)
                parents[b, : len(node_parents)] = torch.tensor(node_parents)
        return Proposal(tokens.to(self.device), [len(t) for t, _ in trees], None, parents.to(self.device))

    def _ready(self, request: Request) -> bool:
        """Whether the head has the state of the position before the newest token, not fed yet (without
        it the request's round is a plain step, whose pass provides it)."""
        seq = self._seqs.get(request.request_id)
        root = request.num_tokens - 2
        return seq is not None and root >= 0 and bool(seq.pending) and seq.observed_to() == root + 1

    def _qkv(self, embeds: torch.Tensor, state: torch.Tensor,
             positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The head layer's q [R, heads, D], k and v [R, kv_heads, D] and residual [R, hidden] of rows."""
        cos, sin = self.head.rope(torch.tensor(positions, device=self.device).unsqueeze(0), self.dtype)
        q, k, v, residual = self.head.midlayer.qkv(embeds.unsqueeze(0), state.unsqueeze(0), cos, sin)
        return q[0], k[0], v[0], residual[0]

    def _finish(self, q: torch.Tensor, residual: torch.Tensor, sizes: list[int], keys: list[torch.Tensor],
                values: list[torch.Tensor], masks: list[torch.Tensor]) -> torch.Tensor:
        """The layer's outputs [R, hidden] for rows of several requests: request i owns the next
        ``sizes[i]`` rows, which attend over ``keys[i]``/``values[i]`` [S_i, kv_heads, D] as
        ``masks[i]`` [n_i, S_i] allows (attention padded per request)."""
        if len(sizes) == 1:  # one request: nothing to pad
            out = attend(q.unsqueeze(0), keys[0].unsqueeze(0), values[0].unsqueeze(0), masks[0].unsqueeze(0))
            return self.head.midlayer.finish(residual, out[0])
        config = self.head.config
        count, longest = len(sizes), max(sizes)
        context = max(key.shape[0] for key in keys)
        qs = q.new_zeros(count, longest, config.num_attention_heads, config.head_dim)
        padded_k = q.new_zeros(count, context, config.num_key_value_heads, config.head_dim)
        padded_v = torch.zeros_like(padded_k)
        mask = torch.zeros(count, longest, context, dtype=torch.bool, device=self.device)
        mask[:, :, 0] = True  # padding rows see one key (a row with none gives NaN); they are dropped
        row = 0
        for i, n in enumerate(sizes):
            qs[i, :n] = q[row: row + n]
            padded_k[i, : keys[i].shape[0]] = keys[i]
            padded_v[i, : values[i].shape[0]] = values[i]
            mask[i, :n] = False
            mask[i, :n, : masks[i].shape[1]] = masks[i]
            row += n
        out = attend(qs, padded_k, padded_v, mask)
        attended = torch.cat([out[i, :n] for i, n in enumerate(sizes)])
        return self.head.midlayer.finish(residual, attended)

    def _catch_up(self, requests: list[Request]) -> torch.Tensor:
        """Feed each request's pairs the head has not seen; the roots' outputs [A, hidden]."""
        seqs = [self._seqs[r.request_id] for r in requests]
        positions: list[int] = []
        tokens: list[int] = []
        chunks: list[torch.Tensor] = []
        sizes: list[int] = []
        for request, seq in zip(requests, seqs, strict=True):
            ids = request.all_token_ids
            skip = max(len(seq.pending) - self.max_backlog, 0)  # the oldest beyond the backlog: never fed
            fed = seq.pending[skip:]
            assert seq.states is not None  # (pending positions have their states)
            positions += fed
            tokens += [ids[p + 1] for p in fed]
            chunks.append(seq.states[skip: skip + len(fed)])  # copied by the cat below, before the buffer is reused
            sizes.append(len(fed))
            seq.pending = []
            seq.fed_to = len(ids) - 1
        head = self.head
        state = head.fc(torch.cat(chunks))
        embeds = self.embed(torch.tensor(tokens, device=self.device)).to(self.dtype)
        # Each request's new keys go after its cache: visible to its rows causally.
        q, head_k, head_v, residual = self._qkv(embeds, state, positions)
        keys, values, masks = [], [], []
        row = 0
        for seq, n in zip(seqs, sizes, strict=True):
            self._append(seq, head_k[row: row + n], head_v[row: row + n])
            keys.append(seq.keys[: seq.length])
            values.append(seq.values[: seq.length])
            mask = torch.ones(n, seq.length, dtype=torch.bool, device=self.device)
            mask[:, seq.length - n:] = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            masks.append(mask)
            row += n
        out = self._finish(q, residual, sizes, keys, values, masks)
        ends = torch.tensor(sizes, device=self.device).cumsum(0) - 1
        return out[ends]

    def _append(self, seq: _Sequence, k: torch.Tensor, v: torch.Tensor) -> None:
        need = seq.length + k.shape[0]
        if need > seq.keys.shape[0]:
            size = max(need, 2 * seq.keys.shape[0])
            for name in ("keys", "values"):
                old = getattr(seq, name)
                grown = old.new_empty((size, *old.shape[1:]))
                grown[: seq.length] = old[: seq.length]
                setattr(seq, name, grown)
        seq.keys[seq.length: need] = k
        seq.values[seq.length: need] = v
        seq.length = need

    def _grow(self, requests: list[Request], roots: torch.Tensor, budgets: list[int],
              depths: list[int]) -> list[tuple[list[int], list[int]]]:
        """Per request, the best ``budget`` nodes of a tree at most ``depth`` deep: target token ids and
        parents (parents first). Every depth's expansions of all requests run through the head together."""
        head = self.head
        count = len(requests)
        top_ks = [min(self.top_k, n) for n in budgets]
        trees = [_Tree() for _ in range(count)]
        first = torch.log_softmax(head.logits(roots).float(), dim=-1).topk(max(top_ks))
        first_ids, first_lp = first.indices.tolist(), first.values.tolist()
        for i in range(count):
            trees[i].add(first_ids[i][: top_ks[i]], first_lp[i][: top_ks[i]], -1, 1, 0.0)
        outputs: list[dict[int, torch.Tensor]] = [{-1: roots[i]} for i in range(count)]
        expanded: list[list[int]] = [[] for _ in range(count)]  # nodes run through the head: rows of tree_k
        tree_k: list[list[torch.Tensor]] = [[] for _ in range(count)]
        tree_v: list[list[torch.Tensor]] = [[] for _ in range(count)]
        seqs = [self._seqs[r.request_id] for r in requests]
        roots_at = [r.num_tokens - 2 for r in requests]
        for depth in range(1, max(depths)):
            chosen = {i: self._frontier(trees[i], depth, top_ks[i], self._floor(trees[i], budgets[i]))
                      for i in range(count) if depth < depths[i]}
            growing = [i for i in chosen if chosen[i]]
            if not growing:
                break
            ids = [self.target_ids[trees[i].tokens[n]] for i in growing for n in chosen[i]]
            embeds = self.embed(torch.tensor(ids, device=self.device)).to(self.dtype)
            state = torch.stack([outputs[i][trees[i].parent[n]] for i in growing for n in chosen[i]])
            positions = [roots_at[i] + depth for i in growing for _ in chosen[i]]
            q, new_k, new_v, residual = self._qkv(embeds, state, positions)
            keys, values, masks, sizes = [], [], [], []
            row = 0
            for i in growing:
                rows, seq = len(chosen[i]), seqs[i]
                index = {node: j for j, node in enumerate(expanded[i])}
                # Each row sees the cache, its expanded ancestors and itself.
                mask = torch.zeros(rows, seq.length + len(expanded[i]) + rows, dtype=torch.bool, device=self.device)
                mask[:, : seq.length] = True
                for r, node in enumerate(chosen[i]):
                    parent = trees[i].parent[node]
                    while parent >= 0:
                        mask[r, seq.length + index[parent]] = True
                        parent = trees[i].parent[parent]
                    mask[r, seq.length + len(expanded[i]) + r] = True
                tree_k[i].append(new_k[row: row + rows])
                tree_v[i].append(new_v[row: row + rows])
                keys.append(torch.cat([seq.keys[: seq.length], *tree_k[i]]))
                values.append(torch.cat([seq.values[: seq.length], *tree_v[i]]))
                masks.append(mask)
                sizes.append(rows)
                expanded[i].extend(chosen[i])
                row += rows
            out = self._finish(q, residual, sizes, keys, values, masks)
            children = torch.log_softmax(head.logits(out).float(), dim=-1).topk(max(top_ks))
            child_ids, child_lp = children.indices.tolist(), children.values.tolist()
            row = 0
            for i in growing:
                for node in chosen[i]:
                    outputs[i][node] = out[row]
                    trees[i].add(child_ids[row][: top_ks[i]], child_lp[row][: top_ks[i]], node, depth + 1,
                                 trees[i].score[node])
                    row += 1
        return [self._best(tree, budget) for tree, budget in zip(trees, budgets, strict=True)]

    @staticmethod
    def _floor(tree: _Tree, budget: int) -> float:
        """The score a new node must beat to be among the ``budget`` kept: the budget-th best so far
        (-inf while the tree is smaller). A node's children score at most its own score, and ties go
        to the shallower node, so a candidate at or below the floor has no descendant the proposal
        could keep: expanding it would only cost a row of the head."""
        if len(tree.score) < budget:
            return float("-inf")
        return sorted(tree.score, reverse=True)[budget - 1]

    @staticmethod
    def _frontier(tree: _Tree, depth: int, top_k: int, floor: float = float("-inf")) -> list[int]:
        """The ``top_k`` best-scoring candidates at ``depth`` (EAGLE-2's expansion), less those at or
        below ``floor`` (``_floor``): the ones expanded. Dropping those changes no kept node, and the
        tree stops growing once none is left: a confident head drafts deep, an unsure one stops early."""
        level = [n for n, d in enumerate(tree.depth) if d == depth]
        return [n for n in sorted(level, key=lambda n: -tree.score[n])[:top_k] if tree.score[n] > floor]

    def _best(self, tree: _Tree, budget: int) -> tuple[list[int], list[int]]:
        # A child scores at most its parent, and ties go to the shallower node: the kept set is a tree.
        kept = sorted(range(len(tree.tokens)), key=lambda i: (-tree.score[i], tree.depth[i], i))[:budget]
        kept.sort(key=lambda i: (tree.depth[i], -tree.score[i], i))
        where = {node: j for j, node in enumerate(kept)}
        tokens = [self.target_ids[tree.tokens[i]] for i in kept]
        parents = [where[tree.parent[i]] if tree.parent[i] >= 0 else -1 for i in kept]
        return tokens, parents
