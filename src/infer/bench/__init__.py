"""Benchmarks: single-request generation (infer vs transformers) and serving load."""

from infer.engine.config import SpeculativeConfig

# The draft lengths ``infer bench generation`` sweeps when none are named (a fixed-K row each): the
# engine's one default (SpeculativeConfig.spec_length) and two shorter, not a default of its own.
SPEC_LENGTH_SWEEP = (SpeculativeConfig.spec_length - 2, SpeculativeConfig.spec_length)
