"""Model architectures, one file each, keyed by Hugging Face ``model_type``."""

from infer.models.gemma3 import Gemma3ForCausalLM
from infer.models.layers import DecoderOnlyLM
from infer.models.llama import LlamaForCausalLM
from infer.models.qwen2 import Qwen2ForCausalLM
from infer.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderOnlyLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "mistral": LlamaForCausalLM,  # Llama's block with a sliding window in every layer (ModelConfig.sliding_window)
    "gemma3": Gemma3ForCausalLM,
}

__all__ = ["MODEL_REGISTRY", "DecoderOnlyLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
