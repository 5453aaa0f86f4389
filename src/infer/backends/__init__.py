"""Execution backends: what computes a loaded model's forward pass, chosen once at load (``backend``).

``infer.models`` holds the architectures as plain math; a backend puts a loaded model in its form
(oneDNN-packed linears: ``onednn``; the C kernels and the decoder stack: ``cpu_kernels``) and runs
its passes (``Backend.forward``). The engine's modes ride on top: ``exact`` (exact-greedy) and
``compiled`` (torch.compile).
"""

from infer.backends.backend import BACKENDS, Backend, backend_of, choose_backend
from infer.backends.onednn import count_weights

__all__ = ["BACKENDS", "Backend", "backend_of", "choose_backend", "count_weights"]
