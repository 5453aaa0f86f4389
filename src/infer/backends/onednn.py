"""The torch backend on CPU: linears whose weights are pre-packed once for oneDNN (``PackedLinear``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# Packing hint (the row count oneDNN lays the weight out for). bfloat16 is blocked for any hint;
# float32 with a hint of 1 keeps the plain layout and an AVX2 kernel, slower than the blocked
# AVX-512 one (docs/cpu.md, "Measurements behind the kernels' constants").
_PACK_HINT = {torch.bfloat16: 1, torch.float32: 16}


@functools.cache
def cpu_packing_available(dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether this torch build can pre-pack ``dtype`` weights for oneDNN and gets the same products.

    The two operators are the ones torch.compile's CPU backend uses for frozen linears; they are
    internal, so they are probed once (present, and matching ``F.linear`` on a small case) rather
    than trusted.
    """
    ops = torch.ops.mkldnn
    if dtype not in _PACK_HINT or not (torch.backends.mkldnn.is_available()
                                       and hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(48, 32, generator=gen).to(dtype)
        x = torch.randn(2, 3, 32, generator=gen).to(dtype)
        packed = ops._linear_pointwise(x, ops._reorder_linear_weight(weight, _PACK_HINT[dtype]), None, "none", [], "")
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        return bool(torch.allclose(packed.float(), F.linear(x, weight).float(), rtol=tol, atol=tol))
    except (RuntimeError, NotImplementedError):
        return False


class PackedLinear(nn.Module):
    """``nn.Linear`` for CPU inference (bfloat16 or float32) with the weight pre-packed in oneDNN's
    blocked layout.

    Decoding multiplies a handful of rows by each weight; with the weight laid out for the CPU's
    vector instructions once, those products run faster in bfloat16 than ``F.linear`` re-laying it
    out on every call. In float32 ``F.linear`` goes to MKL, whose sgemm takes a slow generic path on
    AMD CPUs (docs/cpu.md, "Measurements behind the kernels' constants"). The packed tensor is opaque: it
    cannot be saved, trained or moved, so only a backend preparing a loaded model
    (``Backend.prepare``) creates these.
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_numel = linear.weight.numel()
        weight = linear.weight.detach()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_HINT[weight.dtype])
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")  # type: ignore[no-any-return]


def count_weights(model: nn.Module) -> int:
    """Parameters, counting pre-packed linear weights (which are not ``nn.Parameter``s) too."""
    packed = sum(m.weight_numel for m in model.modules() if isinstance(m, PackedLinear))
    return packed + sum(p.numel() for p in model.parameters())


def projection_packer(weight: torch.Tensor) -> Callable[[nn.Linear], nn.Module] | None:
    """How Medusa's vocabulary projections (``MedusaHeads.fused``) run beside a target whose weights
    look like ``weight``: pre-packed for oneDNN in bfloat16 on CPU (as the target's are), else None
    (one stacked tensor)."""
    if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and cpu_packing_available():
        return PackedLinear
    return None
