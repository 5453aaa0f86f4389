"""infer: a readable PyTorch LLM inference engine built around lossless speculative decoding."""

from infer.engine.config import EngineConfig, SpeculativeConfig
from infer.engine.engine import Engine
from infer.engine.llm import LLM, RequestOutput
from infer.sampling.params import SamplingParams

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams", "SpeculativeConfig"]
__version__ = "0.1.0"
