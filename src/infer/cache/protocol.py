"""The KV cache pool interface and the per-forward view the model reads and writes through.

Every pool stores each layer's keys and values as one flat tensor ``[rows, kv_heads, head_dim]``.
A pool's only job is to map (sequence, position) to a storage row; attention then writes new K/V
with one ``index_copy_`` and gathers a sequence's context with one index. This keeps rollback a
matter of moving a length (``truncate_to``) and makes the two backends interchangeable.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from infer.memory import huge_zeros


class CacheFullError(RuntimeError):
    """Raised when a pool has no free slot or block for a sequence."""


@dataclass
class KVBatch:
    """What one forward pass needs to know about the cache (shared by all layers)."""

    k_layers: Sequence[torch.Tensor]  # per layer [rows, kv_heads, head_dim]
    v_layers: Sequence[torch.Tensor]
    write_index: torch.Tensor  # [n_new] storage rows of the valid new tokens, row-major over [B, T]
    token_valid: torch.Tensor | None  # [B, T] bool, None when every row has T new tokens
    read_index: torch.Tensor | None  # [B, L] storage rows of positions 0..L-1; None with read_start
    read_start: int | None  # B == 1 and rows contiguous: context is rows[read_start : read_start + L]
    context_len: int  # L
    # [B, 1, T, L] bool, True = may attend; None when every query may see the whole context (a
    # decode step of one sequence, or of sequences of equal length), so attention needs no mask.
    mask: torch.Tensor | None
    block_mask: Any = None  # the same mask as a FlexAttention BlockMask, when the runner asks for flex
    _folded_masks: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _windowed: dict[int, KVBatch] = field(default_factory=dict, repr=False)
    # A pool whose sliding-window layers keep their own blocks (PagedKVCachePool.local_layers): those
    # layers read and write through ``local``, the same pass over their storage rows.
    local: KVBatch | None = None
    local_layers: frozenset[int] = frozenset()
    # A ragged pass (``ModelRunner.forward(..., ragged=True)``): the activations hold only the real
    # tokens, back to back ([1, N, ...], row-major over [B, T]), and this is each one's flat index
    # in [B * T]. Attention still runs in the padded [B, T] layout (``unpack`` / ``pack``), so a
    # token's attention is computed as in a padded pass; everything row-wise runs N rows, not B * T.
    packed: torch.Tensor | None = None
    # The pass per sequence for a kernel that reads the pool itself (backends.triton_attention):
    # each sequence's first query token's index in the activations (flattened [B, T], or packed),
    # its count of new tokens and its length after the pass; as a tensor by ``seq_meta()``.
    sequences: tuple[list[int], list[int], list[int]] | None = None
    tree_mask: torch.Tensor | None = None  # [B, T, T] the pass's tree (build_kv_batch's tree_mask), or None
    # Set on a sliding-window layer's view (``windowed``) when the window hides keys: the window and
    # the queries' RoPE positions [B, T] it is measured from (the mask already applies both).
    window: int | None = None
    window_positions: torch.Tensor | None = None
    _seq_meta: torch.Tensor | None = field(default=None, repr=False)

    def seq_meta(self) -> torch.Tensor | None:
        """``sequences`` as one [3, B] int32 tensor on the pool's device, made on first use (only a
        kernel that reads the pool needs it) and shared by every layer; one tensor, so a CUDA graph
        replay refreshes it with one copy."""
        if self._seq_meta is None and self.sequences is not None:
            self._seq_meta = torch.tensor(self.sequences, dtype=torch.int32).to(self.write_index.device,
                                                                               non_blocking=True)
        return self._seq_meta

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [1, N, ...] of a ragged pass laid out as [B, T, ...], zeros at the padding."""
        assert self.packed is not None and self.token_valid is not None
        batch, width = self.token_valid.shape
        out = x.new_zeros(batch * width, *x.shape[2:])
        out[self.packed] = x[0]
        return out.view(batch, width, *x.shape[2:])

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [B, T, ...] back to a ragged pass's [1, N, ...] (its real tokens, in order)."""
        assert self.packed is not None
        return x.flatten(0, 1)[self.packed].unsqueeze(0)

    def per_token(self) -> KVBatch:
        """A ragged pass as a padded pass of N sequences of one token each: token i reads its own
        sequence's rows and its own mask row. For kernels that look a token's sequence up by its
        row (the C decoder stack); what each token sees, and in what order, is unchanged."""
        assert self.packed is not None and self.token_valid is not None and self.read_index is not None
        assert self.mask is not None  # a ragged pass has runs of different lengths, so a mask
        batch, width = self.token_valid.shape
        read = self.read_index[torch.div(self.packed, width, rounding_mode="floor")]
        mask = self.mask.reshape(batch * width, 1, 1, self.context_len)[self.packed]
        return dataclasses.replace(self, token_valid=None, read_index=read, mask=mask, packed=None,
                                   sequences=None, _seq_meta=None, tree_mask=None, _folded_masks={}, _windowed={})

    def attention_mask(self, groups: int = 1) -> torch.Tensor | None:
        """``mask`` with each query row repeated ``groups`` times ([B, 1, groups * T, L]), for
        attention that folds a KV head's query heads into the query length; made once per forward
        and shared by every layer."""
        if self.mask is None or groups == 1:
            return self.mask
        folded = self._folded_masks.get(groups)
        if folded is None:
            folded = self._folded_masks[groups] = self.mask.repeat(1, 1, groups, 1)
        return folded

    def windowed(self, window: int, positions: torch.Tensor) -> KVBatch:
        """This pass as a sliding-window layer sees it: a query at (RoPE) position p attends only to
        keys at positions ``p - window + 1 .. p`` (Hugging Face's ``kv_idx > q_idx - window``).
        ``positions`` [B, T] are the queries' positions; a tree node's is its ancestors' plus its
        depth, so its ancestors (at most ``depth`` back) stay visible. Made once per window and
        pass; the same object when the window hides nothing."""
        cached = self._windowed.get(window)
        if cached is not None:
            return cached
        key_pos = torch.arange(self.context_len, device=positions.device)
        inside = key_pos.view(1, 1, -1) > (positions - window).unsqueeze(-1)  # [B, T, L]
        if bool(inside.all()):
            view = self
        else:
            mask = inside.unsqueeze(1) if self.mask is None else self.mask & inside.unsqueeze(1)
            if self.mask is not None:
                # A padding query far past its sequence's end would see no key at all (NaN rows);
                # it keeps its causal row instead. A real query always sees itself.
                mask = mask | (self.mask & ~mask.any(-1, keepdim=True))
            # no block_mask: SDPA takes the dense mask
            local = None if self.local is None else dataclasses.replace(
                self.local, mask=mask, block_mask=None, _folded_masks={}, _windowed={}, window=window,
                window_positions=positions)
            view = dataclasses.replace(self, mask=mask, block_mask=None, _folded_masks={}, _windowed={}, local=local,
                                       window=window, window_positions=positions)
        self._windowed[window] = view
        return view

    def layer(self, index: int) -> LayerKV:
        """Layer ``index``'s storage with this pass's description: what its attention writes and reads."""
        batch = self.local if self.local is not None and index in self.local_layers else self
        return LayerKV(batch, self.k_layers[index], self.v_layers[index])


