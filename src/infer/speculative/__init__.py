"""Speculative decoding: draft proposal (n-gram lookup, draft models) and lossless verification."""
