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

The tree is verified by the engine's tree path (``speculative.tree.verify_tree``) with one-hot
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


def default_head_dir(target: str | os.PathLike[str]) -> Path:
    """Where ``infer train eagle`` writes and ``--speculator eagle`` looks by default: ``eagle/`` in the
    target's drafters folder (``~/.cache/infer/drafters/<model>/eagle`` for a GGUF or built-in model)."""
    from infer.loader.hub import drafters_dir

    try:
        return drafters_dir(target) / "eagle"
    except Exception:  # an unresolvable target: report the literal path
        return Path(target) / "eagle"


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
    pending: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (first position, states [n, aux])

    def observed_to(self) -> int:
        return self.pending[-1][0] + self.pending[-1][1].shape[0] if self.pending else self.fed_to


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
                 max_nodes: int, max_depth: int, cost_hint: float, top_k: int = DEFAULT_TOP_K) -> None:
        if head.config.aux_layers is None:
            raise ValueError("the head's aux layers must be resolved against the target (load_eagle_head)")
        self.head = head
        self.embed = head.embed_tokens if head.embed_tokens is not None else embed
        self.device = torch.device(device)
        self.max_depth, self.top_k = max_depth, top_k
        self.dtype = head.lm_head.weight.dtype
        self.target_ids = head.target_ids.tolist()
        self.info = DrafterInfo(tree=True, max_nodes=max_nodes, aux_layers=tuple(head.config.aux_layers),
                                cost_hint=cost_hint)
        self._seqs: dict[str, _Sequence] = {}

    # -- state from the runner -------------------------------------------------------------------
    def observe_states(self, request: Request, position: int, states: torch.Tensor) -> None:
        seq = self._seqs.get(request.request_id)
        if seq is None:
            config = self.head.config
            shape = (64, config.num_key_value_heads, config.head_dim)
            seq = self._seqs[request.request_id] = _Sequence(torch.empty(shape, dtype=self.dtype, device=self.device),
                                                             torch.empty(shape, dtype=self.dtype, device=self.device))
        skip = seq.observed_to() - position  # a retried pass repeats positions already held
        if skip < states.shape[0]:
            seq.pending.append((position + max(skip, 0), states[max(skip, 0):].detach().to(self.dtype)))

    def release(self, request: Request) -> None:
        self._seqs.pop(request.request_id, None)

    # -- drafting ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[Request], budgets: list[int], hidden_states: torch.Tensor | None) -> Proposal:
        trees: list[tuple[list[int], list[int]]] = []
        for request, budget in zip(requests, budgets, strict=True):
            depth = min(self.max_depth, request.tokens_left)
            root = self._catch_up(request) if budget > 0 and depth > 0 else None
            trees.append(([], []) if root is None else self._grow(request, root, budget, depth))
        width = max((len(tokens) for tokens, _ in trees), default=0)
        tokens = torch.zeros(len(requests), width, dtype=torch.long)
        parents = torch.full((len(requests), width), -1, dtype=torch.long)
        for b, (node_tokens, node_parents) in enumerate(trees):
            if node_tokens:
                tokens[b, : len(node_tokens)] = torch.tensor(node_tokens)
                parents[b, : len(node_parents)] = torch.tensor(node_parents)
        return Proposal(tokens.to(self.device), [len(t) for t, _ in trees], None, parents.to(self.device))

    def _catch_up(self, request: Request) -> torch.Tensor | None:
        """Feed the pairs the head has not seen; the root's output [hidden], or None without the state
        of the position before the newest token (its round is then a plain step)."""
        seq = self._seqs.get(request.request_id)
        ids = request.all_token_ids
        root = len(ids) - 2  # the pair (state at root, newest token g)
        if seq is None or root < 0 or seq.observed_to() != root + 1 or not seq.pending:
            return None
        positions: list[int] = []
        chunks: list[torch.Tensor] = []
        for start, states in seq.pending:
            positions.extend(range(start, start + states.shape[0]))
            chunks.append(states)
        seq.pending.clear()
        seq.fed_to = root + 1
        head = self.head
        state = head.fc(torch.cat(chunks).unsqueeze(0))  # [1, T, hidden]
        embeds = self.embed(torch.tensor([ids[p + 1] for p in positions], device=self.device).unsqueeze(0)).to(self.dtype)
        pos = torch.tensor(positions, device=self.device).unsqueeze(0)
        cos, sin = head.rope(pos, self.dtype)
        q, k, v, residual = head.midlayer.qkv(embeds, state, cos, sin)
        new = len(positions)
        self._append(seq, k[0], v[0])
        keys, values = seq.keys[: seq.length].unsqueeze(0), seq.values[: seq.length].unsqueeze(0)
        mask = torch.ones(new, seq.length, dtype=torch.bool, device=self.device)
        mask[:, seq.length - new:] = torch.ones(new, new, dtype=torch.bool, device=self.device).tril()
        out = head.midlayer.finish(residual, attend(q, keys, values, mask.unsqueeze(0)))
        return out[0, -1]

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

    def _grow(self, request: Request, root_out: torch.Tensor, budget: int, max_depth: int) -> tuple[list[int], list[int]]:
        """The best ``budget`` nodes of a tree at most ``max_depth`` deep: target token ids and parents
        (parents first)."""
        head, seq = self.head, self._seqs[request.request_id]
        top_k = min(self.top_k, budget)
        tree = _Tree()
        first = torch.log_softmax(head.logits(root_out).float(), dim=-1).topk(top_k)
        tree.add(first.indices.tolist(), first.values.tolist(), -1, 1, 0.0)
        outputs: dict[int, torch.Tensor] = {-1: root_out}
        expanded: list[int] = []  # nodes run through the head, in order: their keys are tree_keys' rows
        tree_keys: list[torch.Tensor] = []
        tree_values: list[torch.Tensor] = []
        root_position = len(request.all_token_ids) - 2
        context_k, context_v = seq.keys[: seq.length], seq.values[: seq.length]
        for depth in range(1, max_depth):
            level = [i for i, d in enumerate(tree.depth) if d == depth]
            chosen = sorted(level, key=lambda i: -tree.score[i])[:top_k]
            rows = len(chosen)
            ids = [self.target_ids[tree.tokens[i]] for i in chosen]
            embeds = self.embed(torch.tensor(ids, device=self.device).unsqueeze(0)).to(self.dtype)
            state = torch.stack([outputs[tree.parent[i]] for i in chosen]).unsqueeze(0)
            pos = torch.full((1, rows), root_position + depth, device=self.device)
            cos, sin = head.rope(pos, self.dtype)
            q, k, v, residual = head.midlayer.qkv(embeds, state, cos, sin)
            # Each row sees the cache, its expanded ancestors and itself.
            index = {node: j for j, node in enumerate(expanded)}
            mask = torch.zeros(rows, seq.length + len(expanded) + rows, dtype=torch.bool, device=self.device)
            mask[:, : seq.length] = True
            for r, node in enumerate(chosen):
                parent = tree.parent[node]
                while parent >= 0:
                    mask[r, seq.length + index[parent]] = True
                    parent = tree.parent[parent]
                mask[r, seq.length + len(expanded) + r] = True
            keys = torch.cat([context_k, *tree_keys, k[0]]).unsqueeze(0)
            values = torch.cat([context_v, *tree_values, v[0]]).unsqueeze(0)
            out = head.midlayer.finish(residual, attend(q, keys, values, mask.unsqueeze(0)))[0]
            tree_keys.append(k[0])
            tree_values.append(v[0])
            expanded.extend(chosen)
            children = torch.log_softmax(head.logits(out).float(), dim=-1).topk(top_k)
            for r, node in enumerate(chosen):
                outputs[node] = out[r]
                tree.add(children.indices[r].tolist(), children.values[r].tolist(), node, depth + 1, tree.score[node])
        # A child scores at most its parent, and ties go to the shallower node: the kept set is a tree.
        kept = sorted(range(len(tree.tokens)), key=lambda i: (-tree.score[i], tree.depth[i], i))[:budget]
        kept.sort(key=lambda i: (tree.depth[i], -tree.score[i], i))
        where = {node: j for j, node in enumerate(kept)}
        tokens = [self.target_ids[tree.tokens[i]] for i in kept]
        parents = [where[tree.parent[i]] if tree.parent[i] >= 0 else -1 for i in kept]
        return tokens, parents
