"""Benchmarks: single-request generation (infer vs transformers) and serving load."""
