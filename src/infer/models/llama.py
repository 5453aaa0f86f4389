"""Llama 2/3.x: GQA, RMSNorm, SwiGLU, RoPE (with llama3 scaling), tied or untied embeddings."""

from infer.models.config import ModelFamily
from infer.models.layers import DecoderOnlyLM


class LlamaForCausalLM(DecoderOnlyLM):
    """Everything Llama needs is the shared decoder; biases follow ``attention_bias``."""


FAMILY = ModelFamily("llama", "LlamaForCausalLM", LlamaForCausalLM)
# Mistral: Llama's block with a sliding window in every layer (ModelConfig.sliding_window, read by
# the default ``window_fields``).
MISTRAL = ModelFamily("mistral", "MistralForCausalLM", LlamaForCausalLM)
