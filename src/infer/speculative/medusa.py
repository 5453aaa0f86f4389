"""Medusa drafting: the heads' top candidates fill a static candidate tree, verified in one pass.

The heads themselves (``infer.models.medusa_heads``) read the target's last hidden state, which
the runner passes to ``propose``. Each round fills the best ``budget`` nodes of the tree
(:class:`~infer.speculative.tree.CandidateTree`, best first) with the heads' current top-s tokens;
acceptance is exact, so head quality only changes the speed, never the output.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from infer.core.request import Request
from infer.models.config import ModelConfig
from infer.models.medusa_heads import CONFIG_FILE, HEADS_FILE, MedusaConfig, MedusaHeads
from infer.speculative.drafter import Drafter, DrafterInfo, Proposal
from infer.speculative.tree import CandidateTree, build_tree, default_rank_accuracy


def medusa_tree(config: MedusaConfig, tree_size: int | None = None) -> CandidateTree:
    """The static candidate tree heads with this config draft into (``tree_size`` nodes, default the config's)."""
    accuracy = config.rank_accuracy or default_rank_accuracy(config.num_heads, config.top_k)
    rows = [list(accuracy[k][: config.top_k]) for k in range(config.num_heads)]
    return build_tree(rows, tree_size or config.tree_size)


def default_heads_dir(target: str | os.PathLike[str]) -> Path:
    """Where ``infer train medusa`` writes and ``--speculator medusa`` looks by default: ``medusa/`` in
    the target's drafters folder (a model folder itself; ``~/.cache/infer/drafters/<model>`` for a GGUF)."""
    from infer.loader.hub import drafter_dir

    return drafter_dir(target, "medusa")


def load_medusa_heads(folder: str | None, target: str, target_config: ModelConfig, dtype: torch.dtype,
                      device: torch.device) -> MedusaHeads:
    """The heads in ``folder`` (None: ``<target>/medusa``), checked against the target's sizes."""
    path = Path(folder) if folder else default_heads_dir(target)
    if not (path / HEADS_FILE).is_file() or not (path / CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"no Medusa heads in {path} (need {HEADS_FILE} and {CONFIG_FILE}): train them with "
            f"`infer train medusa --target {target}`" + ("" if folder else " or pass the folder as medusa_heads")
        )
    heads = MedusaHeads.load(path, dtype, device)
    sizes = (heads.config.hidden_size, heads.config.vocab_size)
    if sizes != (target_config.hidden_size, target_config.vocab_size):
        raise ValueError(
            f"Medusa heads in {path} were made for hidden size {sizes[0]} and vocabulary {sizes[1]}, but "
            f"{target} has {target_config.hidden_size} and {target_config.vocab_size}: "
            f"retrain them with `infer train medusa --target {target}`"
        )
    return heads


class MedusaDrafter(Drafter):
    """Drafts the best ``budgets[b]`` nodes of ``tree`` per request from the target's hidden state.

    A path never goes deeper than ``max_depth`` or than the tokens the request may still emit.
    """

    def __init__(self, heads: MedusaHeads, tree: CandidateTree, device: torch.device | str, cost_hint: float,
                 max_depth: int, packer: Callable[[nn.Linear], nn.Module] | None = None) -> None:
        if tree.max_depth > heads.config.num_heads:
            raise ValueError(f"the candidate tree is {tree.max_depth} deep but there are only "
                             f"{heads.config.num_heads} heads")
        self.heads = heads.fused(packer)  # the projections' form: the target's backend decides (head_packer)
        self.tree = tree
        self.device = torch.device(device)
        self.max_depth = max_depth
        self.info = DrafterInfo(tree=True, max_draft_tokens=tree.size, uses_hidden_states=True, cost_hint=cost_hint)
        self._subtrees: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._head_index = torch.tensor(tree.heads, device=self.device)
        self._rank_index = torch.tensor(tree.ranks, device=self.device)

    @torch.inference_mode()
    def propose(self, requests: list[Request], budgets: list[int], hidden_states: torch.Tensor | None) -> Proposal:
        assert hidden_states is not None, "Medusa drafts from the target's hidden states"
        limits = [(min(self.max_depth, self.tree.max_depth, r.tokens_left), n) for r, n in zip(requests, budgets, strict=True)]
        limits = [(d, n) if d > 0 and n > 0 else (0, 0) for d, n in limits]
        active = [b for b, (d, _) in enumerate(limits) if d > 0]
        subtrees = [self._subtree(*limit) for limit in limits]
        width = max((len(idx) for idx, _ in subtrees), default=0)
        tokens = torch.zeros(len(requests), width, dtype=torch.long, device=self.device)
        parents = torch.full((len(requests), width), -1, dtype=torch.long, device=self.device)
        counts = [len(idx) for idx, _ in subtrees]
        if active and width:
            logits = self.heads(hidden_states[active])  # [A, K, V]
            top = logits.topk(self.tree.top_k, dim=-1).indices  # [A, K, s]
            filled = top[:, self._head_index, self._rank_index]  # [A, N]: each node's token
            for a, b in enumerate(active):
                idx, par = subtrees[b]
                tokens[b, : counts[b]] = filled[a, idx]
                parents[b, : counts[b]] = par
        return Proposal(tokens, counts, None, parents)

    def _subtree(self, max_depth: int, max_nodes: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Node indices of the full tree kept under the limits, and their parents re-indexed."""
        key = (max_depth, min(max_nodes, self.tree.size))
        cached = self._subtrees.get(key)
        if cached is None:
            idx = self.tree.subtree(*key)
            where = {node: i for i, node in enumerate(idx)}
            par = [where[self.tree.parents[n]] if self.tree.parents[n] >= 0 else -1 for n in idx]
            cached = (torch.tensor(idx, dtype=torch.long, device=self.device),
                      torch.tensor(par, dtype=torch.long, device=self.device))
            self._subtrees[key] = cached
        return cached
