"""Paged KV cache: fixed-size blocks from a free list, a block table per sequence.

Blocks are reference counted so that the prefix cache can share full prompt blocks between
sequences; ``truncate_to`` only drops this sequence's reference to blocks past the new length.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from infer.cache.protocol import CacheFullError, kv_storage, take_free


class BlockEvictor(Protocol):
    """Something holding idle blocks it can give back on demand (the prefix cache)."""

    def num_evictable(self) -> int: ...
    def evict(self, num_blocks: int) -> None: ...
    def block_idle(self, block: int) -> None:
        """``block`` dropped to a single reference (called on every such drop)."""


class PagedKVCachePool:
    """``num_blocks`` blocks of ``block_size`` token rows each, shared by all sequences."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_blocks: int, block_size: int,
                 max_seq_len: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_seq_len = max_seq_len
        self.scratch_row = num_blocks * block_size
        self.k_layers, self.v_layers = kv_storage(num_layers, self.scratch_row, num_kv_heads, head_dim, dtype,
                                                  self.device)
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._refcount = [0] * num_blocks
        self.block_tables: dict[int, list[int]] = {}
        self._lens: dict[int, int] = {}
        self._next_slot = 0
        # The prefix cache registers here so idle cached blocks count as free and are evicted on demand.
        self.evictor: BlockEvictor | None = None

    # -- sequences -----------------------------------------------------------------------------
    def allocate(self) -> int:
        slot = self._next_slot
        self._next_slot += 1
        self.block_tables[slot] = []
        self._lens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        for block in self.block_tables.pop(slot):
            self.release_block(block)
        del self._lens[slot]

    def seq_len(self, slot: int) -> int:
        return self._lens[slot]

    def reserve(self, slot: int, new_len: int) -> None:
        if new_len > self.max_seq_len:
            raise CacheFullError(f"sequence of {new_len} tokens exceeds max_seq_len={self.max_seq_len}")
        table = self.block_tables[slot]
        needed = math.ceil(new_len / self.block_size) - len(table)
        if needed > self.num_free_blocks():
            raise CacheFullError(f"need {needed} KV blocks, only {self.num_free_blocks()} free")
        for _ in range(needed):
            table.append(self.take_block())
        self._lens[slot] = new_len

    def truncate_to(self, slot: int, new_len: int) -> None:
        if not 0 <= new_len <= self._lens[slot]:
            raise ValueError(f"truncate_to({new_len}) outside [0, {self._lens[slot]}] for slot {slot}")
        table = self.block_tables[slot]
        keep = math.ceil(new_len / self.block_size)
        for block in table[keep:]:
            self.release_block(block)
        del table[keep:]
        self._lens[slot] = new_len

    def append_shared_blocks(self, slot: int, blocks: list[int]) -> None:
        """Start an empty sequence with already-filled blocks (prefix cache hit); takes a reference each."""
        table = self.block_tables[slot]
        if table:
            raise ValueError("shared blocks can only start an empty sequence")
        for block in blocks:
            self._refcount[block] += 1
        table.extend(blocks)
        self._lens[slot] = len(blocks) * self.block_size

    # -- blocks --------------------------------------------------------------------------------
    def take_block(self) -> int:
        if not self._free_blocks and self.evictor is not None:
            self.evictor.evict(1)
        block = take_free(self._free_blocks, f"{self.num_blocks} KV blocks")
        self._refcount[block] = 1
        return block

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def retain_block(self, block: int) -> None:
        self._refcount[block] += 1

    def release_block(self, block: int) -> None:
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            self._free_blocks.append(block)
        elif self._refcount[block] == 1 and self.evictor is not None:
            self.evictor.block_idle(block)
        elif self._refcount[block] < 0:
            raise RuntimeError(f"KV block {block} released more often than taken")

    def num_free_blocks(self) -> int:
        return len(self._free_blocks) + self.num_evictable_blocks()

    def num_evictable_blocks(self) -> int:
        return 0 if self.evictor is None else self.evictor.num_evictable()

    # -- addressing ----------------------------------------------------------------------------
    def storage_rows(self, slot: int, end: int) -> torch.Tensor:
        table = torch.tensor(self.block_tables[slot], dtype=torch.long, device=self.device)
        offsets = torch.arange(self.block_size, device=self.device)
        return (table.unsqueeze(1) * self.block_size + offsets).flatten()[:end]

    def contiguous_start(self, slot: int) -> int | None:
        table = self.block_tables[slot]
        if all(b == table[0] + i for i, b in enumerate(table)):
            return table[0] * self.block_size if table else 0
        return None

    def free_kv_tokens(self) -> int:
        return self.num_free_blocks() * self.block_size

    def kv_tokens_needed(self, slot: int | None, total_tokens: int) -> int:
        total = min(self.max_seq_len, total_tokens)
        held = 0 if slot is None else math.ceil(self._lens[slot] / self.block_size) * self.block_size
        return max(0, math.ceil(total / self.block_size) * self.block_size - held)

    @property
    def num_active(self) -> int:
        return len(self._lens)
