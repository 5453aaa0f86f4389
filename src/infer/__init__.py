"""infer: a readable PyTorch LLM inference engine built around lossless speculative decoding."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

# PyTorch's OpenMP threads busy-wait after each parallel operator (libgomp's default policy), on the
# cores where infer's kernel pool runs the next pass: a speculative round's operators between passes
# (rejection sampling over the vocabulary, drafting) left them spinning through the verification
# pass, which then waited for its descheduled kernel threads. Passive: they sleep at once. libgomp
# reads this when it loads (with torch), so it holds where infer is imported first (the CLI, the
# server's engine process); a value already set wins. Measured in docs/benchmarks.md.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

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
