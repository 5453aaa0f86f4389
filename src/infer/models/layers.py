"""Building blocks shared by every decoder-only architecture (Llama, Qwen2, Qwen3).

Module names match Hugging Face's, so a checkpoint's state dict loads as it is and a trained model
saves to the same names. This is the math only: what runs it fast (oneDNN-packed weights, the C
kernels, the whole decoder stack in one call, exact-greedy and compiled modes) is an execution
backend (``infer.backends``) that prepares a loaded model and runs its forward passes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from infer.cache.protocol import KVBatch, LayerKV
from infer.models.block import LLAMA_BLOCK, BlockSpec
from infer.models.config import CheckpointError, ModelConfig
from infer.models.quantized import QuantLinear

# enable_gqa arrived in torch 2.5; older versions repeat K/V heads instead.
_SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like the reference implementation, then cast back. The mean of
        # squares is sum / dim: bit-identical to ``mean`` (which is exactly that) at a fraction of
        # its CPU cost, and F.rms_norm is no faster here (on CPU it decomposes into the same steps)
        # and not exact in half precision (it applies the weight before rounding).
        dtype = x.dtype
        x32 = x.float()
        inv_rms = x32.pow(2).sum(-1, keepdim=True).div_(x.shape[-1]).add_(self.eps).rsqrt_()
        return self.weight * (x32 * inv_rms).to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies, including the ``llama3`` and ``linear`` scaling variants."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq.float()
    if kind == "linear":
        return (inv_freq / float(scaling["factor"])).float()
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled).float()
    raise CheckpointError(f"config.json: rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[B, T, 1, head_dim]`` for explicit (possibly non-contiguous) positions, made
    once per forward and shared by every layer. The first half of ``sin`` is negated: that is the
    sign ``rotate_half`` gives the first half of its output, so ``apply_rope`` only swaps halves."""
    freqs = positions.float().unsqueeze(-1) * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[..., : freqs.shape[-1]].neg_()
    return emb.cos().to(dtype).unsqueeze(2), sin.to(dtype).unsqueeze(2)


