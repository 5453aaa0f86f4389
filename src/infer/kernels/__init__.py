"""CPU kernels for decoding: a C library (``cpu_kernels.c``) built once per machine, per ISA variant.

``selection()`` picks the best variant this CPU runs (``build.VARIANTS``: AVX-512 with BF16, then
AVX-512 float32), builds or loads it and probes its product against ``F.linear``; it never raises.
Where nothing runs it says why, in one line per refused variant, and the models keep their PyTorch
layers. ``infer.backends`` turns this into the execution backend a model runs on.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from infer.kernels import build
from infer.kernels.build import KernelUnavailable, Variant
from infer.kernels.cpu import SUFFIX, KernelLibrary, probe_gemv


@dataclass
class Selection:
    """The variant in use (None: none runs here) and why each better one was refused."""

    library: KernelLibrary | None
    refused: list[str] = field(default_factory=list)  # one line each: "avx512-bf16: CPU lacks avx512_bf16"
    probe_failures: dict[torch.dtype, str] = field(default_factory=dict)  # dtype -> why its probe failed

    @property
    def variant(self) -> Variant | None:
        return None if self.library is None else self.library.variant


def load_variant(variant: Variant) -> KernelLibrary:
    """``variant``'s library, built if needed and its interface checked (KernelUnavailable with
    the reason otherwise). Tests load each variant the CPU runs this way."""
    return KernelLibrary(variant, build.load(variant))


@functools.cache
def selection() -> Selection:
    """The kernels this process uses, chosen once (``reset`` forgets the choice)."""
    refused = []
    for variant in build.VARIANTS:
        missing = build.missing_cpu_flags(variant)
        if missing:
            refused.append(f"{variant.name}: CPU lacks {', '.join(missing)}")
            continue
        try:
            library = load_variant(variant)
        except KernelUnavailable as err:
            refused.append(f"{variant.name}: {err}")
            continue
        except Exception as err:  # anything else a load can raise still must not break a model load
            refused.append(f"{variant.name}: {type(err).__name__}: {err}")
            continue
        failures = {}
        for dtype in library.dtypes:
            failure = probe_gemv(library, dtype)
            if failure is not None:
                failures[dtype] = f"{variant.name}: probe failed: {failure}"
        return Selection(library, refused, failures)
    return Selection(None, refused)


@functools.cache
def named_library(name: str) -> KernelLibrary:
    """Variant ``name`` of the float kernels (``--backend cpu-kernels:NAME``), built, loaded and
    probed for every dtype it holds; KernelUnavailable naming why it cannot run here."""
    variant = next((v for v in build.VARIANTS if v.name == name), None)
    if variant is None:
        raise ValueError(f"unknown kernel variant {name!r}: one of {', '.join(build.VARIANT_NAMES)}")
    missing = build.missing_cpu_flags(variant)
    if missing:
        raise KernelUnavailable(f"{name}: CPU lacks {', '.join(missing)}")
    library = load_variant(variant)
    for dtype in library.dtypes:
        failure = probe_gemv(library, dtype)
        if failure is not None:
            raise KernelUnavailable(f"{name}: probe failed: {failure}")
    return library


def library_for(dtype: torch.dtype) -> KernelLibrary | None:
    """The kernels for ``dtype`` where they run here and passed their probe, else None."""
    chosen = selection()
    if chosen.library is None or dtype not in chosen.library.dtypes or dtype in chosen.probe_failures:
        return None
    return chosen.library


def unavailable_reason(dtype: torch.dtype) -> str:
    """Why ``library_for(dtype)`` is None, in one line ("" where it is not)."""
    chosen = selection()
    if dtype not in SUFFIX:
        return f"the CPU kernels have no {dtype} version (bfloat16 and float32 only)"
    if dtype in chosen.probe_failures:
        return chosen.probe_failures[dtype]
    if chosen.library is None:
        return "; ".join(chosen.refused) or "no kernel variant for this CPU"
    if dtype not in chosen.library.dtypes:
        lacking = "; ".join(chosen.refused)
        return f"{lacking} (the {chosen.library.variant.name} kernels have no {dtype} version)"
    return ""


def reset() -> None:
    """Forget the choice (tests that fake another CPU, compiler or cache call this)."""
    from infer.kernels import cpu, quant

    selection.cache_clear()
    named_library.cache_clear()
    cpu._library_for_op.cache_clear()
    quant.reset()


__all__ = ["KernelLibrary", "KernelUnavailable", "Selection", "Variant", "build", "library_for",
           "load_variant", "named_library", "reset", "selection", "unavailable_reason"]
