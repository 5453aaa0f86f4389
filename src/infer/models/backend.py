"""The execution backend: which code computes a model's forward pass, chosen once at load, with why.

* ``torch``: the PyTorch layers (on CPU with oneDNN pre-packed linears where torch has them, except
  in compiled mode: Inductor cannot lower packed weights, so the linears stay ``nn.Linear``);
* ``cpu-kernels``: the C kernels of ``infer.kernels`` (streaming products, the fused small
  operators and the whole decoder stack in one call), each part probed here against the layers.

``auto`` takes ``cpu-kernels`` where the CPU, the compiler and the probes allow and says why not
otherwise; ``--backend`` (``EngineConfig.backend``) forces one and refuses, naming the reason, one
this machine cannot run. The engine's modes ride on top and are recorded with the choice: compiled
(``--compile``), CUDA graphs, exact greedy.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

import infer.kernels as kernels
from infer.cache import make_pool
from infer.cache.protocol import build_kv_batch
from infer.kernels.cpu import KernelLibrary
from infer.loader.config import ModelConfig
from infer.models.layers import RMSNorm, apply_rope, cpu_packing_available, rope_cos_sin

BACKENDS = ("auto", "torch", "cpu-kernels")


@dataclass
class Backend:
    """What runs a model's forward pass and why (``describe`` is the startup line's text)."""

    name: str  # "torch" or "cpu-kernels"
    library: KernelLibrary | None = None  # cpu-kernels: the variant in use
    fused: bool = False  # RMSNorm, RoPE and SwiGLU's activation in C
    stack: bool = False  # the whole decoder stack in one C call
    onednn: bool = False  # torch on CPU: linears pre-packed for oneDNN
    reasons: list[str] = field(default_factory=list)  # why a faster path was refused
    mode: str = "eager"  # set by the engine: eager, compiled, cuda-graphs, exact

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
    if device.type != "cpu":
        if requested == "cpu-kernels":
            raise ValueError(f"backend 'cpu-kernels' runs on the CPU; this model runs on {device}")
        return Backend("torch", mode=mode)
    reasons = []
    if requested == "torch":
        reasons.append("forced by --backend torch")
    else:
        library = kernels.library_for(dtype)
        if library is None:
            reason = kernels.unavailable_reason(dtype)
            if requested == "cpu-kernels":
                raise ValueError(f"backend 'cpu-kernels' cannot run {dtype} on this machine: {reason}")
            reasons.append(reason)
        else:
            refused = [line for line in kernels.selection().refused]
            fused_failure, stack_failure = probe_fused(library, dtype), probe_stack(library, dtype)
            for failure in (fused_failure, stack_failure):
                if failure is not None:
                    refused.append(failure)
            return Backend("cpu-kernels", library, fused=fused_failure is None,
                           stack=fused_failure is None and stack_failure is None, reasons=refused, mode=mode)
    onednn = cpu_packing_available(dtype) and not compile
    if compile and cpu_packing_available(dtype):
        reasons.append("compiled mode keeps nn.Linear (Inductor cannot lower oneDNN-packed weights)")
    return Backend("torch", onednn=onednn, reasons=reasons, mode=mode)


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 1e-5


@functools.cache
def probe_fused(library: KernelLibrary, dtype: torch.dtype) -> str | None:
    """None if RMSNorm, RoPE and SwiGLU's activation in C agree with the layers' on a probe, else
    which one did not."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 100, generator=gen).to(dtype)
    norm = RMSNorm(100, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(100, generator=gen))
    heads = torch.randn(2, 3, 5, 16, generator=gen).to(dtype)
    cos, sin = rope_cos_sin(torch.rand(8, generator=gen), torch.arange(6).view(2, 3), dtype)
    tol = _tolerance(dtype)
    checks = {"RMSNorm": (library.rms_norm(x, norm.weight, norm.eps), norm(x)),
              "RoPE": (library.rope(heads[:, :, :3], cos, sin), apply_rope(heads[:, :, :3], cos, sin)),
              "SwiGLU": (library.silu_mul(x), F.silu(x[..., :50]) * x[..., 50:])}
    for name, (ours, ref) in checks.items():
        if not torch.allclose(ours.float(), ref.float(), rtol=tol, atol=tol):
            return f"fused {name} failed its probe against the PyTorch layer: using the layers' operators"
    return None


# Tiny models the stack is probed on: grouped KV heads, two head dims (one a partial 16-lane
# chunk), biases, and Qwen3's q/k norms.
_STACK_PROBES = (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, qkv_bias=True, o_bias=True),
                 dict(num_attention_heads=6, num_key_value_heads=2, head_dim=40, qk_norm=True, mlp_bias=True))


@functools.cache
def probe_stack(library: KernelLibrary, dtype: torch.dtype) -> str | None:
    """None if the C decoder stack computes what the layers compute on tiny models (one on a paged
    cache, one on a slotted one): prefills, a batched pass of uneven runs and a decode step; else
    what differed."""
    from infer.models.layers import DecoderOnlyLM

    tol = _tolerance(dtype)
    for case_index, case in enumerate(_STACK_PROBES):
        config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=40,
                             num_hidden_layers=2, max_position_embeddings=64, **case)  # type: ignore[arg-type]
        gen = torch.Generator().manual_seed(case_index)
        model = DecoderOnlyLM(config)
        with torch.no_grad():
            for param in model.parameters():
                param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + (1.0 if param.dim() == 1 else 0.0))
        model = model.to(dtype).eval()
        model.fuse_projections()
        model.pack_for_cpu(Backend("cpu-kernels", library, fused=True, stack=True))
        stack = model.cpu_stack
        if stack is None:
            return f"the decoder stack does not take probe model {case_index}"
        for cache in (("paged", "slotted")[case_index % 2],):  # each cache kind once: the probe runs at every load
            outputs = []
            for use_stack in (True, False):
                model.cpu_stack = stack if use_stack else None
                outputs.append(_probe_passes(model, cache, dtype))
            model.cpu_stack = stack
            for index, (ours, ref) in enumerate(zip(*outputs, strict=True)):
                if not torch.allclose(ours, ref, rtol=tol, atol=4 * tol):
                    return (f"decoder stack failed its probe against the PyTorch layers ({cache} cache, model "
                            f"{case_index}, pass {index}, max error {(ours - ref).abs().max().item():.3g}): "
                            "running layer by layer")
    return None


def _probe_passes(model: Any, cache: str, dtype: torch.dtype) -> list[torch.Tensor]:
    config = model.config
    pool = make_pool(cache, num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                     head_dim=config.head_dim, max_seq_len=32, max_batch_size=2, block_size=4, num_blocks=None,
                     dtype=dtype, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(7)
    slots = [pool.allocate(), pool.allocate()]
    out = []
    with torch.inference_mode():
        # Two prefills (the paged pool interleaves their blocks), a batched pass of uneven runs
        # (padding, a mask, row tables) and a decode step of both.
        for slots_now, lengths in (([slots[0]], [5]), ([slots[1]], [3]), (slots, [3, 1]), (slots, [1, 1])):
            starts = [pool.seq_len(s) for s in slots_now]
            ids = torch.randint(config.vocab_size, (len(slots_now), max(lengths)), generator=gen)
            positions = torch.tensor(starts).unsqueeze(1) + torch.arange(max(lengths))
            kv = build_kv_batch(pool, slots_now, starts, lengths)
            out.append(model(ids, positions, kv).float())
    return out
