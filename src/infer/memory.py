"""Host memory for the buffers every pass streams (the kernels' weights, the KV stores), in 2 MB pages
where Linux gives them.

A decode step reads every weight once, and at long contexts every cached key and value: SmolLM2's
quantized weights alone are about 100 MB, some 25,000 pages of 4 KB a step, far more than the TLB
maps, so the stream pays a page-table walk every 4 KB and the hardware prefetchers (which stop at page
boundaries) start over on every page. Linux backs memory with 2 MB pages (transparent huge pages)
only where the program asks, in the ``madvise`` mode most distributions ship; PyTorch's allocator and
glibc's never ask. Here such buffers are private anonymous mappings, 2 MB aligned and advised
``MADV_HUGEPAGE``: zero until written, resident only once touched, like ``calloc``'s. Where the
platform has no such advice (or the kernel runs no huge pages) they are ordinary pages, and nothing
else changes. docs/cpu.md has the figures.

``huge_zeros`` makes one buffer in a mapping of its own (a KV store); ``Arena`` packs many smaller
long-lived ones into shared mappings (a model's weights: most matrices are under 2 MB). Every tensor
has a storage of its own (its bytes only), so code that tells tensors apart by their storage sees
each as before; the mapping lives as long as any tensor in it."""

from __future__ import annotations

import math
import mmap
import threading

import numpy as np
import torch

PAGE = 2 << 20  # a huge page: mappings are aligned to it
ALIGN = 64  # every tensor's first byte, as PyTorch's own CPU allocations
CHUNK = 32 << 20  # an arena's mappings; a request over a quarter of it gets a mapping of its own


def huge_advice() -> bool:
    """Whether this platform can advise anonymous mappings to use huge pages (Linux)."""
    return hasattr(mmap, "MADV_HUGEPAGE") and hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS")


def _mapping(nbytes: int) -> np.ndarray:
    """A zeroed uint8 array of at least ``nbytes`` starting on a 2 MB boundary, advised huge where the
    platform can (else numpy's own zeroed memory). The array holds the mapping open."""
    if huge_advice():
        try:
            region = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        except OSError:
            region = None
        if region is not None:
            with_advice = True
            try:
                region.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # a kernel built without transparent huge pages: ordinary pages
                with_advice = False
            whole = np.frombuffer(region, dtype=np.uint8)  # holds the mapping: it cannot close under a tensor
            skip = -whole.ctypes.data % PAGE if with_advice else 0
            return whole[skip: skip + nbytes]
    whole = np.zeros(nbytes + ALIGN, dtype=np.uint8)
    skip = -whole.ctypes.data % ALIGN
    return whole[skip: skip + nbytes]


def _tensor(array: np.ndarray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(array).view(dtype).view(shape)


def huge_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor in a mapping of its own (see the module's docstring)."""
    return _tensor(_mapping(dtype.itemsize * math.prod(shape)), shape, dtype)


class Arena:
    """Zeroed CPU tensors carved in order from shared huge-page mappings (``CHUNK`` bytes each), for
    buffers that live as long as a model: consecutive requests lie side by side, as a pass reads them."""

    def __init__(self, chunk: int = CHUNK) -> None:
        self.chunk = chunk
        self._lock = threading.Lock()
        self._current: np.ndarray | None = None
        self._used = 0

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nbytes = dtype.itemsize * math.prod(shape)
        if nbytes > self.chunk // 4:
            return huge_zeros(shape, dtype)
        with self._lock:
            start = -(-self._used // ALIGN) * ALIGN
            if self._current is None or start + nbytes > len(self._current):
                self._current, start = _mapping(self.chunk), 0
            self._used = start + nbytes
            return _tensor(self._current[start: start + nbytes], shape, dtype)


WEIGHTS = Arena()  # the kernels' repacked weights (infer.kernels.quant)
