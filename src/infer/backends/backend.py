"""The execution backend: which code computes a model's forward pass, chosen once at load, with why.

* ``torch``: the PyTorch layers (on CPU with oneDNN pre-packed linears where torch has them, except
  in compiled mode: Inductor cannot lower packed weights, so the linears stay ``nn.Linear``; on CUDA
  with Triton, attention reads the paged cache in place: ``backends.triton_attention``);
* ``cpu-kernels``: the C kernels of ``infer.kernels`` (streaming products, the fused small
  operators and the whole decoder stack in one call), each part probed against the layers
  (``backends.cpu_kernels``).

The loader chooses one (``choose_backend``), lets it put the model in its form (``Backend.prepare``)
and records it on the model; every forward pass then goes through ``Backend.forward`` (the model
runner, CUDA graphs, the load-time checks), so the architectures in ``infer.models`` stay math.

``auto`` takes ``cpu-kernels`` where the CPU, the compiler and the probes allow and says why not
otherwise; ``--backend`` (``EngineConfig.backend``) forces one and refuses, naming the reason, one
this machine cannot run. The engine's modes ride on top and are recorded with the choice: compiled
(``--compile``), CUDA graphs, exact greedy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

import infer.kernels as kernels
from infer.backends import cpu_kernels, triton_attention
from infer.backends.cpu_kernels import (
    CpuStack,
    probe_fused,
    probe_gemma_stack,
    probe_quant_stack,
    probe_stack,
)
from infer.backends.onednn import PackedLinear, cpu_packing_available
from infer.cache.protocol import KVBatch
from infer.kernels.cpu import KernelLibrary
from infer.models.layers import Attention, AuxCapture, DecoderOnlyLM

# ``cpu-kernels:NAME`` forces kernel variant NAME in each kernel family that has one (the float
# kernels' ``build.VARIANTS``, the quantized kernels' ``build.QUANT_VARIANTS``; ``avx2`` is in both),
# the other family taking its best: how CI runs the AVX2 and portable kernels on an AVX-512 machine.
KERNEL_VARIANTS = tuple(dict.fromkeys([*kernels.build.VARIANT_NAMES, *(v.name for v in kernels.build.QUANT_VARIANTS)]))
BACKENDS = ("auto", "torch", "cpu-kernels", *(f"cpu-kernels:{name}" for name in KERNEL_VARIANTS))


def forced_variant(requested: str) -> str | None:
    """The kernel variant ``--backend cpu-kernels:NAME`` names (None for the other backends)."""
    return requested.split(":", 1)[1] if requested.startswith("cpu-kernels:") else None


@dataclass
class Backend:
    """What runs a model's forward pass and why (``describe`` is the startup line's text).

    One is chosen per loaded model: ``prepare`` gives that model the backend's form and ``forward``
    runs its passes (``cpu_stack`` is that model's decoder stack in C, where it runs).
    """

    name: str  # "torch" or "cpu-kernels"
    library: KernelLibrary | None = None  # cpu-kernels: the variant in use
    fused: bool = False  # RMSNorm, RoPE and SwiGLU's activation in C
    stack: bool = False  # the whole decoder stack in one C call
    onednn: bool = False  # torch on CPU: linears pre-packed for oneDNN
    paged_attention: bool = False  # torch on CUDA: attention by the Triton paged kernel (no per-layer gather)
    reasons: list[str] = field(default_factory=list)  # why a faster path was refused
    mode: str = "eager"  # set by the engine: eager, compiled, cuda-graphs, exact
    # The prepared model's decoder stack in one C call (None: layer by layer). Tests set None to
    # compare with the layers; exact-greedy mode lifts its row limit.
    cpu_stack: CpuStack | None = field(default=None, repr=False, compare=False)

    def prepare(self, model: DecoderOnlyLM) -> None:
        """Give ``model`` (loaded, fused) this backend's inference form, in place, and record the
        backend on it: the C kernels' modules and stack, oneDNN-packed linears, or nothing to do.
        Only plain ``nn.Linear`` projections are converted (another kind, e.g. a quantized linear,
        keeps its forward), so a new module kind needs no change here to run, only to run faster."""
        if self.library is not None or self.onednn:
            if not model.fused:
                raise RuntimeError("a CPU backend needs the fused inference layout (fuse_projections first)")
            if self.library is not None:
                cpu_kernels.prepare(model, self.library, self.fused)
            else:  # a packed LM head gets its own copy of a tied embedding
                cpu_kernels.convert_linears(model, PackedLinear)
        if self.paged_attention:
            for module in model.modules():
                if isinstance(module, Attention):
                    module.paged_attention = triton_attention.attend
        self.cpu_stack = CpuStack.build(model, self.library) if self.library is not None and self.stack else None
        if self.cpu_stack is not None and self.cpu_stack.table.gemma:
            assert self.library is not None
            # Gemma's block (its norms, GELU, windows) is probed only when a Gemma model loads.
            failure = probe_gemma_stack(self.library, self.cpu_stack.dtype)
            if failure is not None:
                self.cpu_stack, self.stack = None, False
                self.reasons.append(failure)
        if self.cpu_stack is not None and self.cpu_stack.quantized:
            assert self.library is not None and self.cpu_stack.table.quant is not None
            kernels = next(q.kernels for q in self.cpu_stack.table.quant if q is not None)
            failure = probe_quant_stack(self.library, kernels)
            if failure is not None:
                self.cpu_stack, self.stack = None, False
                self.reasons.append(failure)
        model.backend = self

    def forward(self, model: DecoderOnlyLM, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                kv: KVBatch | None = None, aux: AuxCapture | None = None) -> torch.Tensor:
        """``model``'s final hidden states [B, T, hidden] for ``input_ids`` [B, T] at ``positions`` over
        ``kv``: the one way every pass is run (``model(...)`` alone runs the layers, never the stack).
        ``aux`` keeps the inputs of some layers on the way (the stack then runs in segments)."""
        if self.cpu_stack is None or kv is None:
            if aux is None:
                return model(input_ids, positions, kv)  # type: ignore[no-any-return]
            return model(input_ids, positions, kv, aux)  # type: ignore[no-any-return]
        return self.cpu_stack.forward(model, input_ids, positions, kv, aux)

    @property
    def variant(self) -> str:
        return "" if self.library is None else self.library.variant.name

    def detail(self) -> str:
        if self.library is not None:
            threads = torch.get_num_threads()
            parts = [self.library.variant.description, *(["fused operators"] if self.fused else []),
                     *(["decoder stack"] if self.stack else []),
                     f"{threads} threads, or 1 per kind of pass where that measures faster (shared cores)"
                     if threads > 1 else "1 thread"]
            return ", ".join(parts)
        if self.paged_attention:
            return "PyTorch operators, Triton paged attention"
        return "oneDNN-packed linears" if self.onednn else "PyTorch operators"

    def describe(self) -> str:
        """One line: ``backend cpu-kernels (AVX-512 float32 kernels, ...; avx512-bf16: CPU lacks avx512_bf16)``."""
        mode = "" if self.mode == "eager" else f", {self.mode} mode"
        why = f"; {'; '.join(self.reasons)}" if self.reasons else ""
        return f"backend {self.name} ({self.detail()}{mode}{why})"

    def info(self) -> dict[str, Any]:
        """The choice as a JSON-able record (``infer bench``'s environment, the server's metric)."""
        return {"backend": self.name, "variant": self.variant, "mode": self.mode, "detail": self.detail(),
                "reason": "; ".join(self.reasons)}


def choose_backend(device: torch.device | str, dtype: torch.dtype, requested: str = "auto",
                   compile: bool = False) -> Backend:
    """The backend for a model in ``dtype`` on ``device``. ``requested`` is ``auto`` or a name from
    ``BACKENDS``; one this machine cannot run raises ValueError with the reason."""
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is invalid: use {', '.join(BACKENDS)}")
    device = torch.device(device)
    mode = "compiled" if compile else "eager"
    forced = requested.startswith("cpu-kernels")
    variant = forced_variant(requested)
    if device.type != "cpu":
        if forced:
            raise ValueError(f"backend {requested!r} runs on the CPU; this model runs on {device}")
        unavailable = triton_attention.unavailable_reason(device)
        if unavailable is None and compile:
            unavailable = "compiled mode keeps SDPA attention (the compiler does not trace the Triton kernel)"
        return Backend("torch", mode=mode, paged_attention=unavailable is None,
                       reasons=[] if unavailable is None else [f"paged attention: {unavailable}"])
    reasons = []
    if requested == "torch":
        reasons.append("forced by --backend torch")
    else:
        if variant is not None and variant in kernels.build.VARIANT_NAMES:
            try:
                library: KernelLibrary | None = kernels.named_library(variant)
            except kernels.KernelUnavailable as err:
                raise ValueError(f"backend {requested!r} cannot run on this machine: {err}") from None
            assert library is not None
            if dtype not in library.dtypes:
                raise ValueError(f"backend {requested!r} has no {dtype} kernels (use --dtype float32)")
            refused = [f"kernel variant {variant} forced by --backend"]
        else:
            library = kernels.library_for(dtype)
            refused = list(kernels.selection().refused)
        if library is None:
            reason = kernels.unavailable_reason(dtype)
            if requested == "cpu-kernels":
                raise ValueError(f"backend 'cpu-kernels' cannot run {dtype} on this machine: {reason}")
            reasons.append(reason)
        else:
            # Compiled mode traces the layers (the compiler fuses their operators): no stack to probe.
            fused_failure = probe_fused(library, dtype)
            stack_failure = None if compile else probe_stack(library, dtype)
            for failure in (fused_failure, stack_failure):
                if failure is not None:
                    refused.append(failure)
            return Backend("cpu-kernels", library, fused=fused_failure is None,
                           stack=fused_failure is None and stack_failure is None and not compile,
                           reasons=refused, mode=mode)
    onednn = cpu_packing_available(dtype) and not compile
    if compile and cpu_packing_available(dtype):
        reasons.append("compiled mode keeps nn.Linear (Inductor cannot lower oneDNN-packed weights)")
    return Backend("torch", onednn=onednn, reasons=reasons, mode=mode)


def backend_of(model: DecoderOnlyLM) -> Backend:
    """The backend that prepared ``model`` (the loader's choice), or the plain PyTorch layers for a
    model built without the loader (training, tests)."""
    backend = model.backend
    if isinstance(backend, Backend):
        return backend
    return Backend("torch", reasons=["not prepared by a backend (built without the loader)"])
