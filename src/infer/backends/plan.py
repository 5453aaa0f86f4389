"""The execution plan: how a loaded model runs, decided once at load with the reason for each choice.

``loader.plan_load`` makes one from the options (``--dtype``, ``--backend``, ``--quantization``,
the modes) and the checkpoint; ``loader.load_model`` and ``core.ModelRunner`` read it and decide
nothing. It holds:

* the device and dtype, and why that dtype (``loader.choose_dtype``: a model whose weights stay in
  their blocks runs float32 activations under ``auto``, the kernels' input);
* whether linear weights stay quantized and on which kernels (``QuantChoice``, from
  ``choose_quant_kernels``), or why they are dequantized;
* the backend with its modes (exact greedy, compiled, CUDA graphs, how a tree's mask reaches
  attention) and why a faster path was refused (``Backend.reasons``);
* the layout: fused projections in the backend's form, or the Hugging Face layout for training and
  conversion (``fuse``; an unpacked load's backend says so in its reasons).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infer.backends.backend import Backend, forced_variant

if TYPE_CHECKING:
    from infer.kernels.quant import QuantKernels


@dataclass
class QuantChoice:
    """Whether quantized weights run on quantized kernels in this load, and why not."""

    quantization: str
    kernels: QuantKernels | None
    reason: str = ""  # why ``kernels`` is None
    note: str = ""  # why better variants this CPU has the flags for were refused (the OS's AMX permission...)

    @property
    def keeps_blocks(self) -> bool:
        return self.kernels is not None and self.quantization != "none"


def choose_quant_kernels(quantization: str, device: torch.device, backend: str) -> QuantChoice:
    """The quantized kernels for a load (``quantization`` as ``loader.quantized`` says, already
    checked; ``backend`` as ``--backend``). ``quantization`` of a block type with no kernels to run
    it, or ``--backend cpu-kernels`` where they cannot run, raises ValueError naming why; ``auto``
    falls back to float and says why."""
    if quantization == "none":
        return QuantChoice(quantization, None, "--quantization none")
    if device.type != "cpu":
        reason = f"the quantized kernels run on the CPU; this model runs on {device}"
    elif backend == "torch":
        reason = "--backend torch"
    else:
        from infer.kernels import quant
        from infer.kernels.build import QUANT_VARIANTS, KernelUnavailable

        variant = forced_variant(backend)
        if variant in {v.name for v in QUANT_VARIANTS}:  # --backend cpu-kernels:NAME: that variant or an error
            try:
                return QuantChoice(quantization, quant.quant_kernels(variant))
            except KernelUnavailable as err:
                raise ValueError(f"backend {backend!r} cannot run quantized weights on this machine: {err}") from None
        kernels = quant.quant_kernels()
        if kernels is not None:
            return QuantChoice(quantization, kernels, note=quant.quant_selection_note())
        reason = quant.quant_unavailable_reason()
        if backend.startswith("cpu-kernels"):
            raise ValueError(f"backend {backend!r} cannot run quantized weights on this machine: {reason}")
    if quantization != "auto":
        raise ValueError(f"quantization={quantization!r} needs the quantized kernels, which cannot run here: {reason}")
    return QuantChoice(quantization, None, reason)


@dataclass(frozen=True)
class ExecutionPlan:
    """How one model runs (see the module doc): made once by ``loader.plan_load``, read by the rest."""

    device: torch.device
    dtype: torch.dtype
    dtype_reason: str  # why this dtype ("as requested", "auto: ...")
    backend: Backend  # with its modes and the reasons a faster path was refused
    quant: QuantChoice  # whether weights stay in their blocks, on which kernels, or why not
    fuse: bool = True  # q/k/v and gate/up fused (False: the Hugging Face layout)
