"""Qwen3: the Llama block with per-head RMSNorm on queries and keys before RoPE."""

from typing import Any

from infer.models.config import ModelFamily, window_fields
from infer.models.layers import DecoderOnlyLM


class Qwen3ForCausalLM(DecoderOnlyLM):
    """``ModelConfig.qk_norm`` is always True for qwen3 (``q_norm``/``k_norm`` per attention layer)."""


def qwen3_fields(raw: dict[str, Any], source: str) -> dict[str, Any]:
    return {**window_fields(raw, source), "qk_norm": True}


FAMILY = ModelFamily("qwen3", "Qwen3ForCausalLM", Qwen3ForCausalLM, qwen3_fields)
