"""KV cache pools: contiguous slots or paged blocks behind one protocol."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from infer.cache.paged import PagedKVCachePool
from infer.cache.protocol import CacheFullError, CachePoolProtocol, KVBatch, build_kv_batch
from infer.cache.slotted import SlottedKVCache

KV_BACKENDS = ("paged", "slotted")


def local_blocks_per_sequence(window: int, window_slack: int, max_pass_tokens: int, block_size: int) -> int:
    """The most sliding-window blocks one sequence of a paged pool holds at once: the window, the
    slack a pass may start past the committed length, one pass, and one block straddling the edge."""
    return -(-(window + window_slack + max_pass_tokens) // block_size) + 1


def make_pool(backend: str, *, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
              max_batch_size: int, block_size: int, num_blocks: int | None, dtype: torch.dtype,
              device: torch.device, layer_windows: Sequence[int | None] | None = None, window_slack: int = 0,
              max_pass_tokens: int | None = None) -> CachePoolProtocol:
    """A KV pool for one model, sized for ``max_batch_size`` full-length sequences by default.

    Speculative rounds never write past ``max_seq_len`` (the runner clamps every draft), so no
    extra room is needed here; admission reserves the per-round overrun within each sequence.

    ``layer_windows`` (``ModelConfig.layer_window`` per layer) gives a paged pool's sliding-window
    layers their own blocks, freed as the window moves on (``PagedKVCachePool``); ``window_slack``
    is how far past a committed length a pass may start (a draft model's chain). With
    ``max_pass_tokens`` (the most tokens one pass appends) those layers get room for
    ``max_batch_size`` sequences of window + slack + one pass each, which is all they can ever
    hold at once, rather than full-length ones; admission then counts the global layers only.
    """
    shape = (num_layers, num_kv_heads, head_dim)
    if backend == "slotted":
        return SlottedKVCache(*shape, num_slots=max_batch_size, max_seq_len=max_seq_len, dtype=dtype, device=device)
    if backend != "paged":
        raise ValueError(f"kv_cache_backend={backend!r} is invalid: use {' or '.join(KV_BACKENDS)}")
    blocks = num_blocks or max_batch_size * -(-max_seq_len // block_size)
    windows = [w for w in layer_windows or () if w is not None]
    local_blocks = None
    if windows and max_pass_tokens is not None:
        local_blocks = min(blocks, max_batch_size * local_blocks_per_sequence(max(windows), window_slack,
                                                                              max_pass_tokens, block_size))
    return PagedKVCachePool(*shape, num_blocks=blocks, block_size=block_size, max_seq_len=max_seq_len,
                            dtype=dtype, device=device, layer_windows=layer_windows if windows else None,
                            window_slack=window_slack, num_local_blocks=local_blocks)


__all__ = ["KV_BACKENDS", "CacheFullError", "CachePoolProtocol", "KVBatch", "PagedKVCachePool", "SlottedKVCache",
           "build_kv_batch", "local_blocks_per_sequence", "make_pool"]
