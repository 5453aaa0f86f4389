"""Paged attention in Triton: a pass's queries attend to keys and values read where they lie in the
KV pool, through the sequence's row table, inside the kernel (no per-layer gather of the context).

One kernel serves every kind of pass a ``KVBatch`` describes:

* decode steps (one query per sequence), prefill chunks and verification runs of several queries
  per sequence, padded ``[B, T]`` or packed back to back (a ragged pass, ``KVBatch.packed``);
* chain (causal) masks, or a tree mask over the pass's own tokens (tree verification: each node sees
  the cached context and its ancestors);
* grouped-query attention of any ratio: one program handles one KV head's query heads for a block of
  query tokens, so each key and value row is loaded once for the whole group (vLLM's unified
  attention folds the group into the rows the same way);
* sliding-window layers: a key at cache index ``n`` is visible to a query at RoPE position ``p`` when
  ``n > p - window`` (``KVBatch.windowed``'s rule);
* float32, bfloat16 and float16 storage, accumulating in float32.

Addressing: key ``n`` of sequence ``b`` is storage row ``table[b, n // block_size] * block_size +
n % block_size``. ``KVBatch.read_index`` is such a table with ``block_size`` 1 (every position's row),
and a pool's block table with its block size gives the same rows; the kernel takes either.

Query token ``i`` of sequence ``b`` sits at cache index ``seq_len[b] - query_len[b] + i`` (the pass's
tokens are the sequence's last ones, as ``build_kv_batch`` lays them out). Its output row is written
at the same flat index as its query (``query_start[b] + i``); rows of a padded pass past a run's end
are left as the caller allocated them.

Triton is imported lazily: this module imports on any machine, and ``unavailable_reason`` says why
the kernel cannot run where it cannot. Under ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors
(slowly): that is how the tests check it against PyTorch's attention without a GPU.
"""

from __future__ import annotations

import functools
import math
import os
from typing import Any

import torch

from infer.cache.protocol import LayerKV

LOG2E = 1.4426950408889634


