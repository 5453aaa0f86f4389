"""Qwen2 / Qwen2.5: the Llama block with q/k/v projection biases (set from config by the loader)."""

from typing import Any

from infer.models.config import CheckpointError, ModelFamily
from infer.models.layers import DecoderOnlyLM


class Qwen2ForCausalLM(DecoderOnlyLM):
    """``ModelConfig.qkv_bias`` is always True for qwen2; nothing else differs from Llama."""


def qwen2_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Qwen2 always has q/k/v biases and never an o_proj one. Its per-layer sliding-window switch is
    refused by name rather than misread (``use_sliding_window`` is off in every released checkpoint,
    so its ``sliding_window`` is not read)."""
    if raw.get("use_sliding_window"):
        raise CheckpointError(f"{source}: qwen2 use_sliding_window (sliding attention in some layers) is not supported")
    return {"qkv_bias": True, "o_bias": False}


FAMILY = ModelFamily("qwen2", "Qwen2ForCausalLM", Qwen2ForCausalLM, qwen2_fields)
