"""Llama 2/3.x: GQA, RMSNorm, SwiGLU, RoPE (with llama3 scaling), tied or untied embeddings."""

from infer.models.layers import DecoderOnlyLM


class LlamaForCausalLM(DecoderOnlyLM):
    """Everything Llama needs is the shared decoder; biases follow ``attention_bias``."""