def interpreted() -> bool:
    """Whether Triton runs kernels in its Python interpreter (``TRITON_INTERPRET=1``), on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _triton_import_error() -> str | None:
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"triton is not installed ({err})"
    return None


def unavailable_reason(device: torch.device | str) -> str | None:
    """None when the kernel can run on tensors on ``device``; otherwise why not (for a startup line)."""
    device = torch.device(device)
    missing = _triton_import_error()
    if missing is not None:
        return missing
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return "CUDA is not available"
        major, minor = torch.cuda.get_device_capability(device)
        if major < 8:  # the kernel's bfloat16 tiles need Ampere's tensor cores
            return f"the Triton kernel needs compute capability 8.0 or newer (this GPU has {major}.{minor})"
        return None
    if device.type == "cpu" and interpreted():
        return None
    return f"the Triton kernel runs on CUDA (or on the CPU under TRITON_INTERPRET=1), not on {device.type}"


@functools.cache
def _kernel() -> Any:
    """The kernel, defined on first use so that importing this module never needs Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def paged_attention_kernel(
        out_ptr, q_ptr, k_ptr, v_ptr, table_ptr, meta_ptr, tree_ptr, pos_ptr,
        stride_ot, stride_oh, stride_qt, stride_qh, stride_kr, stride_kh, stride_vr, stride_vh,
        stride_tb, stride_meta, stride_mb, stride_mi, stride_pb, stride_pi,
        block_size, window, qk_scale,
        HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TREE: tl.constexpr, WINDOW: tl.constexpr,
        POSITIONS: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        first = tl.program_id(2) * BLOCK_Q  # this program's first query token of the sequence
        q_start = tl.load(meta_ptr + seq)
        q_len = tl.load(meta_ptr + stride_meta + seq)
        seq_len = tl.load(meta_ptr + 2 * stride_meta + seq)
        if first < q_len:
            ctx_start = seq_len - q_len  # cache index of the pass's first token of this sequence
            # Row r of the tile is query token first + r // GROUP under query head kv_head * GROUP + r % GROUP.
            rows = tl.arange(0, BLOCK_M)
            tok = first + rows // GROUP
            head = kv_head * GROUP + rows % GROUP
            row_ok = (rows < BLOCK_Q * GROUP) & (tok < q_len)
            dims = tl.arange(0, DIM_PAD)
            dim_ok = dims < HEAD_DIM
            q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                        mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
            if DOT_F32:
                q = q.to(tl.float32)
            q_index = ctx_start + tok  # the queries' cache indexes
            last = tl.minimum(q_len, first + BLOCK_Q)  # one past this program's last query token
            # A tree node may see any earlier node of the pass its mask names; a chain nothing past its last query.
            hi = seq_len if TREE else ctx_start + last
            lo = 0
            if WINDOW:
                if POSITIONS:
                    q_pos = tl.load(pos_ptr + seq * stride_pb + tok * stride_pi, mask=row_ok, other=0)
                else:
                    q_pos = q_index
                lowest = tl.min(tl.where(row_ok, q_pos, 2147483647), axis=0)
                lo = tl.maximum(lowest - window + 1, 0)
                lo = (lo // BLOCK_N) * BLOCK_N

            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
            for start in range(lo, hi, BLOCK_N):
                keys = start + tl.arange(0, BLOCK_N)
                key_ok = keys < hi
                block = tl.load(table_ptr + seq * stride_tb + keys // block_size, mask=key_ok, other=0)
                # A freed window block may read as a negative id: its rows are masked, so read row 0.
                storage = tl.maximum(block * block_size + keys % block_size, 0)
                kv_mask = key_ok[:, None] & dim_ok[None, :]
                k = tl.load(k_ptr + storage[:, None] * stride_kr + kv_head * stride_kh + dims[None, :],
                            mask=kv_mask, other=0.0)
                if DOT_F32:
                    k = k.to(tl.float32)
                scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
                visible = row_ok[:, None] & key_ok[None, :]
                if TREE:
                    in_pass = keys >= ctx_start
                    node = tl.where(in_pass, keys - ctx_start, 0)
                    tree = tl.load(tree_ptr + seq * stride_mb + tok[:, None] * stride_mi + node[None, :],
                                   mask=visible & in_pass[None, :], other=0)
                    visible = visible & (~in_pass[None, :] | (tree != 0))
                else:
                    visible = visible & (keys[None, :] <= q_index[:, None])
                if WINDOW:
                    visible = visible & (keys[None, :] > q_pos[:, None] - window)
                scores = tl.where(visible, scores, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(scores, axis=1))
                # Rows that have seen no visible key yet keep a finite reference (exp2(-inf) = 0).
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                p = tl.math.exp2(scores - m_ref[:, None])
                alpha = tl.math.exp2(m_i - m_ref)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                v = tl.load(v_ptr + storage[:, None] * stride_vr + kv_head * stride_vh + dims[None, :],
                            mask=kv_mask, other=0.0)
                p_in = p.to(v_ptr.dtype.element_ty)  # the probabilities in the cache's precision, as SDPA
                if DOT_F32:
                    p_in, v = p_in.to(tl.float32), v.to(tl.float32)
                acc = acc * alpha[:, None] + tl.dot(p_in, v, input_precision=PRECISION)
                m_i = m_new
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(out_ptr + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])

    return paged_attention_kernel


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def paged_attention(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    table: torch.Tensor,
    block_size: int,
    meta: torch.Tensor,
    max_query_len: int,
    *,
    tree_mask: torch.Tensor | None = None,
    window: int | None = None,
    positions: torch.Tensor | None = None,
    scale: float | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [N, heads, head_dim] (every sequence's query tokens, flat) over the KV pool.

    ``k_store``/``v_store`` [rows, kv_heads, head_dim]: one layer's storage. ``table`` [B, blocks]:
    sequence b's storage blocks in order, ``block_size`` rows each (``KVBatch.read_index`` with 1).
    ``meta`` [3, B] int32: each sequence's first query's row in ``q``, its query count and its length
    after this pass (``KVBatch.seq_meta()``). ``max_query_len`` bounds the query counts (the grid).
    ``tree_mask`` [B, T, T] bool: which of the pass's tokens each may see (None: causal).
    ``window``: a sliding-window layer's window, applied at ``positions`` [B, T] (the queries' RoPE
    positions, padded layout; None: their cache indexes). ``scale`` defaults to 1/sqrt(head_dim).
    Returns ``out`` (allocated like ``q`` when None; rows no query owns are left untouched).
    """
    tokens, heads, head_dim = q.shape
    kv_heads = k_store.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not divide into {kv_heads} KV heads")
    if k_store.shape != v_store.shape or k_store.shape[2] != head_dim:
        raise ValueError(f"keys {tuple(k_store.shape)} and values {tuple(v_store.shape)} do not match "
                         f"queries of head_dim {head_dim}")
    if q.dtype != k_store.dtype or v_store.dtype != k_store.dtype:
        raise ValueError(f"queries are {q.dtype} but the cache is {k_store.dtype}/{v_store.dtype}")
    if meta.dtype != torch.int32 or meta.dim() != 2 or meta.shape[0] != 3:
        raise ValueError(f"meta must be [3, B] int32, got {tuple(meta.shape)} {meta.dtype}")
    for name, t in (("q", q), ("k_store", k_store), ("v_store", v_store)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}'s head_dim must be contiguous (stride 1), got stride {t.stride(-1)}")
    if out is None:
        out = torch.empty_like(q)
    batch = meta.shape[1]
    constants = kernel_constants(q.dtype, heads, kv_heads, head_dim, max_query_len, tree=tree_mask is not None,
                                 window=window is not None, positions=positions is not None)
    if tree_mask is not None:
        tree = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
        tree_strides = (tree.stride(0), tree.stride(1))
        if tree.stride(2) != 1:
            raise ValueError("tree_mask's last dimension must be contiguous")
    else:
        tree, tree_strides = meta, (0, 0)  # never read
    pos = positions if positions is not None else meta
    pos_strides = (positions.stride(0), positions.stride(1)) if positions is not None else (0, 0)
    grid = (batch, kv_heads, math.ceil(max_query_len / constants["BLOCK_Q"]))
    _kernel()[grid](
        out, q, k_store, v_store, table, meta, tree, pos,
        out.stride(0), out.stride(1), q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1),
        v_store.stride(0), v_store.stride(1), table.stride(0), meta.stride(0), *tree_strides, *pos_strides,
        block_size, window or 0, (scale if scale is not None else head_dim ** -0.5) * LOG2E, **constants,
    )
    return out


def kernel_constants(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, max_query_len: int, *,
                     tree: bool, window: bool, positions: bool) -> dict[str, Any]:
    """The kernel's compile-time parameters for a pass of this shape (each set is one compiled kernel)."""
    group = heads // kv_heads
    dim_pad = max(16, _next_power_of_2(head_dim))
    # Tiles of 64 rows while a row is at most 256 bytes (bfloat16 at head dim 128), fewer for wider
    # rows, so the pipelined K/V tiles fit the shared memory of every CUDA card since sm_80 (the tests
    # compile the widest for sm_90 and check).
    row_bytes = dim_pad * dtype.itemsize
    rows = 64 if row_bytes <= 256 else 32 if row_bytes <= 512 else 16
    # Tokens per program: enough rows for the tensor cores' tile (16) without wasting them on decode.
    block_q = max(1, min(_next_power_of_2(max_query_len), max(1, rows // group)))
    # Triton's interpreter multiplies bfloat16 tiles as raw integers (numpy has no bfloat16): there the
    # operands go in as float32, which holds every bfloat16 value and product exactly.
    dot_f32 = interpreted() and dtype == torch.bfloat16
    return dict(HEAD_DIM=head_dim, DIM_PAD=dim_pad, GROUP=group, BLOCK_Q=block_q,
                BLOCK_M=max(16, _next_power_of_2(block_q * group)), BLOCK_N=rows,
                TREE=tree, WINDOW=window, POSITIONS=positions,
                PRECISION="ieee" if dtype == torch.float32 or dot_f32 else "tf32", DOT_F32=dot_f32)


def attend(q: torch.Tensor, kv: LayerKV, scale: float | None = None) -> torch.Tensor:
    """A layer's attention over its ``LayerKV`` (after ``kv.write``): ``q`` [B, T, heads, head_dim],
    or a ragged pass's packed [1, N, heads, head_dim]; returns the output in the same layout. The
    pass's description (``KVBatch.seq_meta()``, its row table, tree mask and window) goes to the
    kernel as it is: no context is gathered and no mask is expanded."""
    batch = kv.batch
    meta = batch.seq_meta()
    if meta is None:
        raise ValueError("this KVBatch does not describe its sequences (made by neither build_kv_batch nor "
                         "padded_kv_batch)")
    k_store, v_store = kv.k_store, kv.v_store
    if batch.read_index is not None:
        table, block_size = batch.read_index, 1
    else:  # one sequence in consecutive rows from read_start: one "block" as long as the context
        assert batch.read_start is not None
        k_store, v_store = k_store[batch.read_start:], v_store[batch.read_start:]
        table, block_size = meta.new_zeros(1, 1), max(1, batch.context_len)
    flat = q.flatten(0, 1)
    # A padded pass's rows past a run's end have no query: zeros there, as the padding's output.
    out = torch.zeros_like(flat) if batch.token_valid is not None and batch.packed is None else None
    width = batch.token_valid.shape[1] if batch.token_valid is not None else q.shape[1]
    result = paged_attention(flat, k_store, v_store, table, block_size, meta, width,
                             tree_mask=batch.tree_mask, window=batch.window, positions=batch.window_positions,
                             scale=scale, out=out)
    return result.view(q.shape)
