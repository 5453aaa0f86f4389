"""Writing GGUFs with quantized tensors for tests: the writers of ``test_gguf``/``test_gemma3_gguf``
write float tensors; inside ``typed_tensors`` each 2-D float tensor is stored in the block type a
rule picks for its name instead. Types gguf-py can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) hold the
tensor itself, llama.cpp's rounding; the K types (which gguf-py cannot quantize) hold random blocks
of the tensor's scale (a model whose reference is the file's own dequantization)."""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import numpy as np
import torch

QUANTIZABLE_BY_GGUF = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# Where each type keeps its float16 scales (and mins) in a block.
_SCALE_BYTES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def k_blocks(weight: np.ndarray, qtype: str, seed: int = 0) -> np.ndarray:
    """Random valid ``qtype`` blocks for a matrix of ``weight``'s shape whose values have about its
    standard deviation."""
    from infer.kernels.quant import dequantize_reference, random_blocks

    rows, cols = weight.shape
    raw = random_blocks(qtype, rows, cols, torch.Generator().manual_seed(seed))
    spread = float(dequantize_reference(raw, qtype, cols).std())
    factor = float(weight.std()) / spread
    blocks = raw.numpy().reshape(rows * (cols // 256), -1)  # one block per row
    for at in _SCALE_BYTES[qtype]:
        scales = blocks[:, at:at + 2].copy().view(np.float16).astype(np.float32) * factor
        blocks[:, at:at + 2] = scales.astype(np.float16).view(np.uint8)
    return np.ascontiguousarray(blocks.reshape(rows, -1))


def stored(weight: np.ndarray, qtype: str) -> np.ndarray:
    import gguf

    if qtype in QUANTIZABLE_BY_GGUF:
        return gguf.quants.quantize(weight.astype(np.float32), gguf.GGMLQuantizationType[qtype])
    return k_blocks(weight, qtype, seed=zlib.crc32(weight.tobytes()))  # the same blocks in every run


@contextlib.contextmanager
def typed_tensors(rule: Callable[[str], str | None]) -> Iterator[None]:
    """GGUF writers inside store each 2-D float32 tensor named ``n`` as ``rule(n)`` (None: as given)."""
    import gguf

    original = gguf.GGUFWriter.add_tensor

    def add_tensor(self: Any, name: str, tensor: np.ndarray, raw_shape: Any = None, raw_dtype: Any = None,
                   **kw: Any) -> None:
        qtype = rule(name) if raw_dtype is None and tensor.ndim == 2 and tensor.dtype == np.float32 else None
        if qtype is not None:
            tensor, raw_dtype = stored(tensor, qtype), gguf.GGMLQuantizationType[qtype]
        original(self, name, tensor, raw_shape=raw_shape, raw_dtype=raw_dtype, **kw)

    with mock.patch.object(gguf.GGUFWriter, "add_tensor", add_tensor):
        yield


def by_part(types: dict[str, str], default: str | None = None) -> Callable[[str], str | None]:
    """A rule from GGUF name parts (``attn_q``, ``token_embd``, ``output`` ...) to types."""
    def rule(name: str) -> str | None:
        part = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        return types.get(part, default)
    return rule