class RopeTables:
    """``rope_cos_sin``'s rows for positions 0 .. n - 1, made once per ``inv_freq`` and dtype (grown
    by doubling) and gathered for a pass's positions, on the CPU: a decode step then runs two index
    operators where ``rope_cos_sin`` runs a dozen, and on the CPU the operators around a step's C
    call cost more than their arithmetic. Every CPU pass of a model reads its rows here, so a
    position gets the same values in any pass. Other devices compute them (a CUDA graph captures that)."""

    def __init__(self) -> None:
        self._tables: dict[tuple[torch.dtype, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, inv_freq: torch.Tensor, positions: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.device.type != "cpu" or positions.numel() == 0 or torch.compiler.is_compiling():
            return rope_cos_sin(inv_freq, positions, dtype)
        cos, sin = self.rows(inv_freq, int(positions.max()) + 1, dtype)
        return cos[positions].unsqueeze(-2), sin[positions].unsqueeze(-2)

    def rows(self, inv_freq: torch.Tensor, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables [n, head_dim] (contiguous) of positions 0 .. n - 1, n >= ``end``
        (``inv_freq`` on the CPU)."""
        key = (dtype, inv_freq.data_ptr())
        tables = self._tables.get(key)
        if tables is None or tables[0].shape[0] < end:
            size = max(end, 256, 0 if tables is None else 2 * tables[0].shape[0])
            cos, sin = rope_cos_sin(inv_freq, torch.arange(size).unsqueeze(0), dtype)
            tables = self._tables[key] = (cos[0, :, 0].contiguous(), sin[0, :, 0].contiguous())
        return tables


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, T, heads, head_dim]; cos/sin from ``rope_cos_sin``. Computes the reference
    ``x * cos + rotate_half(x) * sin`` bit for bit (negating a factor does not change a product's
    rounding) with one roll instead of rotate_half's slices, negation and concatenation."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=config.qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=config.o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.window = config.layer_window(layer_idx)  # sliding-window attention (Mistral): how far back it sees
        # The scores' scale; None: 1/sqrt(head_dim). A family whose block scales otherwise
        # (``BlockSpec.query_scale``) sets it, and what runs the layers another way reads it here.
        self.scale: float | None = None

        self.qkv_proj: nn.Linear | None = None  # set by fuse(): one matmul instead of three
        # Attention over the cache (q [B, heads, T, D], keys, values, mask) in place of SDPA/FlexAttention:
        # the one hook for another attention function (backends.exact: rows independent of the pass's shape).
        self.attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
        # Attention that reads the cache where it lies (q [B, T, heads, D] or a ragged pass's [1, N, ...],
        # the layer's LayerKV, the scale; None: 1/sqrt(D)): set by a backend with a paged-attention
        # kernel (backends.triton_attention on CUDA); no context is gathered. ``attend`` comes first.
        self.paged_attention: Callable[[torch.Tensor, LayerKV, float | None], torch.Tensor] | None = None
        # FlexAttention for tree masks (q, k, v, block_mask=, enable_gqa=): a backend sets its compiled
        # form (CUDA); None: the eager one, a slow reference.
        self.flex_attention: Callable[..., torch.Tensor] | None = None

    def fuse(self) -> None:
        """Merge q/k/v into one projection for inference (fewer, larger matmuls; same math)."""
        self.qkv_proj = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])

    def rotate_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the q and k heads of the fused projection's output ``qkv`` [B, T, heads + 2 * kv_heads,
        head_dim]: [B, T, heads + kv_heads, head_dim]."""
        return apply_rope(qkv[:, :, : self.num_heads + self.num_kv_heads], cos, sin)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None) -> torch.Tensor:
        batch, width, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None:
            # Heads stay views of the one projection output: q and k are rotated together, and
            # k and v are written to the cache straight from their rows (no split copies).
            qkv = self.qkv_proj(x).view(batch, width, heads + 2 * kv_heads, self.head_dim)
            if self.q_norm is None:
                qk = self.rotate_qk(qkv, cos, sin)
                q, k = qk[:, :, :heads], qk[:, :, heads:]
            else:
                q, k = qkv[:, :, :heads], qkv[:, :, heads: heads + kv_heads]
            v = qkv[:, :, heads + kv_heads:]
        else:
            q = self.q_proj(x).view(batch, width, heads, self.head_dim)
            k = self.k_proj(x).view(batch, width, kv_heads, self.head_dim)
            v = self.v_proj(x).view(batch, width, kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        elif self.qkv_proj is None:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is None and self.window is not None:  # whole sequence, causal within the window
            window_mask = torch.ones(width, width, dtype=torch.bool, device=x.device).tril().triu(1 - self.window)
            out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window_mask, False)
        elif kv is None:  # whole sequence at once (training, reference): plain causal attention
            out = _sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, True)
        elif self.paged_attention is not None and self.attend is None:
            kv.write(k, v)
            out = self.paged_attention(q, kv, None).transpose(1, 2)
        else:
            kv.write(k, v)
            keys, values = kv.gather()
            shared = kv.batch
            if shared.packed is not None:  # a ragged pass: attention runs in the padded layout
                q = shared.unpack(q)
            if self.attend is not None:
                out = self.attend(q.transpose(1, 2), keys, values, shared.mask)
            elif shared.block_mask is not None:
                out = flex_attention_with(shared.block_mask, q.transpose(1, 2), keys, values, self.flex_attention)
            else:
                groups = heads // kv_heads
                out = _sdpa(q.transpose(1, 2), keys, values, shared.attention_mask(1), False,
                            shared.attention_mask(groups) if groups > 1 else None)
            if shared.packed is not None:
                out = shared.pack(out.transpose(1, 2)).transpose(1, 2)
        return self.o_proj(out.transpose(1, 2).reshape(batch, width, -1))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool,
          folded_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of q [B, heads, T, D] over k/v [B, kv_heads, L, D]; ``mask`` [B, 1, T, L] or None
    (everything visible). ``folded_mask`` is the mask with every row repeated per query head of a
    KV head ([B, 1, groups * T, L]), when the caller already has it."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and not causal and q.dtype != torch.float32:
        # GQA in half precision: fold each KV head's query heads into the query length, so attention
        # runs once per KV head over groups * T rows. Same products; on CPU a decode step's bfloat16
        # attention gets ~6x faster (the kernel splits work by query rows, and one row per head is
        # its worst case). float32 keeps enable_gqa: exact-parity tests use it.
        batch, heads, width, dim = q.shape
        if folded_mask is None and mask is not None:
            folded_mask = mask.repeat(1, 1, groups, 1)
        folded = q.reshape(batch, k.shape[1], groups * width, dim)
        return F.scaled_dot_product_attention(folded, k, v, attn_mask=folded_mask).view(batch, heads, width, dim)
    if groups > 1:
        if _SDPA_HAS_GQA:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=True)
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


