"""infer: a readable PyTorch LLM inference engine built around lossless speculative decoding."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from infer.engine.config import EngineConfig, SpeculativeConfig
    from infer.engine.engine import Engine
    from infer.engine.llm import LLM, RequestOutput
    from infer.sampling.params import SamplingParams

# The front door's names, imported on first use: ``import infer.models.layers`` (or the kernels, or
# the data sets) should not load the engine, the loader's tokenizers and templates with it.
_EXPORTS = {"EngineConfig": "infer.engine.config", "SpeculativeConfig": "infer.engine.config",
            "Engine": "infer.engine.engine", "LLM": "infer.engine.llm", "RequestOutput": "infer.engine.llm",
            "SamplingParams": "infer.sampling.params"}
__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "SpeculativeConfig"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'infer' has no attribute {name!r}")
