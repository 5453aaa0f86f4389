"""Resolve a model reference (local folder or Hugging Face hub id) to a local folder, offline."""

from __future__ import annotations

import os
from pathlib import Path

from infer.loader.config import CheckpointError


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def resolve_model_path(ref: str | os.PathLike[str]) -> Path:
    """A local folder as is; ``org/name`` from the local hub cache (never downloads)."""
    path = Path(ref).expanduser()
    if path.is_dir():
        return path
    ref_str = str(ref)
    if path.exists():
        raise CheckpointError(f"{path}: expected a model folder, found a file")
    if ref_str.count("/") == 1 and not ref_str.startswith((".", "/", "~")):
        repo = hub_cache_dir() / ("models--" + ref_str.replace("/", "--"))
        snapshots = repo / "snapshots"
        if snapshots.is_dir():
            main_ref = repo / "refs" / "main"
            if main_ref.is_file() and (snapshots / main_ref.read_text().strip()).is_dir():
                return snapshots / main_ref.read_text().strip()
            candidates = sorted(snapshots.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
            if candidates:
                return candidates[0]
        raise CheckpointError(
            f"{ref_str!r} is not a local folder and is not in the local Hugging Face cache ({hub_cache_dir()}); "
            "infer never downloads: download it first or pass a folder path"
        )
    raise CheckpointError(f"{path}: model folder not found")
