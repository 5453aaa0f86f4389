"""Qwen3: the Llama block with per-head RMSNorm on queries and keys before RoPE."""

from infer.models.layers import DecoderOnlyLM


class Qwen3ForCausalLM(DecoderOnlyLM):
    """``ModelConfig.qk_norm`` is always True for qwen3 (``q_norm``/``k_norm`` per attention layer)."""