def flex_available() -> bool:
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def block_mask_from(mask: torch.Tensor) -> Any:
    """A FlexAttention ``BlockMask`` for a dense ``[B, 1, T, L]`` boolean mask (tree verification)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, _, width, context = mask.shape

    def mask_mod(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return mask[b, 0, q, k]

    return create_block_mask(mask_mod, batch, None, width, context, device=mask.device)


def flex_attention_with(block_mask: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        kernel: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """FlexAttention under ``block_mask``: ``kernel`` (a backend's compiled form), else the eager one."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():  # eager flex warns that it is unfused; that is known and intended off CUDA
        warnings.simplefilter("ignore", UserWarning)
        out = (kernel or flex_attention)(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])
    return out  # type: ignore[no-any-return]


class MLP(nn.Module):
    """SwiGLU feed-forward."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.gate_up_proj: nn.Linear | None = None  # set by fuse()

    def fuse(self) -> None:
        self.gate_up_proj = _fuse_linears([self.gate_proj, self.up_proj])

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation on the fused projection's output [..., 2 * intermediate]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            return self.down_proj(self.activate(self.gate_up_proj(x)))
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear computing all of ``linears`` side by side. The fused weight is a new tensor, so the
    originals are dropped afterwards (``DecoderOnlyLM.fuse_projections``) to keep memory flat.
    Quantized projections concatenate their blocks instead (``models.quantized``)."""
    first = linears[0]
    if isinstance(first, QuantLinear):
        return QuantLinear.fused(linears)  # type: ignore[arg-type,return-value]
    fused = nn.Linear(first.in_features, sum(m.out_features for m in linears), bias=first.bias is not None,
                      device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([m.weight for m in linears]))
        if fused.bias is not None:
            fused.bias.copy_(torch.cat([m.bias for m in linears]))  # type: ignore[misc]
    return fused


def default_positions(input_ids: torch.Tensor) -> torch.Tensor:
    """Positions 0..T-1 for every row of ``input_ids`` [B, T] (a pass over whole sequences)."""
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


@dataclass
class AuxCapture:
    """The residual stream entering some layers of one pass, for a drafter that reads the target's
    intermediate hidden states (EAGLE-3). Layer ids count as vLLM's ``eagle_aux_hidden_state_layer_ids``
    do: id j is the input of layer j (0: the embeddings; the layer count: the last layer's output,
    before the final norm). Capturing changes no arithmetic: the pass computes the same bits."""

    layers: tuple[int, ...]
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    # ``buffers``' tensor and its column blocks: a pass that fills the blocks in place leaves the
    # result already side by side (no concatenation).
    joined: torch.Tensor | None = None
    blocks: dict[int, torch.Tensor] = field(default_factory=dict)

    def take(self, index: int, x: torch.Tensor) -> None:
        if index in self.layers:
            self.states[index] = x

    def buffers(self, like: torch.Tensor) -> dict[int, torch.Tensor]:
        """One [..., len(layers) * hidden] tensor shaped like ``like`` [..., hidden], as a view per
        layer id of its column block (``layers``' order), for a pass to fill and ``take`` (separate
        tensors where an id repeats)."""
        hidden = like.shape[-1]
        if len(set(self.layers)) < len(self.layers):  # an id twice: its state goes in two blocks (result's cat)
            self.joined, self.blocks = None, {i: torch.empty_like(like) for i in self.layers}
            return self.blocks
        self.joined = like.new_empty(*like.shape[:-1], len(self.layers) * hidden)
        self.blocks = {i: self.joined[..., j * hidden: (j + 1) * hidden] for j, i in enumerate(self.layers)}
        return self.blocks

    def result(self) -> torch.Tensor:
        """The captured states side by side, in ``layers``' order: [..., len(layers) * hidden]."""
        missing = [i for i in self.layers if i not in self.states]
        if missing:
            raise ValueError(f"the pass never reached layer input(s) {missing}")
        if self.joined is not None and all(self.states[i] is self.blocks.get(i) for i in self.layers):
            return self.joined
        return torch.cat([self.states[i] for i in self.layers], dim=-1)


