"""Model architectures, one file each, keyed by Hugging Face ``model_type``."""

from infer.models.layers import DecoderOnlyLM
from infer.models.llama import LlamaForCausalLM
from infer.models.qwen2 import Qwen2ForCausalLM
from infer.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[DecoderOnlyLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}

__all__ = ["MODEL_REGISTRY", "DecoderOnlyLM", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
