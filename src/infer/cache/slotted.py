"""Contiguous KV cache: one fixed region of ``max_seq_len`` rows per sequence slot."""

from __future__ import annotations

import torch

from infer.cache.protocol import CacheFullError, kv_storage, take_free


class SlottedKVCache:
    """``num_slots`` sequences of up to ``max_seq_len`` tokens each; slot s owns rows [s*M, (s+1)*M)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, *, num_slots: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.max_seq_len = max_seq_len
        self.num_slots = num_slots
        self.scratch_row = num_slots * max_seq_len
        self.k_layers, self.v_layers = kv_storage(num_layers, self.scratch_row, num_kv_heads, head_dim, dtype,
                                                  self.device)
        self._free = list(range(num_slots - 1, -1, -1))
        self._lens: dict[int, int] = {}

    def allocate(self) -> int:
        slot = take_free(self._free, f"{self.num_slots} KV cache slots")
        self._lens[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        del self._lens[slot]
        self._free.append(slot)

    def seq_len(self, slot: int) -> int:
        return self._lens[slot]

    def reserve(self, slot: int, new_len: int) -> None:
        if new_len > self.max_seq_len:
            raise CacheFullError(f"sequence of {new_len} tokens exceeds max_seq_len={self.max_seq_len}")
        self._lens[slot] = new_len

    def truncate_to(self, slot: int, new_len: int) -> None:
        if not 0 <= new_len <= self._lens[slot]:
            raise ValueError(f"truncate_to({new_len}) outside [0, {self._lens[slot]}] for slot {slot}")
        # Stale rows past the length are never read (masked) and get overwritten next round.
        self._lens[slot] = new_len

    def storage_rows(self, slot: int, end: int) -> torch.Tensor:
        base = slot * self.max_seq_len
        return torch.arange(base, base + end, device=self.device)

    def contiguous_start(self, slot: int) -> int | None:
        return slot * self.max_seq_len

    def free_kv_tokens(self) -> int:
        return len(self._free) * self.max_seq_len

    def kv_tokens_needed(self, slot: int | None, total_tokens: int) -> int:
        return 0 if slot is not None else self.max_seq_len  # a whole slot, taken once at allocation

    @property
    def num_active(self) -> int:
        return len(self._lens)
