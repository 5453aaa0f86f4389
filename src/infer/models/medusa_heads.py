"""Medusa heads: extra decoding heads on the target's last hidden state (Cai et al. 2024).

Head k (k = 0 .. K-1) reads the target's final hidden state h_t at the position whose logits give
the next token x_{t+1}, and predicts x_{t+k+2}: one residual SiLU block ``h + SiLU(W h + b)`` (W
starts at zero, so an untrained head is exactly the target's LM head) and a vocabulary projection
initialised from the target's ``lm_head``. ``infer.speculative.medusa`` drafts a candidate tree
from them; ``infer.train.medusa`` trains them.

On disk, beside the target by default (``<target>/medusa/``)::

    medusa_heads.safetensors   heads.{k}.blocks.{j}.linear.{weight,bias}, heads.{k}.lm_head.weight
    medusa_config.json         sizes, the tree size, and measured per-head rank accuracies
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.fileio import publish_folder, staging_folder

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

    def fused(self, pack: Callable[[nn.Linear], nn.Module] | None = None) -> FusedHeads:
        """An inference-only copy that runs all heads as a few batched matmuls (fewer kernel launches);
        ``pack`` gives the vocabulary projections an execution backend's form (``FusedHeads``)."""
        return FusedHeads(self, pack)

    # -- files -----------------------------------------------------------------------------------
    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write the weights and the config to ``folder`` atomically (a hidden sibling renamed into place)."""
        from safetensors.torch import save_file

        out = Path(folder)
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in self.state_dict().items()}
        with staging_folder(out) as tmp:
            save_file(tensors, str(tmp / HEADS_FILE), metadata={"format": "pt"})
            (tmp / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=2) + "\n")
            publish_folder(tmp, out)
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
    """All K heads' weights stacked in their linears' own layout: per block ``[K, H, H]`` (out, in)
    + ``[K, H]``, projections ``[K, V, H]``.

    ``__call__(hidden[A, H]) -> logits[A, K, V]``, the same function as ``MedusaHeads.forward`` in
    one batched matmul per block layer and one product per distinct projection instead of
    K * (1 + num_layers) small ones. Heads trained
    with a frozen projection all hold the target's LM head: it is then kept once and applied to
    the K heads' states in one matmul, so drafting reads V x H weights once instead of K times.
    ``pack`` turns each vocabulary projection into the module that runs it (the backend's form, e.g.
    ``backends.onednn.PackedLinear`` in bfloat16 on CPU, as the target's are); None keeps one stacked
    tensor, applied as ``F.linear`` applies a weight (a product with a transposed copy of it takes
    a far slower kernel in bfloat16 on CPUs without AVX-512 BF16, where nothing is packed).
    """

    def __init__(self, heads: MedusaHeads, pack: Callable[[nn.Linear], nn.Module] | None = None) -> None:
        modules = [h for h in heads.heads if isinstance(h, MedusaHead)]
        self.blocks: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for j in range(heads.config.num_layers):
                linears = [m.blocks[j].linear for m in modules]
                weight = torch.stack([lin.weight for lin in linears if isinstance(lin, nn.Linear)])
                bias = torch.stack([lin.bias for lin in linears if isinstance(lin, nn.Linear)])
                self.blocks.append((weight.contiguous(), bias.unsqueeze(1).contiguous()))
            projections = [m.lm_head.weight for m in modules]
            self.shared_projection = all(torch.equal(w, projections[0]) for w in projections[1:])
        self.num_heads = len(modules)
        self.dtype = projections[0].dtype
        distinct = modules[:1] if self.shared_projection else modules
        # Either the backend's projection modules or one stacked tensor, never both copies.
        self.packed: list[nn.Module] | None = None
        self.projection: torch.Tensor | None = None
        if pack is not None:
            self.packed = [pack(m.lm_head) for m in distinct]
        else:
            with torch.no_grad():  # [K or 1, V, H]
                self.projection = torch.stack([m.lm_head.weight for m in distinct]).contiguous()

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.to(self.dtype).unsqueeze(0).expand(self.num_heads, -1, -1)  # [K, A, H]
        for weight, bias in self.blocks:
            x = x + F.silu(torch.baddbmm(bias, x, weight.transpose(1, 2)))
        if self.packed is not None:
            if len(self.packed) == 1:
                return self.packed[0](x.transpose(0, 1))  # type: ignore[no-any-return]
            return torch.stack([proj(x[k]) for k, proj in enumerate(self.packed)], dim=1)
        assert self.projection is not None
        if self.shared_projection:  # one product of every head's rows: [A * K, H] -> [A, K, V]
            rows = x.transpose(0, 1).reshape(-1, x.shape[-1])
            return F.linear(rows, self.projection[0]).view(x.shape[1], self.num_heads, -1)
        return torch.stack([F.linear(x[k], self.projection[k]) for k in range(self.num_heads)], dim=1)  # [A, K, V]
