"""KV cache pools: contiguous slots or paged blocks behind one protocol."""

from __future__ import annotations

import torch

from infer.cache.paged import PagedKVCachePool
from infer.cache.protocol import CacheFullError, CachePoolProtocol, KVBatch, build_kv_batch
from infer.cache.slotted import SlottedKVCache

KV_BACKENDS = ("paged", "slotted")


def make_pool(backend: str, *, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
              max_batch_size: int, block_size: int, num_blocks: int | None, dtype: torch.dtype,
              device: torch.device) -> CachePoolProtocol:
    """A KV pool for one model, sized for ``max_batch_size`` full-length sequences by default.

    Speculative rounds never write past ``max_seq_len`` (the runner clamps every draft), so no
    extra room is needed here; admission reserves the per-round overrun within each sequence.
    """
    shape = (num_layers, num_kv_heads, head_dim)
    if backend == "slotted":
        return SlottedKVCache(*shape, num_slots=max_batch_size, max_seq_len=max_seq_len, dtype=dtype, device=device)
    if backend != "paged":
        raise ValueError(f"kv_cache_backend={backend!r} is invalid: use {' or '.join(KV_BACKENDS)}")
    blocks = num_blocks or max_batch_size * -(-max_seq_len // block_size)
    return PagedKVCachePool(*shape, num_blocks=blocks, block_size=block_size, max_seq_len=max_seq_len,
                            dtype=dtype, device=device)


__all__ = ["KV_BACKENDS", "CacheFullError", "CachePoolProtocol", "KVBatch", "PagedKVCachePool", "SlottedKVCache",
           "build_kv_batch", "make_pool"]
