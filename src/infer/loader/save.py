"""Write a model as a Hugging Face folder that both infer and transformers load."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from infer.models.config import ModelConfig

if TYPE_CHECKING:
    from infer.loader.tokenizer import Tokenizer
    from infer.models.layers import DecoderOnlyLM


def hf_dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype]


def write_model_files(folder: Path, model: DecoderOnlyLM, config: ModelConfig, dtype: torch.dtype,
                      pad_token_id: int | None = None) -> None:
    """config.json, generation_config.json and model.safetensors (HF names; a tied head is omitted)."""
    write_config_files(folder, config, dtype, pad_token_id)
    state = {name: t.detach().to("cpu", dtype).contiguous() for name, t in model.hf_state_dict().items()
             if torch.is_tensor(t)}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def write_config_files(folder: Path, config: ModelConfig, dtype: torch.dtype, pad_token_id: int | None = None) -> None:
    """config.json (weights stored in ``dtype``) and generation_config.json."""
    config.torch_dtype = hf_dtype_name(dtype)
    (folder / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    eos: int | list[int] = config.eos_token_ids[0] if len(config.eos_token_ids) == 1 else config.eos_token_ids
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": eos, "pad_token_id": pad_token_id}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def write_tokenizer_files(folder: Path, tokenizer: Tokenizer) -> None:
    """tokenizer.json and tokenizer_config.json (with the chat template)."""
    (folder / "tokenizer.json").write_text(tokenizer.backend.to_str(pretty=True))
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer.config, indent=2, ensure_ascii=False) + "\n")
