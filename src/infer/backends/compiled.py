"""Compiled mode (``--compile``): a model's forward pass through ``torch.compile``.

One pass serves prefill, decode, verification and tree verification, so the forward is compiled
with dynamic shapes: the context length changes every step and the batch size and pass width
from one step to the next, and symbolic sizes keep those from recompiling. torch still
specializes sizes of 1, so a handful of graphs cover everything (one sequence or several, one new
token or several, with or without an attention mask); each is compiled the first time its kind of
pass runs and then reused (the engine runs the common kinds at load: ``ModelRunner.warm_up``).
Inductor's on-disk caches make a restart's compiles cheaper.

The CPU matrix-vector kernel is an opaque custom operator to the compiler (``infer::gemv``); what
Inductor gains on CPU is fusing the small operators between the matmuls. oneDNN-packed linears
(``PackedLinear``) cannot be compiled (Inductor's lowering expects a packed weight to be a graph
constant it packed itself), so a model to compile is loaded with ``compile=True``
(``backends.choose_backend``), which keeps plain ``nn.Linear`` where the C kernels do not run. The
compiled forward is the layers' (the C decoder stack is a pass the compiler could not see into). It measured no faster
than eager on the project's 2-core CPU (docs/benchmarks.md): the mode is for CUDA, where fusion
and fewer kernel launches pay, and so that exactness holds, and is tested, in both modes.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from infer.backends.backend import CpuKernelBackend, backend_of
from infer.backends.onednn import PackedLinear
from infer.models.layers import DecoderOnlyLM

# Kinds of pass (batch of one or more, width one or more, mask or none, tree or chain, prefill
# rows above the kernel's limit) can reach a few dozen graphs over a server's life; torch's default
# limit of 8 would fall back to eager for the rest without saying so.
RECOMPILE_LIMIT = 64

_reporter: list[Callable[[str], None]] = []
_COMPILED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # models whose forward is compiled already
_graphs_compiled = [0]


def graphs_compiled() -> int:
    """Graphs this process has compiled so far (any function; tests check the mode really compiles)."""
    return _graphs_compiled[0]


def _install_progress() -> None:
    """Say when a graph starts and ends compiling (the first pass of each kind pauses for it)."""
    if _reporter:
        return
    _reporter.append(lambda _msg: None)
    try:
        from torch._dynamo.callback import on_compile_end, on_compile_start
    except ImportError:  # older torch: no hooks, the start message below is all the user sees
        return
    started: list[float] = []

    @on_compile_start
    def _start(*_args: Any) -> None:
        started.append(time.perf_counter())
        _reporter[-1]("torch.compile: compiling a graph for a new kind of pass ...")

    @on_compile_end
    def _end(*_args: Any) -> None:
        _graphs_compiled[0] += 1
        if started:
            _reporter[-1](f"torch.compile: graph compiled in {time.perf_counter() - started.pop():.1f} s")


def compile_forward(model: nn.Module, say: Callable[[str], None] | None = None) -> None:
    """Replace ``model.forward`` by its compiled form (in place; weights are shared, not copied);
    its backend then runs every pass through it, the C decoder stack no more. A backend made with
    ``compiled`` calls this in ``prepare`` (a second call changes nothing). A model with
    oneDNN-packed or quantized linears is refused (ValueError): load it with ``compile=True``."""
    import torch._dynamo

    from infer.models.quantized import QuantLinear

    if any(isinstance(m, (PackedLinear, QuantLinear)) for m in model.modules()):
        raise ValueError("this model's linears are pre-packed for oneDNN or quantized for C kernels, which "
                         "torch.compile cannot lower; load it with load_model(..., compile=True) so they stay nn.Linear")

    if model in _COMPILED:
        return
    config = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, limit_name, max(getattr(config, limit_name), RECOMPILE_LIMIT))
    _install_progress()
    if say is not None:
        _reporter.append(say)
        say("torch.compile: each kind of pass compiles on first use (seconds to minutes; cached on disk)")
    model.forward = torch.compile(model.forward, dynamic=True)  # type: ignore[method-assign]
    _COMPILED.add(model)
    if isinstance(model, DecoderOnlyLM):
        backend = backend_of(model)
        backend.cpu_stack = None
        if isinstance(backend, CpuKernelBackend):
            backend.stack = False
