"""Model configuration read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
# config.json model_type spellings read as one of the above: a text-only Gemma 3 checkpoint says
# gemma3_text; a multimodal one says gemma3 and nests the language model's fields in text_config.
_MODEL_TYPE_ALIASES = {"gemma3_text": "gemma3"}
SLIDING, FULL = "sliding_attention", "full_attention"  # Hugging Face's layer_types values


class CheckpointError(ValueError):
    """A model folder that cannot be loaded; the message names the file and the problem."""


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    # Sliding-window attention: ``layer_types[i]`` is SLIDING (attends to the last ``sliding_window``
    # positions, its own included) or FULL; None with a window means every layer slides (Mistral).
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None  # RoPE base of the sliding layers when it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale 1/sqrt(this) instead of 1/sqrt(head_dim)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    hidden_act: str = "silu"

    def layer_window(self, index: int) -> int | None:
        """How many positions layer ``index`` attends to (its own included); None: all of them."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[index] == SLIDING:
            return self.sliding_window
        return None

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
        if model_type == "gemma3" and isinstance(raw.get("text_config"), dict):
            # A multimodal Gemma 3: infer runs its language model (the image tower is not read).
            text = dict(raw["text_config"])
            for key in ("eos_token_id", "bos_token_id", "torch_dtype", "dtype", "tie_word_embeddings"):
                if key not in text and key in raw:
                    text[key] = raw[key]
            raw = {**text, "model_type": "gemma3"}
        model_type = _MODEL_TYPE_ALIASES.get(model_type, model_type)  # type: ignore[arg-type]
        if model_type not in SUPPORTED_MODEL_TYPES:
            archs = raw.get("architectures")
            raise CheckpointError(
                f"{source}: unsupported model_type {model_type!r} (architectures={archs}); "
                f"infer supports {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            # transformers >= 5 nests RoPE settings under rope_parameters; older files use top-level keys.
            rope = dict(raw.get("rope_parameters") or {})
            rope_scaling = raw.get("rope_scaling") or None
            if rope_scaling is None and rope.get("rope_type", "default") != "default":
                rope_scaling = rope
            rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
            attention_bias = bool(raw.get("attention_bias", False))
            eos = raw.get("eos_token_id")
            extra = _gemma3_fields(raw, source) if model_type == "gemma3" else _window_fields(raw, source)
            if model_type == "gemma3":
                rope_theta, rope_scaling = float(extra.pop("rope_theta")), extra.pop("rope_scaling")
            return cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type == "gemma3")),
                # Qwen2 always has q/k/v biases; Llama and Qwen3 follow attention_bias (o_proj too).
                qkv_bias=True if model_type == "qwen2" else attention_bias,
                o_bias=False if model_type == "qwen2" else attention_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=model_type in ("qwen3", "gemma3"),
                eos_token_ids=_as_id_list(eos),
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
                **extra,
            )
        except KeyError as missing:
            raise CheckpointError(f"{source}: required field {missing.args[0]!r} is missing") from None

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        if not path.is_file():
            raise CheckpointError(f"{path}: config.json not found (is this a Hugging Face model folder?)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{path}: not valid JSON ({err})") from None
        return cls.from_dict(raw, str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that both infer and transformers load (used when saving trained models)."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM", "gemma3": "Gemma3ForCausalLM"}
        out: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": "gemma3_text" if self.model_type == "gemma3" else self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_ids[0] if len(self.eos_token_ids) == 1 else self.eos_token_ids,
            "torch_dtype": self.torch_dtype or "float32",
        }
        if self.sliding_window is not None:
            out["sliding_window"] = self.sliding_window
        if self.model_type == "gemma3":
            out.update(hidden_activation=self.hidden_act, layer_types=self.layer_types,
                       # transformers checks the type: an int where it is whole, as configs write it
                       query_pre_attn_scalar=_whole(self.query_pre_attn_scalar),
                       final_logit_softcapping=self.final_logit_softcapping,
                       rope_local_base_freq=self.rope_local_theta)
            del out["hidden_act"]
        return out


def _window_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """A Mistral-style ``sliding_window`` (every layer); Qwen2's per-layer switch is refused by name
    rather than misread (its ``use_sliding_window`` is off in every released checkpoint)."""
    window = raw.get("sliding_window")
    if raw.get("model_type") == "qwen2":
        if raw.get("use_sliding_window"):
            raise CheckpointError(f"{source}: qwen2 use_sliding_window (sliding attention in some layers) "
                                  "is not supported")
        return {}
    return {} if window is None else {"sliding_window": _positive(window, "sliding_window", source)}


def _gemma3_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
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
    return {"sliding_window": _positive(raw.get("sliding_window", 4096), "sliding_window", source),
            "layer_types": list(layer_types), "rope_local_theta": local_theta, "hidden_act": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": float(raw.get("query_pre_attn_scalar", 256)),
            "final_logit_softcapping": raw.get("final_logit_softcapping"),
            "rope_theta": theta, "rope_scaling": scaling}


def _whole(value: float | None) -> float | int | None:
    return int(value) if value is not None and float(value).is_integer() else value


def _positive(value: Any, name: str, source: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise CheckpointError(f"{source}: {name} must be a positive integer, got {value!r}")
    return value


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
