"""The EAGLE-3 draft head: one decoder layer over the target's fused low, middle and high hidden states.

EAGLE-3 (Li et al. 2025) drafts from the target's own features. Per token position t the head reads

* ``fc(concat(a_low, a_mid, a_high))``: the target's residual stream entering three of its layers
  (``aux_layers``, vLLM's ``eagle_aux_hidden_state_layer_ids``: id j is the input of layer j),
  fused to the head's width; for a token the head drafted itself, its own previous output instead;
* the embedding of the token at t + 1 (the target's embedding table unless the head has its own).

Its one layer normalises both (``input_layernorm`` on the embedding, ``hidden_norm`` on the state),
attends over ``concat(embedding, state)`` (2 x hidden wide) with its own KV cache, adds the state as
the residual, runs an MLP, and its output, before ``norm``, is both the state a next draft step reads
and, through ``norm`` and ``lm_head``, the logits over a reduced draft vocabulary: draft id d is
target id ``d + d2t[d]``; ``t2d`` marks the target ids the draft vocabulary holds.

The files are the published layout vLLM's ``Eagle3LlamaForCausalLM`` and SGLang read: ``config.json``
(a Llama config with ``num_hidden_layers`` 1, ``draft_vocab_size``, optionally ``target_hidden_size``
and ``eagle_aux_hidden_state_layer_ids``) and ``model.safetensors`` with ``fc.weight``,
``midlayer.{self_attn.{q,k,v,o}_proj,mlp.{gate,up,down}_proj,input_layernorm,hidden_norm,
post_attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64),
``t2d`` (bool) and optionally ``embed_tokens.weight``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from infer.models.config import ModelConfig
from infer.models.layers import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
ARCHITECTURE = "LlamaForCausalLMEagle3"


def default_aux_layers(num_layers: int) -> tuple[int, int, int]:
    """vLLM's default for a Llama-family target: the inputs of layers 2, L // 2 and L - 3 (clamped for
    a target too shallow for that)."""
    low = min(2, num_layers)
    return low, max(low, num_layers // 2), max(low, num_layers - 3)


@dataclass
class Eagle3Config:
    """The head's shape (``config.json``); ``vocab_size`` is the target's vocabulary."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 8192
    aux_layers: tuple[int, ...] | None = None  # None: the default for the target (default_aux_layers)
    norm_before_residual: bool = False  # the residual is the normalised state (some published heads)
    training: dict[str, Any] = field(default_factory=dict)  # how infer trained it (informational)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = CONFIG_FILE) -> Eagle3Config:
        """A config in the published layout (``config.json`` of a vLLM/SGLang EAGLE-3 head)."""
        def need(name: str) -> Any:
            if name not in raw:
                raise ValueError(f"{source}: an EAGLE-3 head's config needs {name!r}")
            return raw[name]

        layers = raw.get("num_hidden_layers", 1)
        if layers != 1:
            raise ValueError(f"{source}: num_hidden_layers={layers}; infer runs EAGLE-3 heads of exactly one layer")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        eagle = raw.get("eagle_config") or {}
        aux = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get("eagle_aux_hidden_state_layer_ids")
        if eagle.get("use_aux_hidden_state") is False:
            raise ValueError(f"{source}: use_aux_hidden_state is false (an EAGLE-1/2 head); infer runs EAGLE-3 heads")
        if aux is not None and len(aux) != 3:
            raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids={aux}; EAGLE-3 fuses exactly three layers")
        vocab = int(need("vocab_size"))
        return cls(hidden_size=hidden, intermediate_size=int(need("intermediate_size")), num_attention_heads=heads,
                   num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                   head_dim=int(raw.get("head_dim") or hidden // heads), vocab_size=vocab,
                   draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
                   target_hidden_size=int(raw.get("target_hidden_size") or hidden),
                   rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(raw.get("rope_theta", 10000.0)),
                   rope_scaling=raw.get("rope_scaling"),
                   max_position_embeddings=int(raw.get("max_position_embeddings", 8192)),
                   aux_layers=None if not aux else tuple(int(i) for i in aux),
                   norm_before_residual=bool(raw.get("norm_before_residual", False)),
                   training=dict(raw.get("infer_training") or {}))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "architectures": [ARCHITECTURE], "model_type": "llama", "num_hidden_layers": 1,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads, "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim, "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size, "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "tie_word_embeddings": False, "torch_dtype": "float32",
            "norm_before_residual": self.norm_before_residual,
        }
        if self.aux_layers is not None:
            out["eagle_aux_hidden_state_layer_ids"] = list(self.aux_layers)
            out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layers),
                                   "use_aux_hidden_state": True}
        if self.training:
            out["infer_training"] = self.training
        return out

    def rope_config(self) -> ModelConfig:
        """A ModelConfig carrying the head's RoPE settings (for ``rope_inv_freq``)."""
        return ModelConfig(model_type="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_hidden_layers=1,
                           num_attention_heads=self.num_attention_heads, num_key_value_heads=self.num_key_value_heads,
                           head_dim=self.head_dim, max_position_embeddings=self.max_position_embeddings,
                           rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)