@dataclass
class LayerKV:
    """One layer's keys and values storage in one pass. A layer sees its own tensors rather than an
    index into the pool's lists, so every layer runs the same code (one compiled graph serves all)."""

    batch: KVBatch
    k_store: torch.Tensor  # [rows, kv_heads, head_dim]
    v_store: torch.Tensor

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the whole context, ``[B, kv_heads, L, head_dim]`` (views when the
        rows are contiguous)."""
        batch = self.batch
        if batch.read_start is not None:
            keys = self.k_store[batch.read_start: batch.read_start + batch.context_len].unsqueeze(0)
            values = self.v_store[batch.read_start: batch.read_start + batch.context_len].unsqueeze(0)
        else:
            assert batch.read_index is not None
            keys, values = self.k_store[batch.read_index], self.v_store[batch.read_index]
        return keys.transpose(1, 2), values.transpose(1, 2)

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store new ``[B, T, kv_heads, head_dim]`` keys/values at their rows (padding skipped), in
        place; strided views (heads sliced out of a fused projection) are read where they lie. In a
        ragged pass (``KVBatch.packed``) they are [1, N, ...]: the real tokens already."""
        if self.batch.token_valid is not None and self.batch.packed is None:
            keys, values = keys[self.batch.token_valid], values[self.batch.token_valid]
        else:
            keys, values = keys.flatten(0, 1), values.flatten(0, 1)
        self.k_store.index_copy_(0, self.batch.write_index, keys)
        self.v_store.index_copy_(0, self.batch.write_index, values)


