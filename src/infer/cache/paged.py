"""Paged KV cache: fixed-size blocks from a free list, a block table per sequence.

Blocks are reference counted so that the prefix cache can share full prompt blocks between
sequences; ``truncate_to`` only drops this sequence's reference to blocks past the new length.

Sliding-window layers (``layer_windows``) keep their K/V in a second, smaller set of blocks with
its own table per sequence, from which blocks that fell out of the window are freed as the
sequence grows, so a long sequence holds a full-length cache for its global layers only. A block
is freed once every position in it is older than ``window + window_slack`` behind the start of a
pass: a pass begins at a committed length (or, for a draft model, at most ``window_slack`` tokens
past one), and no rollback (``truncate_to``) goes below that, so a rejected draft never needs a
freed block. A freed position reads the local scratch row; the window's mask hides it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import torch

from infer.cache.protocol import CacheFullError, kv_storage, take_free

FREED = -1  # a local block table entry whose block the window has left behind


class BlockEvictor(Protocol):
    """Something holding idle blocks it can give back on demand (the prefix cache)."""

    def num_evictable(self) -> int: ...
    def evict(self, num_blocks: int) -> None: ...
    def block_idle(self, block: int) -> None:
        """``block`` dropped to a single reference (called on every such drop)."""


class PagedKVCachePool:
    """``num_blocks`` blocks of ``block_size`` token rows each, shared by all sequences."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_blocks: int, block_size: int,
                 max_seq_len: int, dtype: torch.dtype, device: torch.device | str,
                 layer_windows: Sequence[int | None] | None = None, window_slack: int = 0,
                 num_local_blocks: int | None = None) -> None:
        self.device = torch.device(device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_seq_len = max_seq_len
        self.scratch_row = num_blocks * block_size
        windows = {w for w in layer_windows or () if w is not None}
        if len(windows) > 1:
            raise ValueError(f"sliding windows of several sizes ({sorted(windows)}) in one model are not supported")
        if layer_windows is not None and len(layer_windows) != num_layers:
            raise ValueError(f"layer_windows has {len(layer_windows)} entries for {num_layers} layers")
        self.window: int | None = windows.pop() if windows else None
        self.window_slack = window_slack
        self.local_layers = frozenset(i for i, w in enumerate(layer_windows or ()) if w is not None)
        self.num_local_blocks = (num_local_blocks or num_blocks) if self.local_layers else 0
        self.local_scratch_row = self.num_local_blocks * block_size
        k_global, v_global = kv_storage(num_layers - len(self.local_layers), self.scratch_row, num_kv_heads,
                                        head_dim, dtype, self.device)
        k_local, v_local = kv_storage(len(self.local_layers), self.local_scratch_row, num_kv_heads, head_dim, dtype,
                                      self.device) if self.local_layers else ([], [])
        self.k_layers = [k_local.pop(0) if i in self.local_layers else k_global.pop(0) for i in range(num_layers)]
        self.v_layers = [v_local.pop(0) if i in self.local_layers else v_global.pop(0) for i in range(num_layers)]
        self._free_local = list(range(self.num_local_blocks - 1, -1, -1))
        self.local_tables: dict[int, list[int]] = {}  # per sequence; FREED where the window has moved on
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._refcount = [0] * num_blocks
        self.block_tables: dict[int, list[int]] = {}
        # Per sequence: the block table its storage rows were last made for, and those rows. A decode
        # step asks for them every pass; the table changes only when a block is added or dropped.
        self._rows: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}
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
        if self.local_layers:
            self.local_tables[slot] = []
        return slot

    def free(self, slot: int) -> None:
        self._rows.pop(slot, None)
        for block in self.block_tables.pop(slot):
            self.release_block(block)
        del self._lens[slot]
        if self.local_layers:
            self._free_local.extend(b for b in self.local_tables.pop(slot) if b != FREED)

    def seq_len(self, slot: int) -> int:
        return self._lens[slot]

    def reserve(self, slot: int, new_len: int) -> None:
        if new_len > self.max_seq_len:
            raise CacheFullError(f"sequence of {new_len} tokens exceeds max_seq_len={self.max_seq_len}")
        table = self.block_tables[slot]
        needed = math.ceil(new_len / self.block_size) - len(table)
        if needed > self.num_free_blocks():
            raise CacheFullError(f"need {needed} KV blocks, only {self.num_free_blocks()} free")
        if self.local_layers:
            self._reserve_local(slot, new_len)
        for _ in range(needed):
            table.append(self.take_block())
        self._lens[slot] = new_len

    def _reserve_local(self, slot: int, new_len: int) -> None:
        """Free the local blocks the window has left behind (before this pass, which starts at the
        current length), then take blocks for positions up to ``new_len``."""
        assert self.window is not None
        table = self.local_tables[slot]
        horizon = self._lens[slot] - self.window - self.window_slack  # positions below it are never read again
        for j in range(min(len(table), max(0, horizon) // self.block_size)):
            if table[j] != FREED:
                self._free_local.append(table[j])
                table[j] = FREED
        needed = math.ceil(new_len / self.block_size) - len(table)
        if needed > len(self._free_local):
            raise CacheFullError(f"need {needed} sliding-window KV blocks, only {len(self._free_local)} free")
        for _ in range(needed):
            table.append(self._free_local.pop())

    def live_local_blocks(self, slot: int) -> int:
        """Local (sliding-window) blocks ``slot`` holds now."""
        return sum(b != FREED for b in self.local_tables.get(slot, ()))

    def truncate_to(self, slot: int, new_len: int) -> None:
        if not 0 <= new_len <= self._lens[slot]:
            raise ValueError(f"truncate_to({new_len}) outside [0, {self._lens[slot]}] for slot {slot}")
        table = self.block_tables[slot]
        keep = math.ceil(new_len / self.block_size)
        for block in table[keep:]:
            self.release_block(block)
        del table[keep:]
        self._lens[slot] = new_len
        if self.local_layers:
            local = self.local_tables[slot]
            self._free_local.extend(b for b in local[keep:] if b != FREED)
            del local[keep:]

    def append_shared_blocks(self, slot: int, blocks: list[int]) -> None:
        """Start an empty sequence with already-filled blocks (prefix cache hit); takes a reference each."""
        table = self.block_tables[slot]
        if table:
            raise ValueError("shared blocks can only start an empty sequence")
        if self.local_layers:
            raise ValueError("a pool with sliding-window layers shares no blocks (their prompt blocks are freed)")
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
        """The storage rows of ``slot``'s first ``end`` positions (a view: callers do not write it)."""
        table = tuple(self.block_tables[slot])
        cached = self._rows.get(slot)
        if cached is None or cached[0] != table:
            # Blocks only appended since: extend the rows made before; else make them all again.
            kept = cached if cached is not None and cached[0] == table[:len(cached[0])] else None
            start = 0 if kept is None else len(kept[0])
            blocks = torch.tensor(table[start:], dtype=torch.long, device=self.device)
            rows = (blocks.unsqueeze(1) * self.block_size + torch.arange(self.block_size, device=self.device)).flatten()
            if kept is not None:
                rows = torch.cat((kept[1], rows))
            cached = (table, rows)
            self._rows[slot] = cached
        return cached[1][:end]

    def contiguous_start(self, slot: int) -> int | None:
        table = self.block_tables[slot]
        if all(b == table[0] + i for i, b in enumerate(table)):
            return table[0] * self.block_size if table else 0
        return None

    def local_storage_rows(self, slot: int, end: int) -> torch.Tensor:
        """Like ``storage_rows`` for the sliding-window layers' storage; freed positions read its scratch row."""
        table = torch.tensor(self.local_tables[slot], dtype=torch.long, device=self.device)
        offsets = torch.arange(self.block_size, device=self.device)
        rows = (table.unsqueeze(1) * self.block_size + offsets).flatten()[:end]
        return rows.masked_fill_(rows < 0, self.local_scratch_row)

    def free_kv_tokens(self) -> int:
        return self.num_free_blocks() * self.block_size

    def kv_tokens_needed(self, slot: int | None, total_tokens: int) -> int:
        total = min(self.max_seq_len, total_tokens)
        held = 0 if slot is None else math.ceil(self._lens[slot] / self.block_size) * self.block_size
        return max(0, math.ceil(total / self.block_size) * self.block_size - held)

    @property
    def num_active(self) -> int:
        return len(self._lens)
