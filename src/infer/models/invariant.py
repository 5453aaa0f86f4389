"""Exact-greedy mode: every token's logits are bit-identical whatever pass computes them.

A 1-token decode step, a (K+1)-row chain verification and a tree verification multiply
different numbers of rows; CPU (and GPU) matmul libraries pick their kernel, blocking and
summation order from the shape, so in bfloat16 the same token can come out a rounding apart
and a near-tie flips greedy speculation off plain decoding. This mode removes the shape from
the arithmetic (the idea of batch-invariant kernels: one reduction order whatever the batch):

* row-wise work (norms, projections, the MLP, the LM head) always runs on exactly ``rows``
  rows per call, zero-padded: one shape, so one kernel, whatever the pass;
* attention runs in float32 on ``groups * rows`` query rows per product, over the whole
  context with masked keys contributing exact zeros; the scores' order over the head dimension
  and the weighted sum's order over the keys then do not depend on the pass either. The sum
  runs over keys in cache order, so a tree node, whose ancestors sit between other nodes, sums
  the same terms in the same order as the plain step (the zeros in between change nothing);
* RoPE, residual adds and embeddings are elementwise already.

What this relies on, a product row not depending on where it sits in its fixed-shape call, on
the batch of products beside it, or on zero terms in its sum, is checked when an engine loads
(``check_invariance``) and refused where it fails. It held for oneDNN (bfloat16) and MKL
(float32) on the project's AVX-512 AMD EPYC, where the whole mode is tested; the same kernel
properties were measured on an AMX Intel Xeon (torch 2.11); CUDA is untested.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infer.cache import make_pool
from infer.cache.protocol import build_kv_batch
from infer.models.layers import DecoderLayer, DecoderOnlyLM

# Rows per matmul call: every pass is cut into (zero-padded) blocks of this many rows. 8 covers a
# decode step of up to 8 requests and a K=7 chain in one call; more rows cost more on one request.
ROWS = 8
# Keys per score product: the context is zero-padded to a multiple of this (the padding masked),
# so every score product has one shape however long the context (a few keys take another kernel).
KEY_BLOCK = 32


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
        pad = -count % self.rows
        if pad:
            flat = F.pad(flat, (0, 0, 0, pad))
        if flat.shape[0] == self.rows:
            out = self.inner(flat)
        else:
            out = torch.cat([self.inner(block) for block in flat.split(self.rows)])
        return out[:count].reshape(*x.shape[:-1], out.shape[-1])


def exact_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                    rows: int = ROWS) -> torch.Tensor:
    """Attention of q [B, heads, T, D] over keys/values [B, kv_heads, L, D] with the boolean mask
    [B, 1, T, L] (None: every key visible), in float32 with one shape per product.

    The query rows of each KV head (its ``groups`` query heads times ``rows`` positions) form one
    ``[groups * rows, D]`` block. Scores come from products with ``KEY_BLOCK`` keys at a time (the
    keys are zero-padded to a multiple of it, masked); the probabilities times ``[values | 1]``
    give the output and the softmax denominator from one product over all keys, so both sum the
    keys in cache order, where masked keys add exact zeros.
    """
    batch, heads, width, dim = q.shape
    kv_heads, context = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    block_rows = groups * rows
    if mask is None:
        mask = torch.ones(batch, 1, width, context, dtype=torch.bool, device=q.device)
    pad_rows, pad_keys = -width % rows, -context % KEY_BLOCK
    # Padded query rows see every real key (finite, dropped at the end); padded keys are hidden.
    mask = F.pad(F.pad(mask, (0, 0, 0, pad_rows), value=True), (0, pad_keys), value=False)
    q = F.pad(q.float() * dim ** -0.5, (0, 0, 0, pad_rows)).view(batch, kv_heads, groups, width + pad_rows, dim)
    # Fresh contiguous float32 copies: one layout for every call, whatever the cache's gather gave.
    keys_t = F.pad(keys.float(), (0, 0, 0, pad_keys)).view(batch, kv_heads, -1, KEY_BLOCK, dim).transpose(-1, -2)
    values_1 = F.pad(values.float(), (0, 1, 0, pad_keys), value=1.0)  # last column: ones
    span = context + pad_keys
    blocks = []
    for start in range(0, width + pad_rows, rows):
        block = q[:, :, :, start: start + rows].reshape(batch, kv_heads, 1, block_rows, dim)
        scores = torch.matmul(block, keys_t).transpose(2, 3).reshape(batch, kv_heads, block_rows, span)
        visible = mask[:, :, start: start + rows].unsqueeze(2).expand(batch, 1, groups, rows, span)
        scores.masked_fill_(~visible.reshape(batch, 1, block_rows, span), float("-inf"))
        probs = scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        summed = torch.matmul(probs, values_1)  # [B, kv_heads, groups * rows, D + 1]
        blocks.append((summed[..., :dim] / summed[..., dim:]).view(batch, kv_heads, groups, rows, dim))
    out = blocks[0] if len(blocks) == 1 else torch.cat(blocks, 3)
    return out.reshape(batch, heads, width + pad_rows, dim)[:, :, :width].to(keys.dtype)


def make_exact(model: DecoderOnlyLM, rows: int = ROWS) -> None:
    """Switch a loaded model (fused or not, packed or not) to exact-greedy kernels, in place."""
    if isinstance(model.lm_head, RowChunked):
        return  # already exact
    body = model.model
    for layer in body.layers:
        assert isinstance(layer, DecoderLayer)
        attn = layer.self_attn
        for owner, name in ((layer, "input_layernorm"), (layer, "post_attention_layernorm"),
                            (layer, "mlp"),  # the whole MLP per block, its SiLU included
                            *((attn, n) for n in ("qkv_proj", "q_proj", "k_proj", "v_proj", "o_proj",
                                                  "q_norm", "k_norm"))):
            if getattr(owner, name, None) is not None:
                setattr(owner, name, RowChunked(getattr(owner, name), rows))
        attn.attend = lambda q, k, v, mask: exact_attention(q, k, v, mask, rows)
    body.norm = RowChunked(body.norm, rows)  # type: ignore[assignment]
    model.lm_head = RowChunked(model.lm_head, rows)  # type: ignore[assignment]


@torch.inference_mode()
def check_invariance(model: DecoderOnlyLM, seed: int = 0) -> None:
    """Raise RuntimeError unless this machine gives a token's final hidden state the same bits in
    one 12-token pass, in a 6-token pass followed by 1-token steps, and as 3 rows of a batch
    beside another sequence (a few small forwards on a scratch cache)."""
    config = model.config
    device = model.model.embed_tokens.weight.device
    pool = make_pool("slotted", num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                     head_dim=config.head_dim, max_seq_len=16, max_batch_size=2, block_size=16, num_blocks=None,
                     dtype=model.model.embed_tokens.weight.dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(config.vocab_size, (12,), generator=gen).tolist()
    other = torch.randint(config.vocab_size, (5,), generator=gen).tolist()
    first, second = pool.allocate(), pool.allocate()

    def run(slots: list[int], runs: list[list[int]]) -> torch.Tensor:
        starts = [pool.seq_len(s) for s in slots]
        width = max(len(r) for r in runs)
        ids = torch.tensor([r + [0] * (width - len(r)) for r in runs], device=device)
        positions = torch.tensor(starts, device=device).unsqueeze(1) + torch.arange(width, device=device)
        return model(ids, positions, build_kv_batch(pool, slots, starts, [len(r) for r in runs]))  # type: ignore[no-any-return]

    whole = run([first], [tokens])[0]
    pool.truncate_to(first, 0)
    pieces = [run([first], [tokens[:6]])[0]] + [run([first], [tokens[i: i + 1]])[0] for i in (6, 7, 8)]
    pieces.append(run([second, first], [other, tokens[9:]])[1, :3])
    if not torch.equal(whole, torch.cat(pieces)):
        raise RuntimeError("exact_greedy: on this machine a token's hidden state depends on the shape of the pass "
                           "computing it (its matmul or attention kernels are not row-invariant), so greedy "
                           "speculation cannot be made token-identical here; run without exact_greedy")
