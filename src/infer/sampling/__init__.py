"""Sampling: parameters, the logits -> distribution transform, and token drawing."""

from infer.sampling.params import SamplingParams
from infer.sampling.sampler import sample_from_probs, sample_next_tokens
from infer.sampling.transforms import SamplingBatch, probs_from_logits

__all__ = ["SamplingBatch", "SamplingParams", "probs_from_logits", "sample_from_probs", "sample_next_tokens"]
