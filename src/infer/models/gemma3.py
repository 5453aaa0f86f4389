"""Gemma 3 (text): the decoder block with Gemma's differences from Llama.

* RMSNorm scales by ``1 + weight`` (checkpoints store the offset from one), computed in float32
  and rounded once at the end, and there are four per layer: before and after attention, before
  and after the MLP (the "sandwich"); q and k get the same norm per head before RoPE;
* embeddings are multiplied by sqrt(hidden), rounded to the embedding dtype first as transformers does;
* the MLP gates with GELU (tanh approximation) instead of SiLU;
* sliding-window ("local") layers, ``ModelConfig.layer_types``, attend to the last
  ``sliding_window`` positions and rotate with their own RoPE base (``rope_local_theta``); the
  global layers see everything and use ``rope_theta`` (with any scaling);
* attention scores are scaled by ``query_pre_attn_scalar ** -0.5``; logits optionally soft-capped.

``Gemma3ForCausalLM.block_spec`` says all of this as data (``models.block``): the C decoder stack
(``backends.cpu_kernels.CpuStack``) and the Triton operators run these layers from it, the stack
probed at load against the layers here (``probe_block_stack``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.cache.protocol import KVBatch, LayerKV
from infer.models.block import BlockSpec
from infer.models.config import FULL, SLIDING, CheckpointError, ModelConfig, ModelFamily, positive_int, whole
from infer.models.layers import (
    MLP,
    Attention,
    AuxCapture,
    DecoderLayer,
    DecoderOnlyLM,
    apply_rope,
    rope_inv_freq,
)


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaling by ``1 + weight``; the weight is stored as Hugging Face stores it (zeros = identity)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Attention):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)  # type: ignore[assignment]
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)  # type: ignore[assignment]
        self.scale: float = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = config.layer_window(layer_idx)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None) -> torch.Tensor:
        batch, width, _ = x.shape
        heads, kv_heads = self.num_heads, self.num_kv_heads
        if self.qkv_proj is not None:
            qkv = self.qkv_proj(x).view(batch, width, heads + 2 * kv_heads, self.head_dim)
            q, k, v = qkv[:, :, :heads], qkv[:, :, heads: heads + kv_heads], qkv[:, :, heads + kv_heads:]
        else:
            q = self.q_proj(x).view(batch, width, heads, self.head_dim)
            k = self.k_proj(x).view(batch, width, kv_heads, self.head_dim)
            v = self.v_proj(x).view(batch, width, kv_heads, self.head_dim)
        assert self.q_norm is not None and self.k_norm is not None
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        if kv is None:  # the whole sequence at once: causal, within the window for a local layer
            attn_mask: torch.Tensor | None = torch.ones(width, width, dtype=torch.bool, device=x.device).tril()
            if self.window is not None:
                attn_mask = attn_mask.triu(1 - self.window)  # type: ignore[union-attr]
            keys, values = k.transpose(1, 2), v.transpose(1, 2)
        elif self.paged_attention is not None and self.attend is None:  # the view carries the window
            kv.write(k, v)
            return self.o_proj(self.paged_attention(q, kv, self.scale).reshape(batch, width, -1))
        else:  # the layer's view already carries the window in its mask (DecoderOnlyLM.layer_kv)
            kv.write(k, v)
            keys, values = kv.gather()
            attn_mask = kv.batch.mask
            packed = kv.batch if kv.batch.packed is not None else None
            if packed is not None:  # a ragged pass: attention runs in the padded layout
                q = packed.unpack(q)
            if self.attend is not None:  # exact-greedy attention scales by 1/sqrt(head_dim): fold the difference into q
                out = self.attend(q.transpose(1, 2) * (self.scale * math.sqrt(self.head_dim)), keys, values, attn_mask)
            else:
                out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=attn_mask,
                                                     scale=self.scale, enable_gqa=heads != kv_heads)
            if packed is not None:
                out = packed.pack(out.transpose(1, 2)).transpose(1, 2)
            return self.o_proj(out.transpose(1, 2).reshape(batch, width, -1))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=attn_mask, scale=self.scale,
                                             enable_gqa=heads != kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, width, -1))


class Gemma3MLP(MLP):
    """GELU (tanh approximation)-gated feed-forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(DecoderLayer):
    attention_type = Gemma3Attention
    mlp_type = Gemma3MLP
    norm_type = GemmaRMSNorm

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        nn.Module.__init__(self)  # DecoderLayer's own modules are Llama's; these replace them
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = Gemma3MLP(config)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)  # type: ignore[assignment]
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)  # type: ignore[assignment]
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def branch_norms(self) -> tuple[nn.Module, nn.Module | None, nn.Module, nn.Module | None]:
        return (self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                self.post_feedforward_layernorm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: LayerKV | None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


# Everything above, as the data the backends read (the C stack, the Triton operators).
GEMMA3_BLOCK = BlockSpec(norm_offset=True, activation="gelu_tanh", qk_norm=True, post_norms=True, embed_scale=True,
                         query_scale=True, local_rope=True, logit_softcap=True)


class Gemma3ForCausalLM(DecoderOnlyLM):
    block_spec = GEMMA3_BLOCK
    layer_type = Gemma3DecoderLayer

    def __init__(self, config: ModelConfig) -> None:
        super().__init__(config)
        body = self.model
        body.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        body.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)  # type: ignore[assignment]
        # The local layers' RoPE: their own base, never scaled. Made on first use (on the device the
        # model runs on), since the loader builds models on the meta device.
        self._local_inv_freq: torch.Tensor | None = None

    def local_inv_freq(self, device: torch.device) -> torch.Tensor:
        if self._local_inv_freq is None or self._local_inv_freq.device != device:
            theta = self.config.rope_local_theta or self.config.rope_theta
            local = dataclasses.replace(self.config, rope_theta=theta, rope_scaling=None)
            self._local_inv_freq = rope_inv_freq(local).to(device)
        return self._local_inv_freq

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The embeddings scaled by sqrt(hidden) and the global layers' RoPE tables."""
        embedded = self.model.embed_tokens(input_ids)
        x = embedded * torch.tensor(self.config.hidden_size ** 0.5, dtype=embedded.dtype)
        cos, sin = self.rope_tables(self.inv_freq, positions, x.dtype)  # type: ignore[arg-type]
        return x, cos, sin

    def local_rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The sliding-window layers' RoPE tables (their own base)."""
        return self.rope_tables(self.local_inv_freq(positions.device), positions, dtype)

    def run_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   kv: KVBatch | None, aux: AuxCapture | None = None) -> torch.Tensor:
        tables = {False: (cos, sin), True: self.local_rope(positions, x.dtype)}
        for index, layer in enumerate(self.model.layers):
            if aux is not None:
                aux.take(index, x)
            layer_cos, layer_sin = tables[self.config.layer_window(index) is not None]
            x = layer(x, layer_cos, layer_sin, None if kv is None else self.layer_kv(kv, index, positions))
        if aux is not None:
            aux.take(len(self.model.layers), x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


# ----------------------------------------------------------------- config.json and checkpoint names

def gemma3_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Gemma 3's extra fields, with transformers' defaults for the ones a config.json may leave out."""
    if raw.get("attn_logit_softcapping") is not None:
        raise CheckpointError(f"{source}: attn_logit_softcapping (Gemma 2's attention soft-capping) is not supported")
    if raw.get("use_bidirectional_attention"):
        raise CheckpointError(f"{source}: use_bidirectional_attention (an embedding model) is not supported")
    layers = int(raw["num_hidden_layers"])
    layer_types = raw.get("layer_types")
    if layer_types is None:  # older configs: every sliding_window_pattern-th layer is global
        pattern = int(raw.get("sliding_window_pattern") or 6)
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    if len(layer_types) != layers or set(layer_types) - {SLIDING, FULL}:
        raise CheckpointError(f"{source}: layer_types must list {layers} of {SLIDING!r} / {FULL!r}")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise CheckpointError(f"{source}: Gemma 3 hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
    # RoPE: transformers 5 nests one parameter set per layer type; older files use rope_theta,
    # rope_local_base_freq and rope_scaling (which applies to the global layers).
    nested = raw.get("rope_parameters")
    if isinstance(nested, dict) and FULL in nested:
        full, local = dict(nested[FULL] or {}), dict(nested.get(SLIDING) or {})
        theta = float(full.get("rope_theta", 1_000_000.0))
        scaling = full if full.get("rope_type", "default") != "default" else None
        local_theta = float(local.get("rope_theta", 10_000.0))
        if local.get("rope_type", "default") != "default":
            raise CheckpointError(f"{source}: RoPE scaling on the sliding layers is not supported")
    else:
        theta = float(raw.get("rope_theta", 1_000_000.0))
        scaling = raw.get("rope_scaling") or None
        local_theta = float(raw.get("rope_local_base_freq", 10_000.0))
    return {"sliding_window": positive_int(raw.get("sliding_window", 4096), "sliding_window", source),
            "layer_types": list(layer_types), "rope_local_theta": local_theta, "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
            "final_logit_softcapping": raw.get("final_logit_softcapping"),
            "rope_theta": theta, "rope_scaling": scaling, "qk_norm": True,
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", True))}


def gemma3_text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3's config.json as its language model's: infer runs that (the image tower is not read)."""
    if not isinstance(raw.get("text_config"), dict):
        return raw
    text = dict(raw["text_config"])
    for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
        if key not in text and key in raw:
            text[key] = raw[key]
    return {**text, "model_type": "gemma3"}


def gemma3_hf_fields(config: ModelConfig, out: dict[str, Any]) -> dict[str, Any]:
    out.update(hidden_activation=config.hidden_act, layer_types=config.layer_types,
               # transformers checks the type: an int where it is whole, as configs write it
               query_pre_attn_scalar=whole(config.query_pre_attn_scalar),
               final_logit_softcapping=config.final_logit_softcapping,
               rope_local_base_freq=config.rope_local_theta)
    del out["hidden_act"]
    return out


def gemma3_text_name(name: str) -> str:
    """A multimodal Gemma 3 checkpoint's language-model tensor under the text model's name (transformers
    5 writes ``model.language_model.*``, 4.x ``language_model.model.*``); "" for the vision parts."""
    for prefix, renamed in (("model.language_model.", "model."), ("language_model.model.", "model."),
                            ("language_model.lm_head.", "lm_head.")):
        if name.startswith(prefix):
            return renamed + name[len(prefix):]
    if name.startswith(("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.",
                        "multi_modal_projector.")):
        return ""
    return name


def gemma3_gguf_fields(meta: Callable[[str], Any], hidden: int, heads: int, head_dim: int) -> dict[str, Any]:
    """The config.json fields of a ``gemma3`` GGUF file beyond the common ones (``meta(suffix)``: its
    ``gemma3.<suffix>`` value). The file stores the window but not which layers slide, the local RoPE
    base or the attention scale: those are what llama.cpp assumes for Gemma 3 (every sixth layer
    global, base 10,000, 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the 62-layer 27B), and
    transformers reads the file alike."""
    layers = int(meta("block_count"))
    pattern = meta("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer files: one flag per layer, True = sliding
        layer_types = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    else:
        period = int(pattern or 6)
        layer_types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(layers)]
    out: dict[str, Any] = {
        "sliding_window": meta("attention.sliding_window"), "layer_types": layer_types,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "final_logit_softcapping": meta("final_logit_softcapping"),
        "attn_logit_softcapping": meta("attn_logit_softcapping"),
    }
    if out["sliding_window"] is not None:
        out["sliding_window"] = int(out["sliding_window"])
    return out


# A text-only checkpoint says gemma3_text; a multimodal one says gemma3 and nests the language model's
# fields in text_config.
FAMILY = ModelFamily("gemma3", "Gemma3ForCausalLM", Gemma3ForCausalLM, gemma3_fields, aliases=("gemma3_text",),
                     hf_model_type="gemma3_text", unwrap=gemma3_text_config, hf_fields=gemma3_hf_fields,
                     tensor_name=gemma3_text_name, gguf_fields=gemma3_gguf_fields)
