"""Model configuration read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


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

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> ModelConfig:
        model_type = raw.get("model_type")
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
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v biases; Llama and Qwen3 follow attention_bias (o_proj too).
                qkv_bias=True if model_type == "qwen2" else attention_bias,
                o_bias=False if model_type == "qwen2" else attention_bias,
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                eos_token_ids=_as_id_list(eos),
                bos_token_id=raw.get("bos_token_id"),
                torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
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
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        out: dict[str, Any] = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
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
        return out


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
