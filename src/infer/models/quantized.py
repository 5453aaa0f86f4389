"""Projections and embeddings whose weights stay in GGUF's quantized blocks.

A ``QuantLinear`` holds one or more quantized matrices (``QuantRows``: GGUF block rows, stored as
the file stores them) and multiplies activations by them with the quantized kernels handed in at
load (``infer.kernels.quant.QuantKernels``: they quantize the activations per block and use integer
dot products). It never expands a weight to float. A ``QuantEmbedding`` dequantizes only the rows
it looks up; a tied LM head multiplies by the embedding's own blocks.

Fusing (``Attention.fuse``, ``MLP.fuse``) concatenates the rows of matrices of one block type into
one matrix, copied once; a part of another type (Q4_K_M files store v and down in Q6_K) stays a
matrix of its own, multiplied by its own call, the outputs side by side.

The kernels compute an output row from its input row alone, in the same order whatever the number
of rows, so a quantized projection gives a token the same bits in a decode step and in any
verification pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

# A packed weight is whatever the kernels' ``pack`` returns (``infer.kernels.quant.QuantWeight``);
# the architectures do not import the kernels (the layering test enforces it), only this interface.
QuantWeight = Any


class QuantKernels(Protocol):
    """What a quantized module needs of the kernels it is handed (``infer.kernels.quant.QuantKernels``)."""

    def pack(self, raw: torch.Tensor, qtype: str, in_features: int) -> QuantWeight: ...

    def linear(self, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor: ...

    def dequantize_rows(self, weight: QuantWeight, ids: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class QuantRows:
    """A quantized matrix before packing: ``raw`` uint8 ``[rows, row_bytes]`` in GGUF's block layout
    (a view of the file's mapping where possible), and ``order``, the stored row each matrix row is
    (None: as stored; llama q/k rows are stored in GGML's RoPE order)."""

    qtype: str
    in_features: int
    raw: torch.Tensor
    order: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.raw.dtype != torch.uint8 or self.raw.dim() != 2:
            raise ValueError(f"quantized rows must be a 2-D uint8 tensor, got {self.raw.dtype} {tuple(self.raw.shape)}")
        if self.order is not None and tuple(self.order.shape) != (self.raw.shape[0],):
            raise ValueError(f"row order of shape {tuple(self.order.shape)} for {self.raw.shape[0]} rows")

    @property
    def rows(self) -> int:
        return int(self.raw.shape[0])

    def copy_into(self, out: torch.Tensor) -> None:
        """The matrix's rows, in use order, written into ``out`` (one copy, no temporary)."""
        if self.order is None:
            out.copy_(self.raw)
        else:
            torch.index_select(self.raw, 0, self.order, out=out)

    def materialized(self) -> torch.Tensor:
        """The rows in use order: ``raw`` itself where no reordering is needed (no copy)."""
        if self.order is None:
            return self.raw
        return self.raw.index_select(0, self.order)

    @staticmethod
    def concat(parts: Sequence[QuantRows]) -> QuantRows:
        """One matrix of ``parts``' rows one after another (same type and width); a single part is
        returned as it is."""
        if len(parts) == 1:
            return parts[0]
        first = parts[0]
        if any(p.qtype != first.qtype or p.in_features != first.in_features for p in parts):
            raise ValueError("only matrices of one block type and width concatenate")
        out = torch.empty(sum(p.rows for p in parts), first.raw.shape[1], dtype=torch.uint8)
        start = 0
        for part in parts:
            part.copy_into(out[start: start + part.rows])
            start += part.rows
        return QuantRows(first.qtype, first.in_features, out)


class QuantLinear(nn.Module):
    """``nn.Linear`` over quantized matrices: ``x [..., in] -> [..., out]`` (the parts' outputs side by
    side), computed by ``kernels`` in float32 and returned in ``x``'s dtype."""

    def __init__(self, parts: Sequence[QuantRows], bias: torch.Tensor | None, kernels: QuantKernels) -> None:
        super().__init__()
        if not parts or len({p.in_features for p in parts}) != 1:
            raise ValueError("a quantized linear needs one or more matrices of one input width")
        self.in_features = parts[0].in_features
        self.out_features = sum(p.rows for p in parts)
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise ValueError(f"bias of shape {tuple(bias.shape)} for {self.out_features} outputs")
        self.kernels = kernels
        self.parts: list[QuantRows] = list(parts)  # until packed
        self.weights: list[QuantWeight] = []
        # The kernels add a float32 bias; kept as a buffer (not a Parameter: nothing here trains).
        self.register_buffer("bias", None if bias is None else bias.detach().float().contiguous(), persistent=False)

    @classmethod
    def fused(cls, linears: Sequence[QuantLinear]) -> QuantLinear:
        """One module computing ``linears`` side by side: adjacent matrices of one block type become
        one matrix (their rows copied once), others stay separate calls."""
        if any(m.weights for m in linears):
            raise RuntimeError("quantized projections fuse before they are packed")
        groups: list[list[QuantRows]] = []
        for part in (p for m in linears for p in m.parts):
            if groups and groups[-1][-1].qtype == part.qtype:
                groups[-1].append(part)
            else:
                groups.append([part])
        biases = [m.bias for m in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError("fused projections must all have a bias or none")
        bias = None if biases[0] is None else torch.cat(biases)  # type: ignore[arg-type]
        return cls([QuantRows.concat(group) for group in groups], bias, linears[0].kernels)

    @classmethod
    def tied(cls, embedding: QuantEmbedding) -> QuantLinear:
        """An LM head multiplying by ``embedding``'s blocks (one copy of them, shared)."""
        head = cls([embedding.rows], None, embedding.kernels)
        head.parts, head.weights = [], [embedding.weight]
        return head

    def pack(self) -> None:
        """Hand the matrices to the kernels (``QuantKernels.pack``: the blocks repacked once into the
        kernels' layout); the rows in use order are made here if reordered."""
        if not self.weights:
            self.weights = [self.kernels.pack(p.materialized(), p.qtype, p.in_features) for p in self.parts]
            self.parts = []

    @property
    def weight_bytes(self) -> int:
        return sum(int(w.data.numel() * w.data.element_size()) for w in self.weights) + sum(
            p.raw.numel() for p in self.parts)

    @property
    def qtypes(self) -> list[str]:
        return [w.qtype for w in self.weights] or [p.qtype for p in self.parts]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.pack()
        flat = x.reshape(-1, self.in_features).float().contiguous()
        bias: torch.Tensor | None = self.bias  # type: ignore[assignment]
        if len(self.weights) == 1:
            out = self.kernels.linear(flat, self.weights[0], bias)
        else:
            outs, start = [], 0
            for weight in self.weights:
                end = start + weight.out_features
                outs.append(self.kernels.linear(flat, weight, None if bias is None else bias[start:end]))
                start = end
            out = torch.cat(outs, dim=-1)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, qtypes={self.qtypes}"


class QuantEmbedding(nn.Module):
    """Token embeddings in quantized blocks: a lookup dequantizes only the rows it reads, into ``dtype``."""

    def __init__(self, rows: QuantRows, kernels: QuantKernels, dtype: torch.dtype) -> None:
        super().__init__()
        self.rows = rows
        self.kernels = kernels
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = rows.rows, rows.in_features
        self.weight = kernels.pack(rows.materialized(), rows.qtype, rows.in_features)

    @property
    def weight_bytes(self) -> int:
        return int(self.weight.data.numel() * self.weight.data.element_size())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.kernels.dequantize_rows(self.weight, ids.reshape(-1))
        return out.view(*ids.shape, self.embedding_dim).to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.weight.qtype}"


def pack_quantized(model: nn.Module, after_each: Callable[[], None] | None = None) -> None:
    """Pack every quantized projection (after fusing): the blocks are laid out once, at load.
    ``after_each`` runs after each projection is packed (the loader hands back the file pages a
    repacking copy has just read, so a load never holds a weight twice)."""
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.pack()
            if after_each is not None:
                after_each()


def weight_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of quantized blocks, bytes of float parameters and buffers) resident for ``model``'s
    weights, each tensor counted once (a tied head shares the embedding's blocks)."""
    seen: set[int] = set()
    quantized = floating = 0
    for module in model.modules():
        blocks: list[torch.Tensor] = []
        if isinstance(module, QuantLinear):
            blocks = [w.data for w in module.weights] + [p.raw for p in module.parts]
        elif isinstance(module, QuantEmbedding):
            blocks = [module.weight.data]
        for tensor in blocks:
            if tensor.data_ptr() not in seen:
                seen.add(tensor.data_ptr())
                quantized += tensor.numel() * tensor.element_size()
        packed = getattr(module, "packed_weight", None)  # layers.PackedLinear: an opaque oneDNN tensor
        if isinstance(packed, torch.Tensor):
            floating += int(getattr(module, "weight_numel", 0)) * packed.element_size()
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.data_ptr() not in seen and tensor.device.type != "meta":
            seen.add(tensor.data_ptr())
            floating += tensor.numel() * tensor.element_size()
    return quantized, floating
