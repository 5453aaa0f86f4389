"""Qwen2 / Qwen2.5: the Llama block with q/k/v projection biases (set from config by the loader)."""

from infer.models.layers import DecoderOnlyLM


class Qwen2ForCausalLM(DecoderOnlyLM):
    """``ModelConfig.qkv_bias`` is always True for qwen2; nothing else differs from Llama."""
