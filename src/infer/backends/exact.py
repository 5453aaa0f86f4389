"""Exact-greedy mode: every token's logits are bit-identical whatever pass computes them.

A 1-token decode step, a (K+1)-row chain verification and a tree verification multiply
different numbers of rows; CPU (and GPU) matmul libraries pick their kernel, blocking and
summation order from the shape, so in bfloat16 the same token can come out a rounding apart
and a near-tie flips greedy speculation off plain decoding. This mode removes the shape from
the arithmetic (the idea of batch-invariant kernels: one reduction order whatever the batch):

* row-wise work (norms, projections, the MLP, the LM head) always runs on exactly ``rows``
  rows per call, zero-padded: one shape, so one kernel, whatever the pass;
* attention runs in float32 with the keys cut into fixed blocks from position 0: each product
  is a tile of ``groups * rows`` query rows times one block, and the blocks' shares are summed
  in block order (a single product over all keys would not do: its kernel splits the keys by
  their count, so masked keys after a row's own, as in a batch or a chain, move the split).
  A tree node's visible keys (its ancestors sit between other nodes) are first packed to the
  front, so it sees a decode step's blocks;
* RoPE, residual adds and embeddings are elementwise already.

Where the C decoder stack runs (``backends.cpu_kernels.CpuStack``: AVX-512 CPUs) none of this is needed: its
kernels, the LM head's and the final norm's compute each token alone already, so the mode only
lets them take every pass (prefill and large batches too, which by default go to oneDNN).

What this relies on, a product's row or column not depending on where it sits in its
fixed-shape call or on the batch of products beside it, and ``cumsum`` adding in order, is
checked when an engine loads (``check_invariance``), which refuses a machine where it fails.
The mode is tested on the project's AVX-512 AMD EPYC (oneDNN bfloat16, MKL float32); on an AMX
Intel Xeon the fixed-shape products measured row- and batch-invariant too (the mode itself was
not run there); CUDA is untested.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infer.backends.backend import backend_of
from infer.cache import make_pool
from infer.cache.protocol import build_kv_batch
from infer.kernels.cpu import GemvLinear
from infer.models.layers import DecoderLayer, DecoderOnlyLM
from infer.models.quantized import QuantLinear

# Rows per matmul call: every pass is cut into (zero-padded) blocks of this many rows. 8 covers a
# decode step of up to 8 requests and a K=7 chain in one call; more rows cost more on one request.
ROWS = 8
# Attention: the keys are padded to whole blocks of this many (masked), and the weighted sum over
# them is one product per block, the blocks' results added in order.
KEY_BLOCK = 64
# Attention tiles hold at least this many query rows (a KV head's query heads times positions):
# 1-row products take vector kernels whose sums changed with the number of products in a batch
# (on an AMX Intel Xeon); more rows per tile only waste work on a decode step's one position.
MIN_TILE_ROWS = 4


class RowChunked(nn.Module):
    """Applies a row-wise module to blocks of exactly ``rows`` rows, zero-padding the last.

    "Row-wise" means each output row depends only on its input row (a norm, a projection, the
    MLP), so cutting the rows changes nothing but the shape every kernel inside sees.
    """

    def __init__(self, inner: nn.Module, rows: int = ROWS) -> None:
        super().__init__()
        self.inner = inner
        self.rows = rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        count = flat.shape[0]
        if count == 0:
            return self.inner(x)  # type: ignore[no-any-return]
        pad = -count % self.rows
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        if flat.shape[0] == self.rows:
            out = self.inner(flat)
        else:
            out = torch.cat([self.inner(block) for block in flat.split(self.rows)])
        return out[:count].reshape(*x.shape[:-1], out.shape[-1])


def exact_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention of q [B, heads, T, D] over keys/values [B, kv_heads, L, D] with the boolean mask
    [B, 1, T, L] (None: every key visible), in float32, every product of one fixed shape.

    A tile holds the query rows of one KV head: its ``groups`` query heads at a few positions
    (``MIN_TILE_ROWS`` rows or more). A row's keys are its visible ones in cache order: positions
    0..p for a decode step or a chain; a tree node's ancestors sit between other nodes, so its
    visible keys are first packed to the front (its *logical* keys, which are a decode step's).
    Scores are one product of a tile with all keys (the keys are padded to whole ``KEY_BLOCK``s,
    so no product is narrow); after the row's softmax maximum, the probabilities times
    ``[values | 1]`` give the output and the denominator one key block at a time, and the blocks'
    shares are added in block order (``cumsum``, which adds in order). One product over all keys
    would not do: its kernel splits long sums by their length, so a row followed by masked keys
    (a chain's later rows, a longer sequence in the batch) would be summed in another order.
    """
    batch, heads, width, dim = q.shape
    kv_heads, context = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    positions = -(-MIN_TILE_ROWS // groups)  # query positions per tile
    tile = groups * positions
    if mask is None:
        mask = torch.ones(batch, 1, width, context, dtype=torch.bool, device=q.device)
    pad_rows, pad_keys = -width % positions, -context % KEY_BLOCK
    # Padded query rows see every real key (finite, dropped at the end); padded keys are hidden.
    mask = F.pad(F.pad(mask, (0, 0, 0, pad_rows), value=True), (0, pad_keys), value=False)
    span = context + pad_keys
    seen = mask.sum(-1)  # [B, 1, T']: each row's visible key count
    key_index = torch.arange(span, device=q.device)
    prefix = torch.equal(mask, key_index < seen.unsqueeze(-1))  # no tree node: every row sees a prefix
    query = F.pad(q.float() * dim ** -0.5, (0, 0, 0, pad_rows)).view(batch, kv_heads, groups, -1, positions, dim)
    query = query.transpose(2, 3).reshape(batch, kv_heads, -1, tile, dim)  # tile row = head * positions + position
    # Fresh contiguous float32 copies (one layout for every call, whatever the cache's gather gave);
    # the padded keys are zeros, and the values get a last column of ones: the softmax denominator.
    keys_32 = keys.new_zeros(batch, kv_heads, span, dim, dtype=torch.float32)
    keys_32[:, :, :context] = keys
    keys_t = keys_32.unsqueeze(2).transpose(-1, -2)  # [B, kv_heads, 1, D, span]
    values_1 = values.new_ones(batch, kv_heads, span, dim + 1, dtype=torch.float32)
    values_1[:, :, :context, :dim] = values
    slab = max(1, (1 << 14) // span)  # tiles per step: bounds the keys' broadcast copies in long prefills
    shares = []
    for first in range(0, query.shape[2], slab):
        tiles = query[:, :, first: first + slab]
        n = tiles.shape[2]
        rows = slice(first * positions, (first + n) * positions)
        scores = torch.matmul(tiles, keys_t)  # [B, kv_heads, n, tile, span]
        if prefix:
            count = seen[:, :, rows].view(batch, 1, n, 1, positions).expand(-1, -1, -1, groups, -1)
            scores.masked_fill_(key_index >= count.reshape(batch, 1, n, tile, 1), float("-inf"))
            probs = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
            share = _by_key_blocks(probs, values_1.unsqueeze(2)).view(batch, kv_heads, n, groups, positions, dim + 1)
            shares.append(share.transpose(2, 3).reshape(batch, kv_heads, groups, n * positions, dim + 1))
        else:
            shares.append(_packed_rows_share(scores, values_1, mask[:, :, rows], seen[:, :, rows], groups))
    summed = shares[0] if len(shares) == 1 else torch.cat(shares, 3)
    out = summed[..., :dim] / summed[..., dim:]  # [B, kv_heads, groups, T', D]
    return out.reshape(batch, heads, width + pad_rows, dim)[:, :, :width].to(keys.dtype)


def _by_key_blocks(probs: torch.Tensor, values_1: torch.Tensor) -> torch.Tensor:
    """``probs [..., tile, span] @ values_1 [..., span, D + 1]`` as one product per key block,
    the blocks' results added in block order."""
    *lead, tile, span = probs.shape
    blocks = probs.view(*lead, tile, span // KEY_BLOCK, KEY_BLOCK).transpose(-3, -2)  # [..., blocks, tile, KEY_BLOCK]
    block_values = values_1.view(*values_1.shape[:-2], span // KEY_BLOCK, KEY_BLOCK, values_1.shape[-1])
    return torch.matmul(blocks, block_values).cumsum(-3).select(-3, -1)


def _packed_rows_share(scores: torch.Tensor, values_1: torch.Tensor, mask: torch.Tensor, seen: torch.Tensor,
                       groups: int) -> torch.Tensor:
    """``exact_attention``'s output and denominator [B, kv_heads, groups, rows, D + 1] for rows whose
    visible keys are first packed to the front (a tree pass). ``scores`` [B, kv_heads, n, tile, span]
    are in cache order; each row's scores and values are gathered into its logical order, and each
    row is multiplied in a tile of its own (its heads at the tile's first position, zeros elsewhere),
    so its products and sums are those of a decode step."""
    batch, kv_heads, n, tile, span = scores.shape
    positions, width, dim_1 = tile // groups, mask.shape[2], values_1.shape[-1]
    order = torch.sort((~mask).byte(), dim=-1, stable=True).indices  # [B, 1, rows, span]: visible keys first
    per_row = scores.view(batch, kv_heads, n, groups, positions, span).permute(0, 1, 3, 2, 4, 5)
    per_row = per_row.reshape(batch, kv_heads, groups, width, span).gather(4, order.unsqueeze(2).expand(-1, kv_heads, groups, -1, -1))
    per_row.masked_fill_(torch.arange(span, device=scores.device) >= seen.view(batch, 1, 1, width, 1), float("-inf"))
    probs = per_row.sub_(per_row.amax(-1, keepdim=True)).exp_()  # [B, kv_heads, groups, rows, span]
    alone = probs.new_zeros(batch, kv_heads, width, groups, positions, span)
    alone[:, :, :, :, 0] = probs.transpose(2, 3)
    index = order.view(batch, 1, width, span, 1).expand(-1, kv_heads, -1, -1, dim_1)
    logical_values = values_1.unsqueeze(2).expand(-1, -1, width, -1, -1).gather(3, index)
    share = _by_key_blocks(alone.view(batch, kv_heads, width, tile, span), logical_values)
    return share.view(batch, kv_heads, width, groups, positions, dim_1)[:, :, :, :, 0].transpose(2, 3)


def make_attention_exact(model: DecoderOnlyLM) -> None:
    """Only attention's part of the mode: ``exact_attention`` in every layer. A model whose other
    row-wise work computes a row alike whatever the pass (the quantized kernels, the C norms) needs
    nothing else for a token to get the same bits in a decode step and in any verification pass;
    PyTorch's own attention does not (measured: its float32 SDPA on the CPU gives a token other bits
    in a 72-row pass than in a decode step)."""
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)
        layer.self_attn.attend = exact_attention


def make_exact(model: DecoderOnlyLM, rows: int = ROWS) -> None:
    """Switch a loaded model (fused or not, packed or not) to exact-greedy kernels, in place: its
    row-wise modules wrapped in ``RowChunked`` and ``exact_attention`` as its attention function."""
    if isinstance(model.model.norm, RowChunked):
        return  # already exact
    stack = backend_of(model).cpu_stack
    if stack is not None and (isinstance(model.lm_head, GemvLinear)
                              or (stack.quantized and isinstance(model.lm_head, QuantLinear))):
        # The C stack, the LM head's kernel (streaming or quantized) and the final norm's compute a
        # row alike whatever the row count: only their row limits (above which passes go to oneDNN)
        # need lifting.
        stack.max_rows = None
        if isinstance(model.lm_head, GemvLinear):
            model.lm_head.max_rows = None
        return
    body = model.model
    for layer in body.layers:
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        for owner, name in ((layer, "input_layernorm"), (layer, "post_attention_layernorm"),
                            (layer, "mlp"),  # the whole MLP per block, its SiLU included
                            *((attn, n) for n in ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                                                  "q_norm", "k_norm"))):
            module = getattr(owner, name, None)
            if module is not None and not isinstance(module, QuantLinear):  # the quantized kernels are row-invariant
                setattr(owner, name, RowChunked(module, rows))
        attn.attend = exact_attention
    body.norm = RowChunked(body.norm, rows)  # type: ignore[assignment]
    if not isinstance(model.lm_head, QuantLinear):
        model.lm_head = RowChunked(model.lm_head, rows)  # type: ignore[assignment]


# Models whose kernels passed check_invariance in this process, by what picks the kernels: the
# architecture, its shapes, the dtype, the device and the projections' module types (not the weights).
_VERIFIED: set[tuple[str, ...]] = set()


@torch.inference_mode()
def check_invariance(model: DecoderOnlyLM, seed: int = 0) -> None:
    """Raise RuntimeError unless this machine gives each of 72 tokens' final hidden states the same
    bits in one 72-token pass as in a 64-token pass, three 1-token steps and a 5-row pass batched
    with a longer sequence (a few forwards on a scratch cache, at load; it crosses a key block).
    Runs once per process for models of the same shapes, dtype, device and module types."""
    config = model.config
    # The run dtype and device: the first float parameter (a quantized embedding holds blocks, not one).
    weight = next(p for p in model.parameters() if p.is_floating_point())
    kinds = sorted({type(m).__name__ for m in model.modules()})
    signature = (type(model).__name__, repr(config), str(weight.dtype), str(weight.device), *kinds)
    if signature in _VERIFIED:
        return
    pool = make_pool("slotted", num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                     head_dim=config.head_dim, max_seq_len=104, max_batch_size=2, block_size=16, num_blocks=None,
                     dtype=weight.dtype, device=weight.device)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab_size, (72,), generator=gen).tolist()
    other = torch.randint(config.vocab_size, (100,), generator=gen).tolist()
    first, second = pool.allocate(), pool.allocate()
    backend = backend_of(model)

    def run(slots: list[int], runs: list[list[int]]) -> torch.Tensor:
        starts = [pool.seq_len(s) for s in slots]
        width = max(len(r) for r in runs)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in runs], device=weight.device)
        positions = torch.tensor(starts, device=weight.device).unsqueeze(1) + torch.arange(width, device=weight.device)
        return backend.forward(model, ids, positions, build_kv_batch(pool, slots, starts, [len(r) for r in runs]))

    whole = run([first], [tokens])[0]
    pool.truncate_to(first, 0)
    pieces = [run([first], [tokens[:64]])[0]] + [run([first], [tokens[i: i + 1]])[0] for i in (64, 65, 66)]
    pieces.append(run([second, first], [other, tokens[67:]])[1, :5])
    if not torch.equal(whole, torch.cat(pieces)):
        raise RuntimeError("exact_greedy: on this machine a token's hidden state depends on the shape of the pass "
                           "computing it (its matmul or attention kernels are not row-invariant), so greedy "
                           "speculation cannot be made token-identical here; run without exact_greedy")
    _VERIFIED.add(signature)
