"""Read safetensors weights (single file or sharded index); pickle checkpoints are never loaded."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from infer.models.config import CheckpointError


def weight_files(folder: Path) -> list[Path]:
    single = folder / "model.safetensors"
    index = folder / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
        files = [folder / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing")
        return files
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")) or any(folder.glob("*.pth")):
        raise CheckpointError(f"{folder}: only pickle weights (*.bin/*.pt) found; infer reads safetensors only")
    raise CheckpointError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def load_safetensors(folder: Path, dtype: torch.dtype, device: torch.device) -> dict[str, tuple[torch.Tensor, Path]]:
    """Every tensor, cast to ``dtype`` on ``device``, with the file it came from (for error messages)."""
    tensors: dict[str, tuple[torch.Tensor, Path]] = {}
    for path in weight_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    tensor = f.get_tensor(name)
                    if tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    tensors[name] = (tensor.to(device), path)
        except Exception as err:  # safetensors raises several types for a corrupt file
            if isinstance(err, CheckpointError):
                raise
            raise CheckpointError(f"{path}: cannot read safetensors file ({err})") from None
    return tensors