class DecoderLayer(nn.Module):
    # The module types of the family's block (a subclass for another family names its own): what
    # runs the layers another way checks a layer's modules against these before taking it.
    attention_type: ClassVar[type[Attention]] = Attention
    mlp_type: ClassVar[type[MLP]] = MLP
    norm_type: ClassVar[type[nn.Module]] = RMSNorm

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def branch_norms(self) -> tuple[nn.Module, nn.Module | None, nn.Module, nn.Module | None]:
        """The layer's norms in their order: before the attention, on its output (None: none),
        before the MLP, on its output (None: none). Llama's block has the first and the third."""
        return self.input_layernorm, None, self.post_attention_layernorm, None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Embedding):
    """``nn.Embedding`` that skips its random init on the meta device, where the loader builds models
    before filling them from the checkpoint: PyTorch computes ``normal_`` there in Python (through
    ``torch._refs``), whose first use imports ``torch._dynamo``, about a second of every start-up."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class DecoderBody(nn.Module):
    """Embeddings, the layer stack and the final norm (HF's ``model.`` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DecoderOnlyLM(nn.Module):
    """A decoder-only causal LM; each architecture file is a thin subclass.

    ``forward`` takes tokens at explicit positions on top of whatever ``kv`` already holds, so one
    call serves prefill, decode, speculative verification and tree verification alike.
    """

    # What the family's block computes (``models.block``) and the type of its layers: read by the
    # backends and the loader, which never ask which family a model is.
    block_spec: ClassVar[BlockSpec] = LLAMA_BLOCK
    layer_type: ClassVar[type[DecoderLayer]] = DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderBody(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        with torch.device("cpu"):  # not on the meta device: see Embedding (arange's arithmetic runs in Python there)
            inv_freq = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)
        self.rope_tables = RopeTables()
        self.fused = False
        # The execution backend (infer.backends.Backend) that prepared this model, recorded by the
        # loader for the engine and the runners; the math here never reads it.
        self.backend: Any = None
        self.weights_summary = ""  # set by the loader: the weights' bytes, quantized and float

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                kv: KVBatch | None = None, aux: AuxCapture | None = None) -> torch.Tensor:
        """``input_ids`` [B, T] -> final hidden states [B, T, hidden]; ``aux`` keeps the inputs of some
        layers on the way (an EAGLE-3 drafter reads them)."""
        if positions is None:
            positions = default_positions(input_ids)
        x, cos, sin = self.embed(input_ids, positions)
        return self.model.norm(self.run_layers(x, cos, sin, positions, kv, aux))  # type: ignore[no-any-return]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The token embeddings [B, T, hidden] and the RoPE tables every layer shares."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_tables(self.inv_freq, positions, x.dtype)  # type: ignore[arg-type]
        return x, cos, sin

    def local_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The sliding-window layers' RoPE tables: the model's one table here; a family whose windowed
        layers have a base of their own (``BlockSpec.local_rope``) overrides this."""
        return self.rope_tables(self.inv_freq, positions, dtype)  # type: ignore[arg-type]

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   kv: KVBatch | None, aux: AuxCapture | None = None) -> torch.Tensor:
        """The decoder layers in order (before the final norm)."""
        for index, layer in enumerate(self.model.layers):
            if aux is not None:
                aux.take(index, x)
            x = layer(x, cos, sin, None if kv is None else self.layer_kv(kv, index, positions))
        if aux is not None:
            aux.take(len(self.model.layers), x)
        return x

    def layer_kv(self, kv: KVBatch, index: int, positions: torch.Tensor) -> LayerKV:
        """Layer ``index``'s view of the cache: a sliding-window layer's mask hides keys older than its window."""
        window = self.config.layer_window(index)
        if window is None:
            return kv.layer(index)
        # The window's mask is made in the padded layout (a ragged pass's padding at position 0).
        return kv.windowed(window, positions if kv.packed is None else kv.unpack(positions)).layer(index)

    def fuse_projections(self) -> None:
        """Inference layout: fused q/k/v and gate/up matmuls; the separate weights are released.

        A fused model cannot be trained or saved by ``hf_state_dict`` (load a fresh copy for that).
        """
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.fuse()
            layer.mlp.fuse()
            for name in ("q_proj", "k_proj", "v_proj"):
                delattr(layer.self_attn, name)
            for name in ("gate_proj", "up_proj"):
                delattr(layer.mlp, name)
        self.fused = True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def hf_state_dict(self) -> dict[str, Any]:
        """Weights under Hugging Face names (tied head omitted, as transformers saves it)."""
        if self.fused:
            raise RuntimeError("this model's projections are fused for inference; load it unfused to save it")
        state = {k: v for k, v in self.state_dict().items()}
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state