class Eagle3Attention(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        wide = 2 * config.hidden_size  # concat(embedding, state)
        self.q_proj = nn.Linear(wide, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(wide, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(wide, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=False)
        self.qkv_proj: nn.Module | None = None  # q, k and v as one projection (``Eagle3Head.fuse``)


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj: nn.Module | None = None  # gate and up as one projection (``Eagle3Head.fuse``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)  # type: ignore[no-any-return]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # type: ignore[no-any-return]


class Eagle3Layer(nn.Module):
    """The head's decoder layer (``midlayer.*``), split around attention so that the caller owns how
    keys are stored and which ones each row sees (a KV cache and a draft tree when drafting, the
    training-time-test pattern when training)."""

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        self.self_attn = Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def qkv(self, embeds: torch.Tensor, state: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rotated q [B, T, heads, D], k and v [B, T, kv_heads, D], and the residual [B, T, hidden]."""
        normed = self.hidden_norm(state)
        residual = normed if self.config.norm_before_residual else state
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn = self.self_attn
        batch, width = x.shape[:2]
        if attn.qkv_proj is not None:
            q_out, k_out, v_out = attn.qkv_proj(x).split(
                [attn.heads * attn.head_dim, attn.kv_heads * attn.head_dim, attn.kv_heads * attn.head_dim], dim=-1)
        else:
            q_out, k_out, v_out = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        q = q_out.reshape(batch, width, attn.heads, attn.head_dim)
        k = k_out.reshape(batch, width, attn.kv_heads, attn.head_dim)
        v = v_out.reshape(batch, width, attn.kv_heads, attn.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, residual

    def finish(self, residual: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """The layer's output (before the head's ``norm``) from attention's output [B, T, heads, D]."""
        x = residual + self.self_attn.o_proj(attended.flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [B, T, heads, D] over keys/values [B, S, kv_heads, D]; ``mask`` [B, T, S] bool (None: all
    visible). Returns [B, T, heads, D]."""
    groups = q.shape[2] // keys.shape[2]
    k, v = keys.transpose(1, 2), values.transpose(1, 2)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=None if mask is None else mask.unsqueeze(1))
    return out.transpose(1, 2)


class Eagle3Head(nn.Module):
    """An EAGLE-3 draft head; ``embed_tokens`` is None when it shares the target's embeddings."""

    d2t: torch.Tensor
    t2d: torch.Tensor
    inv_freq: torch.Tensor

    def __init__(self, config: Eagle3Config, own_embeddings: bool = False) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(3 * config.target_hidden_size, config.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if own_embeddings else None
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool)
                             if config.draft_vocab_size == config.vocab_size
                             else torch.zeros(config.vocab_size, dtype=torch.bool))
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(config.rope_config())
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def set_vocabulary(self, draft_to_target: torch.Tensor) -> None:
        """The draft vocabulary: ``draft_to_target[d]`` is draft id d's target id (distinct ids)."""
        ids = draft_to_target.long().cpu()
        if ids.numel() != self.config.draft_vocab_size or ids.unique().numel() != ids.numel():
            raise ValueError(f"the draft vocabulary needs {self.config.draft_vocab_size} distinct target ids")
        device = self.d2t.device
        self.d2t.copy_((ids - torch.arange(ids.numel())).to(device))
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        self.t2d.copy_(t2d.to(device))

    @property
    def target_ids(self) -> torch.Tensor:
        """[draft vocab] the target id of every draft id."""
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(self.inv_freq, positions, dtype)

    def fuse(self) -> None:
        """For drafting only (a fused head no longer saves in the published layout): q/k/v become one
        projection and gate/up another, so a draft depth makes two matmul calls fewer. Float
        projections are concatenated; quantized ones (``loader.quantized.quantize_linears``, before
        they are packed) become one ``QuantLinear``."""
        from infer.models.quantized import QuantLinear

        def joined(parts: list[nn.Module]) -> nn.Module:
            if all(isinstance(p, QuantLinear) for p in parts):
                return QuantLinear.fused(parts)  # type: ignore[arg-type]
            if not all(type(p) is nn.Linear and p.bias is None for p in parts):
                raise TypeError("only bias-free float or quantized projections fuse")
            weight = torch.cat([p.weight for p in parts])  # type: ignore[misc]
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
            linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
            return linear

        attn, mlp = self.midlayer.self_attn, self.midlayer.mlp
        if attn.qkv_proj is None:
            attn.qkv_proj = joined([attn.q_proj, attn.k_proj, attn.v_proj])
            del attn.q_proj, attn.k_proj, attn.v_proj
        if mlp.gate_up_proj is None:
            mlp.gate_up_proj = joined([mlp.gate_proj, mlp.up_proj])
            del mlp.gate_proj, mlp.up_proj

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of the layer's outputs."""
        return self.lm_head(self.norm(out))  # type: ignore[no-any-return]

    # -------------------------------------------------------------------------------- files
    def save(self, folder: str | os.PathLike[str]) -> None:
        """Write ``config.json`` and ``model.safetensors`` in the published layout, atomically (a folder
        written beside and swapped in)."""
        from safetensors.torch import save_file

        out = Path(folder)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.{os.getpid()}.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().float().contiguous() if t.is_floating_point() else t.detach().contiguous()
                   for name, t in self.state_dict().items()}
        save_file(tensors, str(tmp / WEIGHTS_FILE))
        (tmp / CONFIG_FILE).write_text(json.dumps(self.config.to_dict(), indent=2) + "\n")
        if out.exists():
            old = out.parent / f".{out.name}.{os.getpid()}.old"
            os.replace(out, old)
            os.replace(tmp, out)
            import shutil

            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)

    @classmethod
    def load(cls, folder: str | os.PathLike[str], dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> Eagle3Head:
        """A head from a folder in the published layout (``model.`` prefixes, as some exporters write, are
        dropped); every weight the layer needs must be there, with its shape."""
        from safetensors.torch import load_file

        path = Path(folder)
        config = Eagle3Config.from_dict(json.loads((path / CONFIG_FILE).read_text()), str(path / CONFIG_FILE))
        raw = load_file(str(path / WEIGHTS_FILE))
        state = {name.removeprefix("model."): t for name, t in raw.items()}
        head = cls(config, own_embeddings="embed_tokens.weight" in state)
        if "d2t" not in state:
            if config.draft_vocab_size != config.vocab_size:
                raise ValueError(f"{path / WEIGHTS_FILE}: no d2t, but the draft vocabulary ({config.draft_vocab_size}) "
                                 f"is smaller than the target's ({config.vocab_size})")
            state["d2t"] = torch.zeros(config.draft_vocab_size, dtype=torch.long)
        if "t2d" not in state:
            t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
            t2d[torch.arange(config.draft_vocab_size) + state["d2t"].long()] = True
            state["t2d"] = t2d
        expected = head.state_dict()
        missing = sorted(set(expected) - set(state))
        unknown = sorted(set(state) - set(expected))
        if missing or unknown:
            raise ValueError(f"{path / WEIGHTS_FILE} is not an EAGLE-3 head infer can run: "
                             + "; ".join(part for part in (f"missing {', '.join(missing)}" if missing else "",
                                                           f"unexpected {', '.join(unknown)}" if unknown else "") if part))
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(expected[name].shape):
                raise ValueError(f"{path / WEIGHTS_FILE}: {name} has shape {tuple(tensor.shape)}, the config implies "
                                 f"{tuple(expected[name].shape)}")
        state["d2t"], state["t2d"] = state["d2t"].long(), state["t2d"].bool()
        head.load_state_dict(state)
        head.to(device)
        for param in head.parameters():
            param.data = param.data.to(dtype)
        head.eval()
        return head
