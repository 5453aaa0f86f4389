"""Load Hugging Face-format model folders: config, safetensors weights, tokenizer."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from infer.loader.config import CheckpointError, ModelConfig
from infer.loader.hub import resolve_model_path
from infer.loader.tokenizer import Tokenizer
from infer.loader.weights import load_safetensors

if TYPE_CHECKING:
    from infer.models.layers import DecoderOnlyLM

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device={device!r} is invalid: use cpu, cuda, cuda:N or auto")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        # bfloat16 where the hardware is built for it; float32 on CPU for exactness by default.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: use {', '.join(DTYPES)} or auto")
    return DTYPES[dtype]


def load_config(folder: Path) -> ModelConfig:
    config = ModelConfig.from_file(folder / "config.json")
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{gen}: not valid JSON ({err})") from None
        if eos is not None:  # generation_config's EOS list is the one generation should stop on
            config.eos_token_ids = [eos] if isinstance(eos, int) else [int(e) for e in eos]
    return config


def load_model(ref: str | os.PathLike[str], dtype: str | torch.dtype = "auto",
               device: str = "auto", fuse: bool = True, pack: bool | None = None) -> tuple[DecoderOnlyLM, ModelConfig]:
    """Build the architecture named by ``config.json`` and fill it from safetensors.

    ``fuse`` merges q/k/v and gate/up projections for faster inference; pass False to get the
    Hugging Face module layout (training, saving). ``pack`` pre-packs the fused weights for oneDNN
    (``DecoderOnlyLM.pack_for_cpu``); the default does so for bfloat16 and float32 on CPU where torch
    supports it.
    """
    # Imported here: the model modules import loader.config, so a top-level import would be circular.
    from infer.models import MODEL_REGISTRY
    from infer.models.layers import cpu_packing_available, rope_inv_freq

    folder = resolve_model_path(ref)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    config = load_config(folder)
    with torch.device("meta"):
        model = MODEL_REGISTRY[config.model_type](config)
    tensors = load_safetensors(folder, torch_dtype, dev)
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for name, (tensor, path) in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for a {config.model_type} model")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"config.json implies {tuple(expected[name].shape)}")
        state[name] = tensor
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{folder}: weights missing from the safetensors files: {', '.join(missing[:5])}"
                              + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(config).to(dev)
    if fuse:
        model.fuse_projections()
    if pack is None:
        pack = fuse and dev.type == "cpu" and cpu_packing_available(torch_dtype)
    if pack:
        model.pack_for_cpu()
    return model.eval(), config


def load_tokenizer(ref: str | os.PathLike[str], config: ModelConfig | None = None) -> Tokenizer:
    folder = resolve_model_path(ref)
    config = config or load_config(folder)
    return Tokenizer(folder, eos_token_ids=config.eos_token_ids)


__all__ = ["CheckpointError", "ModelConfig", "Tokenizer", "load_config", "load_model", "load_tokenizer",
           "resolve_device", "resolve_dtype", "resolve_model_path"]
