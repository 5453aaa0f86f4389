"""Prefix caching: full prompt blocks shared between requests through a tree of block hashes.

Each full block of a prompt is keyed by (key of the previous block, its tokens), so a key names
the whole prefix up to that block: a chain of keys is a path in a radix tree of blocks. The cache
holds one reference to every block it knows; a block only the cache references is idle and can be
evicted, least recently used first, when the pool runs out. Only prompt blocks are ever inserted,
so speculative tokens never enter the tree, and ``truncate_to`` (which only drops a sequence's own
references past its length) can never free a block the tree still holds.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence

from infer.cache.paged import PagedKVCachePool


class PrefixCache:
    def __init__(self, pool: PagedKVCachePool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._blocks: OrderedDict[int, int] = OrderedDict()  # key hash -> block, in LRU order
        self.hit_tokens = 0  # prompt tokens served from the cache
        pool.evictor = self

    def _keys(self, tokens: Sequence[int], num_blocks: int) -> list[int]:
        keys, parent = [], 0
        for i in range(num_blocks):
            block = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            parent = hash((parent, block))
            keys.append(parent)
        return keys

    def attach(self, slot: int, prompt: Sequence[int]) -> int:
        """Start ``slot`` with the longest cached prefix of ``prompt``; returns its token count.

        At least one prompt token is always left to compute, since its logits give the first
        generated token.
        """
        usable = (len(prompt) - 1) // self.block_size
        blocks = []
        for key in self._keys(prompt, usable):
            block = self._blocks.get(key)
            if block is None:
                break
            self._blocks.move_to_end(key)
            blocks.append(block)
        if blocks:
            self.pool.append_shared_blocks(slot, blocks)
        self.hit_tokens += len(blocks) * self.block_size
        return len(blocks) * self.block_size

    def insert(self, slot: int, prompt: Sequence[int]) -> None:
        """Register the full prompt blocks of ``slot`` (call once its prompt is in the cache)."""
        table = self.pool.block_tables[slot]
        full = min(len(prompt) // self.block_size, len(table))
        for key, block in zip(self._keys(prompt, full), table, strict=False):
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self.pool.retain_block(block)
            self._blocks[key] = block

    # -- BlockEvictor ----------------------------------------------------------------------------
    def num_evictable(self) -> int:
        return sum(1 for block in self._blocks.values() if self.pool.refcount(block) == 1)

    def evict(self, num_blocks: int) -> None:
        idle = [key for key, block in self._blocks.items() if self.pool.refcount(block) == 1]
        for key in itertools.islice(idle, num_blocks):  # oldest first
            self.pool.release_block(self._blocks.pop(key))

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)
