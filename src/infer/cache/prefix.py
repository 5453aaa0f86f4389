"""Prefix caching: full prompt blocks shared between requests through a chain of block digests.

Each full block of a prompt is keyed by SHA-256 of (the previous block's key, this block's token
ids), so a key names the whole prefix up to that block: a chain of keys is a path in a radix tree
of blocks. A cryptographic digest, not Python's 64-bit ``hash()``: crafted prompts must not be able
to collide with another request's prefix and read its KV blocks. The chain starts from a root
derived from the request's ``cache_salt``, so requests with different salts (tenants) never share
a block.

The cache holds one reference to every block it knows; a block only the cache references is idle
and can be evicted, least recently used first, when the pool runs out. Only prompt blocks are ever
inserted, so speculative tokens never enter the tree, and ``truncate_to`` (which only drops a
sequence's own references past its length) can never free a block the tree still holds.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from infer.cache.paged import PagedKVCachePool

_UNSALTED_ROOT = hashlib.sha256(b"infer prefix cache").digest()


def chain_root(cache_salt: str | None) -> bytes:
    """The key the block chain of a request with ``cache_salt`` starts from."""
    if cache_salt is None:
        return _UNSALTED_ROOT
    return hashlib.sha256(b"infer prefix cache salt\0" + cache_salt.encode("utf-8", "surrogatepass")).digest()


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """SHA-256 of the parent key and the block's token ids (as 64-bit integers)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class PrefixCache:
    def __init__(self, pool: PagedKVCachePool) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self._blocks: dict[bytes, int] = {}  # key -> block
        self._keys: dict[int, bytes] = {}  # block -> key
        # Keys of idle blocks (only the cache holds them), least recently used first: the
        # evictable count is its length, eviction pops from the front.
        self._idle: OrderedDict[bytes, None] = OrderedDict()
        self.hit_tokens = 0  # prompt tokens served from the cache
        # Off for a pool whose sliding-window layers free their blocks: a prompt's early blocks are
        # gone from those layers by the time it is cached, and a hit would need them.
        self.enabled = not pool.local_layers
        pool.evictor = self

    def _chain(self, tokens: Sequence[int], num_blocks: int, cache_salt: str | None) -> list[bytes]:
        keys, parent = [], chain_root(cache_salt)
        for i in range(num_blocks):
            parent = block_key(parent, tokens[i * self.block_size:(i + 1) * self.block_size])
            keys.append(parent)
        return keys

    def attach(self, slot: int, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        """Start ``slot`` with the longest cached prefix of ``prompt``; returns its token count.

        At least one prompt token is always left to compute, since its logits give the first
        generated token.
        """
        if not self.enabled:
            return 0
        usable = (len(prompt) - 1) // self.block_size
        blocks = []
        for key in self._chain(prompt, usable, cache_salt):
            block = self._blocks.get(key)
            if block is None:
                break
            self._idle.pop(key, None)  # the slot's reference makes it busy
            blocks.append(block)
        if blocks:
            self.pool.append_shared_blocks(slot, blocks)
        self.hit_tokens += len(blocks) * self.block_size
        return len(blocks) * self.block_size

    def insert(self, slot: int, prompt: Sequence[int], cache_salt: str | None = None) -> None:
        """Register the full blocks of ``slot`` that ``prompt`` covers, its first tokens (call once their
        K/V are in the cache: a prompt once prefilled, or a finished request's computed tokens)."""
        if not self.enabled:
            return
        table = self.pool.block_tables[slot]
        full = min(len(prompt) // self.block_size, len(table))
        for key, block in zip(self._chain(prompt, full, cache_salt), table, strict=False):
            if key in self._blocks:
                if key in self._idle:
                    self._idle.move_to_end(key)  # just seen again: most recently used
                continue
            self.pool.retain_block(block)  # the slot holds it too: busy, not idle
            self._blocks[key] = block
            self._keys[block] = key

    # -- BlockEvictor ----------------------------------------------------------------------------
    def block_idle(self, block: int) -> None:
        """The pool dropped ``block`` to one reference: if that is the cache's, it is now idle."""
        key = self._keys.get(block)
        if key is not None:
            self._idle[key] = None
            self._idle.move_to_end(key)

    def num_evictable(self) -> int:
        return len(self._idle)

    def evict(self, num_blocks: int) -> None:
        for _ in range(min(num_blocks, len(self._idle))):
            key, _ = self._idle.popitem(last=False)  # oldest first
            block = self._blocks.pop(key)
            del self._keys[block]
            self.pool.release_block(block)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)
