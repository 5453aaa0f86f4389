"""Medusa heads: extra decoding heads on the target's last hidden state, drafting a tree of guesses.

Head k (k = 0 .. K-1) reads the target's final hidden state h_t at the position whose logits give
the next token x_{t+1}, and predicts x_{t+k+2}: one residual SiLU block ``h + SiLU(W h + b)`` (W
starts at zero, so an untrained head is exactly the target's LM head) and a vocabulary projection
initialised from the target's ``lm_head``. The heads' top-s candidates fill a static
:class:`~infer.speculative.tree.CandidateTree`; the speculative runner verifies the whole tree in
one target pass. Acceptance is exact, so head quality only changes the speed, never the output.

On disk, beside the target by default (``<target>/medusa/``)::

    medusa_heads.safetensors   heads.{k}.blocks.{j}.linear.{weight,bias}, heads.{k}.lm_head.weight
    medusa_config.json         sizes, the tree size, and measured per-head rank accuracies
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.engine.request import Request
from infer.models.layers import PackedLinear, count_weights, cpu_packing_available
from infer.speculative.proposer import Proposal, Proposer
from infer.speculative.tree import CandidateTree, build_tree, default_rank_accuracy
from infer.speculative.tree_sizer import TreeSizer

if TYPE_CHECKING:
    from infer.engine.engine import Engine

HEADS_FILE = "medusa_heads.safetensors"
CONFIG_FILE = "medusa_config.json"
DEFAULT_TREE_SIZE = 32
DEFAULT_TOP_K = 8  # most candidates any head contributes to the default tree


@dataclass
class MedusaConfig:
    num_heads: int
    hidden_size: int
    vocab_size: int
    num_layers: int = 1  # residual blocks per head
    tree_size: int = DEFAULT_TREE_SIZE  # nodes of the candidate tree verified per round
    top_k: int = DEFAULT_TOP_K
    # rank_accuracy[k][r]: measured P(head k's rank-r candidate is the target's token); shapes the tree.
    rank_accuracy: list[list[float]] | None = None
    target: str | None = None  # what the heads were trained for (informational)
    training: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("num_heads", "hidden_size", "vocab_size", "num_layers", "tree_size", "top_k"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"medusa config: {name}={getattr(self, name)} must be >= 1")
        if self.rank_accuracy is not None and len(self.rank_accuracy) < self.num_heads:
            raise ValueError(f"medusa config: rank_accuracy covers {len(self.rank_accuracy)} heads, "
                             f"need {self.num_heads}")

    def tree(self, tree_size: int | None = None) -> CandidateTree:
        """The static candidate tree these heads draft into."""
        accuracy = self.rank_accuracy or default_rank_accuracy(self.num_heads, self.top_k)
        rows = [list(accuracy[k][: self.top_k]) for k in range(self.num_heads)]
        return build_tree(rows, tree_size or self.tree_size)

    @classmethod
    def from_file(cls, path: Path) -> MedusaConfig:
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: cannot read the Medusa config ({err})") from None
        known = {f for f in cls.__dataclass_fields__}
        try:
            return cls(**{k: v for k, v in raw.items() if k in known})
        except TypeError as err:
            raise ValueError(f"{path}: invalid Medusa config ({err})") from None


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))`` with a zero-initialised linear: starts as the identity."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            hidden = block(hidden)
        return self.lm_head(hidden)


class MedusaHeads(nn.Module):
    """K heads; ``forward(hidden[..., H]) -> logits[..., K, V]``."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.heads = nn.ModuleList(
            MedusaHead(config.hidden_size, config.vocab_size, config.num_layers) for _ in range(config.num_heads)
        )

    @classmethod
    def from_target(cls, lm_head_weight: torch.Tensor, num_heads: int, num_layers: int = 1,
                    **config: Any) -> MedusaHeads:
        """Fresh heads whose projections start as copies of the target's LM head ([V, H])."""
        vocab, hidden = lm_head_weight.shape
        heads = cls(MedusaConfig(num_heads=num_heads, hidden_size=hidden, vocab_size=vocab, num_layers=num_layers,
                                 **config))
        heads.to(device=lm_head_weight.device, dtype=lm_head_weight.dtype)
        with torch.no_grad():
            for head in heads.heads:
                assert isinstance(head, MedusaHead)
                head.lm_head.weight.copy_(lm_head_weight)
        return heads

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.stack([head(hidden) for head in self.heads], dim=-2)

    def head_logits(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.heads[k](hidden)  # type: ignore[no-any-return]

    def fused(self) -> FusedHeads:
        """An inference-only copy that runs all heads as a few batched matmuls (fewer kernel launches)."""
        return FusedHeads(self)

    # -- files -----------------------------------------------------------------------------------
    def write_files(self, folder: str | os.PathLike[str]) -> None:
        """Write the weights and the config into an existing ``folder`` (not atomic; see ``save``)."""
        from safetensors.torch import save_file

        out = Path(folder)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / HEADS_FILE), metadata={"format": "pt"})
        (out / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write the two files to ``folder`` atomically: a hidden sibling folder renamed into place."""
        out = Path(folder)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
        try:
            self.write_files(tmp)
            old = None
            if out.exists():
                old = out.parent / f".{out.name}.old-{os.getpid()}"
                os.replace(out, old)
            os.replace(tmp, out)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out

    @classmethod
    def load(cls, folder: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
             device: str | torch.device = "cpu") -> MedusaHeads:
        from safetensors.torch import load_file

        path = Path(folder)
        weights, cfg = path / HEADS_FILE, path / CONFIG_FILE
        for needed in (weights, cfg):
            if not needed.is_file():
                raise FileNotFoundError(f"{needed} not found")
        config = MedusaConfig.from_file(cfg)
        heads = cls(config)
        try:
            state = load_file(str(weights))
        except Exception as err:  # safetensors raises its own error types for a bad file
            raise ValueError(f"{weights}: cannot read ({err})") from None
        try:
            heads.load_state_dict(state)
        except RuntimeError as err:
            raise ValueError(f"{weights}: does not match {cfg.name} ({err})") from None
        return heads.to(device=device, dtype=dtype).eval()


class FusedHeads:
    """All K heads' weights stacked: per block ``[K, H, H]`` + ``[K, H]``, projections ``[K, V, H]``.

    ``__call__(hidden[A, H]) -> logits[A, K, V]``, the same function as ``MedusaHeads.forward`` in
    1 + 2 * num_layers batched matmuls instead of K * (1 + num_layers) small ones. Heads trained
    with a frozen projection all hold the target's LM head: it is then kept once and applied to
    the K heads' states in one matmul, so drafting reads V x H weights once instead of K times.
    In bfloat16 on CPU the projections are pre-packed for oneDNN, as the target's are.
    """

    def __init__(self, heads: MedusaHeads) -> None:
        modules = [h for h in heads.heads if isinstance(h, MedusaHead)]
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for j in range(heads.config.num_layers):
                linears = [m.blocks[j].linear for m in modules]
                weight = torch.stack([lin.weight.transpose(0, 1) for lin in linears if isinstance(lin, nn.Linear)])
                bias = torch.stack([lin.bias for lin in linears if isinstance(lin, nn.Linear)])
                self.blocks.append((weight.contiguous(), bias.unsqueeze(1).contiguous()))
            projections = [m.lm_head.weight for m in modules]
            self.shared_projection = all(torch.equal(w, projections[0]) for w in projections[1:])
        self.num_heads = len(modules)
        self.dtype = projections[0].dtype
        distinct = modules[:1] if self.shared_projection else modules
        # Either pre-packed projections (CPU bfloat16) or one stacked tensor, never both copies.
        self.packed: list[PackedLinear] | None = None
        self.projection: torch.Tensor | None = None
        if projections[0].device.type == "cpu" and self.dtype == torch.bfloat16 and cpu_packing_available():
            self.packed = [PackedLinear(m.lm_head) for m in distinct]
        else:
            with torch.no_grad():  # [K or 1, H, V]
                self.projection = torch.stack([m.lm_head.weight.transpose(0, 1) for m in distinct]).contiguous()

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.to(self.dtype).unsqueeze(0).expand(self.num_heads, -1, -1)  # [K, A, H]
        for weight, bias in self.blocks:
            x = x + F.silu(torch.baddbmm(bias, x, weight))
        if self.packed is not None:
            if len(self.packed) == 1:
                return self.packed[0](x.transpose(0, 1))  # type: ignore[no-any-return]
            return torch.stack([proj(x[k]) for k, proj in enumerate(self.packed)], dim=1)
        assert self.projection is not None
        if self.shared_projection:
            return x.transpose(0, 1) @ self.projection[0]  # [A, K, V]
        return torch.bmm(x, self.projection).transpose(0, 1)  # [A, K, V]


def default_heads_dir(target: str | os.PathLike[str]) -> Path:
    """Where ``infer train medusa`` writes and ``--speculator medusa`` looks: ``<target>/medusa``."""
    from infer.loader.hub import resolve_model_path

    try:
        return resolve_model_path(target) / "medusa"
    except Exception:  # an unresolvable target: report the literal path
        return Path(target) / "medusa"


class MedusaProposer(Proposer):
    """Drafts a tree per request from the target's last hidden state (handed over by the runner).

    ``max_tokens[b]`` caps the tree's depth (the policy's length, the request's remaining budget);
    its size is capped by the room left in the context, since verification writes every node.
    With ``adaptive`` a :class:`TreeSizer` picks how much of the tree (best nodes first) each round
    verifies, by measured tokens per second; otherwise every round verifies the whole tree.
    """

    name = "medusa"
    wants_hidden = True

    def __init__(self, heads: MedusaHeads, tree: CandidateTree, device: torch.device | str,
                 target_params: int | None = None, adaptive: bool = False) -> None:
        if tree.max_depth > heads.config.num_heads:
            raise ValueError(f"the candidate tree is {tree.max_depth} deep but there are only "
                             f"{heads.config.num_heads} heads")
        self.config = heads.config
        self.heads = heads.fused()
        self.tree = tree
        self.device = torch.device(device)
        self.max_verify_nodes = tree.size
        self.sizer = TreeSizer(tree.size) if adaptive else None
        self._hidden: dict[str, torch.Tensor] = {}
        self._subtrees: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._head_index = torch.tensor(tree.heads, device=self.device)
        self._rank_index = torch.tensor(tree.ranks, device=self.device)
        head_params = sum(p.numel() for p in heads.parameters())  # before the fused copy replaces them
        self._cost_hint = head_params / target_params if target_params else 0.0

    @property
    def relative_cost_hint(self) -> float:
        return self._cost_hint

    def observe_hidden(self, requests: list[Request], hidden: torch.Tensor) -> None:
        rows = hidden.detach().clone()  # small; frees the pass's activations
        for request, row in zip(requests, rows, strict=True):
            self._hidden[request.request_id] = row

    def release(self, request: Request) -> None:
        self._hidden.pop(request.request_id, None)

    def round_finished(self, num_tokens: int, seconds: float) -> None:
        if self.sizer is not None:
            self.sizer.observe(num_tokens, seconds)

    @torch.inference_mode()
    def propose(self, requests: list[Request], max_tokens: list[int]) -> Proposal:
        budget = self.sizer.choose() if self.sizer is not None else self.tree.size
        limits = []
        for request, depth in zip(requests, max_tokens, strict=True):
            room = min(budget, request.max_seq_len - request.num_tokens)  # nodes must fit in the context
            ready = request.request_id in self._hidden
            limits.append((min(depth, self.tree.max_depth), room) if ready and depth > 0 and room > 0 else (0, 0))
        active = [b for b, (d, _) in enumerate(limits) if d > 0]
        subtrees = [self._subtree(*limits[b]) for b in range(len(requests))]
        width = max((len(idx) for idx, _ in subtrees), default=0)
        tokens = torch.zeros(len(requests), width, dtype=torch.long, device=self.device)
        parents = torch.full((len(requests), width), -1, dtype=torch.long, device=self.device)
        counts = [len(idx) for idx, _ in subtrees]
        if active and width:
            hidden = torch.stack([self._hidden[requests[b].request_id] for b in active])
            logits = self.heads(hidden)  # [A, K, V]
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


def load_medusa_proposer(engine: Engine, max_draft: int) -> MedusaProposer:
    """Load the heads named by ``engine.config.medusa_heads`` (default ``<model>/medusa``)."""
    config = engine.config
    folder = Path(config.medusa_heads) if config.medusa_heads else default_heads_dir(config.model)
    if not (folder / HEADS_FILE).is_file() or not (folder / CONFIG_FILE).is_file():
        raise FileNotFoundError(
            f"no Medusa heads in {folder} (need {HEADS_FILE} and {CONFIG_FILE}): train them with "
            f"`infer train medusa --target {config.model}`"
            + ("" if config.medusa_heads else " or pass the folder as medusa_heads")
        )
    heads = MedusaHeads.load(folder, engine.dtype, engine.device)
    target = engine.model_config
    if (heads.config.hidden_size, heads.config.vocab_size) != (target.hidden_size, target.vocab_size):
        raise ValueError(
            f"Medusa heads in {folder} were made for hidden size {heads.config.hidden_size} and vocabulary "
            f"{heads.config.vocab_size}, but {config.model} has {target.hidden_size} and {target.vocab_size}: "
            f"retrain them with `infer train medusa --target {config.model}`"
        )
    # An explicit tree size is verified whole every round; by default the heads' tree is the largest
    # candidate and each round verifies the part of it that measures fastest.
    tree = heads.config.tree(config.medusa_tree_size or heads.config.tree_size)
    target_params = count_weights(engine.model)
    return MedusaProposer(heads, tree, engine.device, target_params, adaptive=config.medusa_tree_size is None)