def take_free(free: list[int], what: str) -> int:
    """Pop an id (a slot, a block) from a pool's free list; CacheFullError naming ``what`` if empty."""
    if not free:
        raise CacheFullError(f"all {what} are in use")
    return free.pop()


def kv_storage(num_layers: int, rows: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Zeroed per-layer key and value tensors of ``rows`` token rows each, the storage of every pool,
    plus one scratch row (index ``rows``) that no sequence owns: a pass padded to a fixed shape
    (``padded_kv_batch``) writes its padding tokens there and reads it for padding keys."""
    def layers() -> list[torch.Tensor]:
        return [zeroed((rows + 1, num_kv_heads, head_dim), dtype, device) for _ in range(num_layers)]

    return layers(), layers()


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor. On the CPU its pages are made resident when first written (an anonymous
    mapping, ``infer.memory.huge_zeros``): a pool sized for the whole KV budget then costs neither
    start-up time (``torch.zeros`` writes every byte: seconds for gigabytes) nor memory until
    sequences fill it, and its pages are huge where Linux gives them (attention streams the cache)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_zeros(shape, dtype)


class CachePoolProtocol(Protocol):
    """A pool of per-sequence KV caches. Slots are opaque ints handed out by ``allocate``."""

    k_layers: list[torch.Tensor]
    v_layers: list[torch.Tensor]
    device: torch.device
    max_seq_len: int
    scratch_row: int  # the storage row no sequence owns (kv_storage)

    def allocate(self) -> int: ...
    def free(self, slot: int) -> None: ...
    def seq_len(self, slot: int) -> int: ...
    def truncate_to(self, slot: int, new_len: int) -> None: ...
    def free_kv_tokens(self) -> int: ...
    def storage_rows(self, slot: int, end: int) -> torch.Tensor: ...
    def contiguous_start(self, slot: int) -> int | None: ...
    def reserve(self, slot: int, new_len: int) -> None: ...
    def kv_tokens_needed(self, slot: int | None, total_tokens: int) -> int:
        """Tokens the pool must still supply for the sequence in ``slot`` (None: not yet allocated)
        to grow to ``total_tokens`` (capped at max_seq_len): what admission reserves for it."""
        ...


@dataclasses.dataclass
class SequenceRows:
    """Where a pass of one sequence's new tokens reads and writes the cache, for a kernel that takes
    addresses (the C decoder stack's one-sequence call): the pool's stores and the storage rows of
    the sequence's positions 0 .. ``context`` - 1, the new tokens' last. No tensor is made for the
    common case: a decode step then costs its kernels, not the operators that describe them."""

    k_layers: Sequence[torch.Tensor]
    v_layers: Sequence[torch.Tensor]
    start: int  # the first new token's position
    context: int  # start + the new tokens
    read_start: int | None  # the positions lie in rows read_start + position (one run of rows); else
    rows: torch.Tensor | None  # int64 [context]: the pool's own rows (read only)


def sequence_rows(pool: CachePoolProtocol, slot: int, start: int, width: int) -> SequenceRows:
    """``build_kv_batch`` for one sequence's chain of ``width`` new tokens at ``start`` (room reserved,
    causal), as ``SequenceRows``."""
    _reserve(pool, [slot], [start], [width])
    end = start + width
    read_start = pool.contiguous_start(slot)
    rows = None if read_start is not None else pool.storage_rows(slot, end)
    return SequenceRows(pool.k_layers, pool.v_layers, start, end, read_start, rows)


def build_kv_batch(
    pool: CachePoolProtocol,
    slots: Sequence[int],
    starts: Sequence[int],
    lengths: Sequence[int],
    tree_mask: torch.Tensor | None = None,
    ragged: bool = False,
) -> KVBatch:
    """Reserve room for ``lengths[b]`` new tokens at ``starts[b]`` in each slot and describe the pass.

    Query token t of row b sits at cache position ``starts[b] + t`` and may attend to every
    position up to its own (causal). ``tree_mask`` [B, T, T] instead says which new tokens a new
    token may see (tree attention); the cached context before ``starts[b]`` is always visible.
    Sequence lengths become ``starts[b] + lengths[b]`` (the caller truncates if it keeps fewer).
    ``ragged``: the activations will hold only the real tokens (``KVBatch.packed``), when the runs
    differ in length (equal runs have no padding: the padded layout is already the packed one).
    """
    device = pool.device
    batch, width = len(slots), max(lengths)
    _reserve(pool, slots, starts, lengths)
    ends = [s + n for s, n in zip(starts, lengths, strict=True)]
    context = max(ends)
    uniform = all(n == width for n in lengths)
    read_start = pool.contiguous_start(slots[0]) if batch == 1 else None
    read_index = None
    if read_start is not None:  # one sequence in consecutive rows: no row tables to build
        write_index = torch.arange(read_start + starts[0], read_start + ends[0], device=device)
    else:
        rows = [pool.storage_rows(slot, end) for slot, end in zip(slots, ends, strict=True)]
        if batch == 1:  # the pool's rows as they are (read only)
            write_index, read_index = rows[0][starts[0]:], rows[0].unsqueeze(0)
        else:
            write_index = torch.cat([r[s:] for r, s in zip(rows, starts, strict=True)])
            read_index = torch.zeros(batch, context, dtype=torch.long, device=device)
            for b, r in enumerate(rows):
                read_index[b, : r.numel()] = r
    token_valid = None
    if not uniform:
        token_valid = torch.arange(width, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
    mask = None
    if width > 1 or tree_mask is not None or any(e != context for e in ends):
        start_t = torch.tensor(starts, device=device).unsqueeze(1)
        key_pos = torch.arange(context, device=device)
        causal = _causal_mask(start_t, width, context)
        causal &= key_pos.view(1, 1, -1) < torch.tensor(ends, device=device).view(-1, 1, 1)
        if tree_mask is not None:
            in_new = (key_pos.view(1, -1) >= start_t)  # [B, L]
            rel = (key_pos.view(1, -1) - start_t).clamp(min=0, max=width - 1)  # [B, L]
            tree_vis = tree_mask.gather(2, rel.unsqueeze(1).expand(-1, width, -1))  # [B, T, L]
            causal &= ~in_new.unsqueeze(1) | tree_vis
        mask = causal.unsqueeze(1)
    packed = token_valid.flatten().nonzero().squeeze(1) if ragged and token_valid is not None else None
    first_query = [0, *itertools.accumulate(lengths)][:batch] if packed is not None else [b * width for b in range(batch)]
    kv = KVBatch(
        k_layers=pool.k_layers, v_layers=pool.v_layers, write_index=write_index, token_valid=token_valid,
        read_index=read_index, read_start=read_start, context_len=context, mask=mask, packed=packed,
        sequences=(first_query, list(lengths), ends), tree_mask=tree_mask,
    )
    local_layers: frozenset[int] = getattr(pool, "local_layers", frozenset())
    if local_layers:  # the sliding-window layers' own rows (PagedKVCachePool)
        local_rows = [pool.local_storage_rows(slot, end)  # type: ignore[attr-defined]
                      for slot, end in zip(slots, ends, strict=True)]
        local_read = torch.full((batch, context), pool.local_scratch_row, dtype=torch.long,  # type: ignore[attr-defined]
                                device=device)
        for b, r in enumerate(local_rows):
            local_read[b, : r.numel()] = r
        kv.local = dataclasses.replace(kv, write_index=torch.cat([r[s:] for r, s in zip(local_rows, starts, strict=True)]),
                                       read_index=local_read, read_start=None, _folded_masks={}, _windowed={})
        kv.local_layers = local_layers
    return kv


def _causal_mask(starts: torch.Tensor, width: int, context: int) -> torch.Tensor:
    """[B, T, L]: query t of row b (at position ``starts[b] + t``; ``starts`` is [B, 1]) may see the
    keys at positions up to its own."""
    query_pos = starts + torch.arange(width, device=starts.device).unsqueeze(0)  # [B, T]
    return torch.arange(context, device=starts.device).view(1, 1, -1) <= query_pos.unsqueeze(-1)


def _reserve(pool: CachePoolProtocol, slots: Sequence[int], starts: Sequence[int], lengths: Sequence[int]) -> None:
    for slot, start, n in zip(slots, starts, lengths, strict=True):
        if start != pool.seq_len(slot):
            raise ValueError(f"cannot write at position {start}: slot {slot} holds {pool.seq_len(slot)} tokens "
                             "(new tokens must follow the cached ones; truncate_to first to rewrite)")
        pool.reserve(slot, start + n)


def padded_kv_batch(pool: CachePoolProtocol, slots: Sequence[int], starts: Sequence[int], width: int,
                    batch: int, context: int) -> KVBatch:
    """``build_kv_batch`` for ``width`` new tokens in each of ``slots``, in a fixed shape: ``batch``
    rows (rows past ``len(slots)`` are padding) and ``context`` keys per row, whatever the
    sequences' lengths. Padding tokens write to the pool's scratch row, and keys past a sequence's
    end read it (masked). Every tensor's shape then depends on (batch, width, context) alone, and
    nothing else in the description changes: what a captured CUDA graph needs to be replayed."""
    if getattr(pool, "local_layers", None):
        raise ValueError("fixed-shape (CUDA graph) passes over a pool with sliding-window blocks are not supported")
    if len(slots) > batch or max(starts) + width > context:
        raise ValueError(f"{len(slots)} sequences up to position {max(starts) + width} do not fit a pass of "
                         f"{batch} rows x {context} keys")
    _reserve(pool, slots, starts, [width] * len(slots))
    device = pool.device
    write = torch.full((batch, width), pool.scratch_row, dtype=torch.long, device=device)
    read = torch.full((batch, context), pool.scratch_row, dtype=torch.long, device=device)
    for b, (slot, start) in enumerate(zip(slots, starts, strict=True)):
        rows = pool.storage_rows(slot, start + width)
        read[b, : rows.numel()] = rows
        write[b] = rows[start:]
    padded_starts = torch.tensor(list(starts) + [0] * (batch - len(slots)), device=device).unsqueeze(1)
    mask = _causal_mask(padded_starts, width, context)
    padded_ends = [s + width for s in starts] + [width] * (batch - len(slots))  # padding rows read the scratch row
    return KVBatch(k_layers=pool.k_layers, v_layers=pool.v_layers, write_index=write.flatten(), token_valid=None,
                   read_index=read, read_start=None, context_len=context, mask=mask.unsqueeze(1),
                   sequences=([b * width for b in range(batch)], [width] * batch, padded_ends))


def copy_positions(pool: CachePoolProtocol, moves: Sequence[tuple[int, Sequence[int], Sequence[int]]]) -> None:
    """For each ``(slot, src_positions, dst_positions)``, copy the K/V of every layer at the source
    positions of that sequence to its destination positions (tree speculation compacts the accepted
    path this way before ``truncate_to``).

    All sequences move in one gather and one scatter per layer and tensor. Sources are read before
    anything is written, so source and destination ranges may overlap; destinations must be
    distinct and inside each sequence's current length.
    """
    src_rows: list[torch.Tensor] = []
    dst_rows: list[torch.Tensor] = []
    local_layers: frozenset[int] = getattr(pool, "local_layers", frozenset())
    local_src: list[torch.Tensor] = []
    local_dst: list[torch.Tensor] = []
    for slot, src, dst in moves:
        if len(src) != len(dst):
            raise ValueError(f"slot {slot}: {len(src)} source positions but {len(dst)} destinations")
        if not src:
            continue
        length = pool.seq_len(slot)
        if min(*src, *dst) < 0 or max(*src, *dst) >= length:
            raise ValueError(f"slot {slot}: positions must lie in [0, {length})")
        if len(set(dst)) != len(dst):
            raise ValueError(f"slot {slot}: destination positions repeat")
        rows = pool.storage_rows(slot, length)
        src_rows.append(rows[torch.tensor(list(src), device=rows.device)])
        dst_rows.append(rows[torch.tensor(list(dst), device=rows.device)])
        if local_layers:  # positions a pass just wrote: inside the window, never freed
            rows = pool.local_storage_rows(slot, length)  # type: ignore[attr-defined]
            local_src.append(rows[torch.tensor(list(src), device=rows.device)])
            local_dst.append(rows[torch.tensor(list(dst), device=rows.device)])
    if not src_rows:
        return
    shared = [i for i in range(len(pool.k_layers)) if i not in local_layers]
    for layers, sources, dests in ((shared, src_rows, dst_rows), (sorted(local_layers), local_src, local_dst)):
        if not layers:
            continue
        source, dest = torch.cat(sources), torch.cat(dests)
        for index in layers:
            for store in (pool.k_layers[index], pool.v_layers[index]):
                store.index_copy_(0, dest, store.index_select(0, source))

