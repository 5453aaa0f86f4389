"""Model architectures, one file each, keyed by Hugging Face ``model_type``.

A family's file declares its ``ModelFamily`` (config fields, checkpoint names, the module class);
registering it here is all that makes the config reader and the loader know it.
"""

from infer.models import gemma3, llama, phi3, qwen2, qwen3
from infer.models.config import ModelFamily, register_families
from infer.models.gemma3 import Gemma3ForCausalLM
from infer.models.layers import DecoderOnlyLM
from infer.models.llama import LlamaForCausalLM
from infer.models.phi3 import Phi3ForCausalLM
from infer.models.qwen2 import Qwen2ForCausalLM
from infer.models.qwen3 import Qwen3ForCausalLM

FAMILIES: tuple[ModelFamily, ...] = register_families(
    llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, llama.MISTRAL, gemma3.FAMILY, phi3.FAMILY)
MODEL_REGISTRY: dict[str, type[DecoderOnlyLM]] = {family.model_type: family.model_class for family in FAMILIES}

__all__ = ["FAMILIES", "MODEL_REGISTRY", "DecoderOnlyLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "Phi3ForCausalLM",
           "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
