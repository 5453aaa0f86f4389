"""The execution backend: which code computes a model's forward pass, chosen once at load, with why.

``Backend`` is the interface every pass goes through: ``prepare(model)`` puts a loaded model in the
backend's form (and records the backend on it), ``forward(model, ids, positions, kv, aux)`` runs a
pass, and the backend declares what it can do (``Capabilities``: the rows one fast pass takes, tree
masks, whether a token's bits are the same in any pass). Three kinds:

* ``TorchBackend`` (``torch`` on the CPU): the PyTorch layers, with oneDNN pre-packed linears where
  torch has them, except in compiled mode (Inductor cannot lower packed weights, so the linears stay
  ``nn.Linear``);
* ``CpuKernelBackend`` (``cpu-kernels``): the C kernels of ``infer.kernels`` (streaming products,
  the fused small operators and the whole decoder stack in one call), each part probed against the
  layers (``backends.cpu_kernels``), and the kernels' thread policy for each kind of pass;
* ``CudaBackend`` (``torch`` on a GPU): the PyTorch layers with Triton paged attention reading the
  cache in place (``backends.triton_attention``), FlexAttention compiled for tree masks, and CUDA
  graphs of the passes a request repeats (``backends.cuda_graphs``).

The modes are options given when the backend is made (``choose_backend``), never switched later:
``exact`` (exact greedy: ``backends.exact``), ``compiled`` (``torch.compile``: ``backends.compiled``)
and ``cuda_graphs``. ``prepare`` applies them after the backend's own form, so the architectures in
``infer.models`` stay math and the engine and ``ModelRunner`` never choose how a pass runs.

``auto`` takes ``cpu-kernels`` where the CPU, the compiler and the probes allow and says why not
otherwise; ``--backend`` (``EngineConfig.backend``) forces one and refuses, naming the reason, one
this machine cannot run.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

import infer.kernels as kernels
from infer.backends import cpu_kernels, triton_attention, triton_ops
from infer.backends.cpu_kernels import (
    CpuStack,
    probe_block_stack,
    probe_fused,
    probe_quant_stack,
    probe_stack,
    probes_own_block,
)
from infer.backends.onednn import PackedLinear, cpu_packing_available, projection_packer
from infer.cache.protocol import CachePoolProtocol, KVBatch, SequenceRows, build_kv_batch, sequence_rows
from infer.kernels.cpu import (
    MAX_ROWS,
    GemvLinear,
    KernelLibrary,
    host_work_single_threaded,
    kernel_threads_only,
)
from infer.kernels.quant import QuantKernels as QuantLibrary
from infer.models.layers import Attention, AuxCapture, DecoderOnlyLM, block_mask_from
from infer.models.quantized import QuantLinear

if TYPE_CHECKING:
    from infer.backends.cuda_graphs import StepGraphs

# ``cpu-kernels:NAME`` forces kernel variant NAME in each kernel family that has one (the float
# kernels' ``build.VARIANTS``, the quantized kernels' ``build.QUANT_VARIANTS``; ``avx2`` is in both),
# the other family taking its best: how CI runs the AVX2 and portable kernels on an AVX-512 machine.
KERNEL_VARIANTS = tuple(dict.fromkeys([*kernels.build.VARIANT_NAMES, *(v.name for v in kernels.build.QUANT_VARIANTS)]))
BACKENDS = ("auto", "torch", "cpu-kernels", *(f"cpu-kernels:{name}" for name in KERNEL_VARIANTS))

Say = Callable[[str], None]
ThreadPolicy = Callable[[int, str], contextlib.AbstractContextManager[None]]


def forced_variant(requested: str) -> str | None:
    """The kernel variant ``--backend cpu-kernels:NAME`` names (None for the other backends)."""
    return requested.split(":", 1)[1] if requested.startswith("cpu-kernels:") else None


# How many ``Backend.forward`` calls this thread is inside (tests check that no pass runs outside one).
_inside = threading.local()


def inside_forward() -> bool:
    """Whether this thread is running a pass through ``Backend.forward`` now."""
    return getattr(_inside, "depth", 0) > 0


@dataclass(frozen=True)
class Capabilities:
    """What a backend's passes can do, declared once (the startup line and tests read them)."""

    # Rows (a pass's tokens) its fastest path takes in one pass; wider passes still run, on the
    # layers (None: no such limit).
    max_rows: int | None = None
    tree_masks: bool = True  # tree verification's arbitrary masks (SDPA's dense mask, or FlexAttention)
    row_invariant: bool = False  # a token's bits are the same in a decode step and in any verification pass
    graphs: bool = False  # replays the passes a request repeats as CUDA graphs


@dataclass
class PassOutput:
    """What ``Backend.run_pass`` computed: the final hidden states (padded [B, T, hidden], or packed
    [1, N, hidden] for a ragged pass the layers ran packed), every row's logits where the pass
    computed them, the captured layer inputs, and whether a CUDA graph replayed it (its rows are then
    padded to the graph's shape, whatever the pass asked)."""

    hidden: torch.Tensor
    logits: torch.Tensor | None = None
    aux: torch.Tensor | None = None
    replayed: bool = False


@dataclass(kw_only=True, eq=False)
class Backend:
    """What runs a model's forward pass and why (``describe`` is the startup line's text).

    One is made per loaded model, with its modes: ``prepare`` gives that model the backend's form
    and ``forward`` runs its passes. The base class runs the PyTorch layers as they are (a model
    built without the loader: training, tests).
    """

    name: ClassVar[str] = "torch"  # what --backend calls it
    reasons: list[str] = field(default_factory=list)  # why a faster path was refused
    exact: bool = False  # exact greedy (backends.exact), checked on this machine at prepare
    compiled: bool = False  # the forward through torch.compile (backends.compiled)
    cuda_graphs: bool = False  # CudaBackend: decode steps and chain verifications replayed as graphs
    # How a tree verification's mask reaches attention: "sdpa" (a dense mask) or "flex" (a FlexAttention
    # block mask built per pass: ``run_pass``).
    tree_attention: str = "sdpa"
    # The prepared model's decoder stack in one C call (CpuKernelBackend; None: layer by layer).
    # Tests set None to compare with the layers; exact-greedy mode lifts its row limit.
    cpu_stack: CpuStack | None = field(default=None, repr=False, compare=False)
    _policies: dict[int, ThreadPolicy] = field(default_factory=dict, init=False, repr=False, compare=False)

    # -- what it is ------------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        """The mode the options give: exact, cuda-graphs, compiled or eager."""
        if self.exact:
            return "exact"
        if self.cuda_graphs:
            return "cuda-graphs"
        return "compiled" if self.compiled else "eager"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(row_invariant=self.exact, graphs=self.cuda_graphs)

    @property
    def variant(self) -> str:
        return ""

    def detail(self) -> str:
        return "PyTorch operators"

    def describe(self) -> str:
        """One line: ``backend cpu-kernels (AVX-512 float32 kernels, ...; avx512-bf16: CPU lacks avx512_bf16)``."""
        mode = "" if self.mode == "eager" else f", {self.mode} mode"
        why = f"; {'; '.join(self.reasons)}" if self.reasons else ""
        return f"backend {self.name} ({self.detail()}{mode}{why})"

    def info(self) -> dict[str, Any]:
        """The choice as a JSON-able record (``infer bench``'s environment, the server's metric)."""
        return {"backend": self.name, "variant": self.variant, "mode": self.mode, "detail": self.detail(),
                "reason": "; ".join(self.reasons)}

    # -- preparing a model ----------------------------------------------------------------------
    def prepare(self, model: DecoderOnlyLM, say: Say | None = None) -> None:
        """Give ``model`` (loaded, fused) this backend's inference form and its modes, in place, and
        record the backend on it (``model.backend``). Only plain ``nn.Linear`` projections are
        converted (another kind, e.g. a quantized linear, keeps its forward), so a new module kind
        needs no change here to run, only to run faster. ``say`` hears what takes time."""
        self.install(model)
        model.backend = self
        if self.exact:
            from infer.backends.exact import check_invariance, make_exact

            if say is not None:
                say("exact-greedy kernels: checking that this machine computes a token alike in any pass")
            make_exact(model)
            check_invariance(model)
        if self.compiled:
            from infer.backends.compiled import compile_forward

            compile_forward(model, say)

    def install(self, model: DecoderOnlyLM) -> None:
        """The backend's own form of ``model`` (before its modes); the base class has none."""

    def head_packer(self, weight: torch.Tensor) -> Callable[[torch.nn.Linear], torch.nn.Module] | None:
        """The form a drafter head's vocabulary projections (Medusa's ``MedusaHeads.fused``) take beside
        this backend's model, whose weights look like ``weight``: oneDNN-packed in bfloat16 on CPU (as
        the target's linears are), else None (one stacked tensor)."""
        return projection_packer(weight)

    # -- running passes -------------------------------------------------------------------------
    def forward(self, model: DecoderOnlyLM, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                kv: KVBatch | None = None, aux: AuxCapture | None = None) -> torch.Tensor:
        """``model``'s final hidden states [B, T, hidden] for ``input_ids`` [B, T] at ``positions`` over
        ``kv``: the one way every pass is run (``model(...)`` alone runs the layers, never the stack).
        ``aux`` keeps the inputs of some layers on the way."""
        return self.forward_logits(model, input_ids, positions, kv, aux, logits=False)[0]

    def forward_logits(self, model: DecoderOnlyLM, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                       kv: KVBatch | None = None, aux: AuxCapture | None = None,
                       logits: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``, and with ``logits`` every row's logits (float32 [B, T, vocab]) where this
        backend computes them in the pass itself (the C stack's call ending with the LM head); None
        where it does not (the caller runs ``model.compute_logits``)."""
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return self.run(model, input_ids, positions, kv, aux, logits)
        finally:
            _inside.depth -= 1

    def takes_sequence(self, model: DecoderOnlyLM, width: int, store: torch.Tensor) -> bool:
        """Whether ``forward_sequence`` runs a pass of ``width`` new tokens of one sequence over a pool
        whose stores are like ``store`` (the base class: never)."""
        return False

    def forward_sequence(self, model: DecoderOnlyLM, tokens: Sequence[int], rows: SequenceRows,
                         logits: bool, aux: AuxCapture | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_logits`` of one sequence's chain of new ``tokens`` at their cache positions, the
        cache given as ``rows`` (``cache.protocol.sequence_rows``), where ``takes_sequence`` said so:
        the same bits as ``forward_logits`` over the same pass (``aux``'s layer inputs too), without
        the tensors that describe it."""
        _inside.depth = getattr(_inside, "depth", 0) + 1
        try:
            return self.run_sequence(model, tokens, rows, logits, aux)
        finally:
            _inside.depth -= 1

    def run_sequence(self, model: DecoderOnlyLM, tokens: Sequence[int], rows: SequenceRows,
                     logits: bool, aux: AuxCapture | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One such pass (``forward_sequence`` without its bookkeeping): the base class takes none."""
        raise NotImplementedError(f"backend {self.name} runs every pass through forward_logits")

    def run(self, model: DecoderOnlyLM, input_ids: torch.Tensor, positions: torch.Tensor | None,
            kv: KVBatch | None, aux: AuxCapture | None, logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One pass (``forward_logits`` without its bookkeeping): the PyTorch layers (no logits)."""
        if aux is None:
            return model(input_ids, positions, kv), None
        return model(input_ids, positions, kv, aux), None

    def run_pass(self, model: DecoderOnlyLM, pool: CachePoolProtocol, slots: Sequence[int],
                 runs: Sequence[Sequence[int]] | torch.Tensor, positions: torch.Tensor | None = None,
                 tree_mask: torch.Tensor | None = None, ragged: bool = False, logits: bool = False,
                 aux_layers: tuple[int, ...] = (), graphs: StepGraphs | None = None) -> PassOutput:
        """Append ``runs[b]`` to sequence ``slots[b]`` of ``pool`` (``ModelRunner``'s every pass), the
        backend choosing how: a replay of ``graphs`` where it holds a graph of this pass (a chain of
        one sequence's new tokens at their cache positions, no layer inputs kept), the one-sequence
        path where ``takes_sequence`` says so, else the layers over the tensors ``build_kv_batch``
        makes (packed when ``ragged``), a tree's mask a FlexAttention block mask in
        ``tree_attention="flex"``; each in the threads ``thread_policy`` gives a pass of its rows."""
        # Tokens at their cache positions, no tree: what a graph takes (lists, or ids on the device);
        # the one-sequence path takes the lists.
        at_cache_positions = positions is None and tree_mask is None
        chain = runs if at_cache_positions and not isinstance(runs, torch.Tensor) else None
        if graphs is not None and at_cache_positions and not aux_layers:
            replayed = graphs.run(slots, runs)
            if replayed is not None:
                return PassOutput(replayed, replayed=True)
        threads = self._threads(model)
        aux = AuxCapture(aux_layers) if aux_layers else None
        starts = [pool.seq_len(s) for s in slots]
        if len(slots) == 1 and chain is not None and self.takes_sequence(model, len(chain[0]), pool.k_layers[0]):
            # One sequence's chain of tokens (a decode step, a verification): the cache as rows and
            # addresses, not the tensors build_kv_batch makes (the same bits).
            rows = sequence_rows(pool, slots[0], starts[0], len(chain[0]))
            with threads(len(chain[0]), "forward"):
                hidden, computed = self.forward_sequence(model, chain[0], rows, logits, aux)
            return PassOutput(hidden, computed, None if aux is None else aux.result())
        if isinstance(runs, torch.Tensor):
            ids = runs
            lengths = [runs.shape[1]] * runs.shape[0]
        else:
            lengths = [len(r) for r in runs]
            width = max(lengths)
            padded = runs if all(n == width for n in lengths) else [list(r) + [0] * (width - len(r)) for r in runs]
            ids = torch.tensor(padded, dtype=torch.long).to(pool.device, non_blocking=True)
        if positions is None:
            offsets = torch.arange(ids.shape[1], device=pool.device)
            positions = (offsets + starts[0]).unsqueeze(0) if len(starts) == 1 else \
                torch.tensor(starts, device=pool.device).unsqueeze(1) + offsets
        kv = build_kv_batch(pool, slots, starts, lengths, tree_mask, ragged=ragged)
        if tree_mask is not None and self.tree_attention == "flex":
            assert kv.mask is not None  # a tree pass always has one
            kv.block_mask = block_mask_from(kv.mask)
        if kv.packed is not None:  # only the real tokens go through the model: [1, N]
            ids, positions = kv.pack(ids), kv.pack(positions)
        with threads(ids.numel(), "forward"):
            hidden, computed = self.forward_logits(model, ids, positions, kv, aux, logits)
        return PassOutput(hidden, computed, None if aux is None else aux.result())

    def compute_logits(self, model: DecoderOnlyLM, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over ``hidden`` [..., hidden] (float32 logits), in the threads a head of its rows takes."""
        with self._threads(model)(hidden.numel() // hidden.shape[-1], "logits"):
            return model.compute_logits(hidden).float()

    def _threads(self, model: DecoderOnlyLM) -> ThreadPolicy:
        """``thread_policy(model)``, made once per model (it reads the model's modules)."""
        key = id(model)
        if key not in self._policies:
            self._policies[key] = self.thread_policy(model)
        return self._policies[key]

    def thread_policy(self, model: DecoderOnlyLM) -> ThreadPolicy:
        """How ``model``'s passes are threaded: ``policy(rows, kind)`` is the context a pass of
        ``rows`` tokens of ``kind`` ("forward", "logits") runs in. Where C kernels (float or
        quantized) carry the matmuls, passes they take whole run torch's own operators
        single-threaded (``kernels.cpu.kernel_threads_only``); elsewhere torch's threading is left alone."""
        if not any(isinstance(m, (GemvLinear, QuantLinear)) for m in model.modules()):
            return lambda rows, kind: contextlib.nullcontext()
        model_id = id(model)
        # A 1-row pass's quantized products stream their weights with or without software
        # prefetches, whichever measures faster here (kernel_threads_only's ``streams``).
        quantized = next((m.kernels for m in model.modules()
                          if isinstance(m, QuantLinear) and isinstance(m.kernels, QuantLibrary)), None)
        streams = None if quantized is None else quantized.set_stream_prefetch

        def policy(rows: int, kind: str) -> contextlib.AbstractContextManager[None]:
            # A kind of pass for the kernels' thread choice: this model's, of this many rows.
            if rows > MAX_ROWS:
                return contextlib.nullcontext()
            return kernel_threads_only((model_id, kind, rows), streams if rows == 1 else None)

        return policy

    def host_policy(self, model: DecoderOnlyLM) -> Callable[[], contextlib.AbstractContextManager[None]]:
        """The context for host work around ``model``'s passes (sampling; a speculative round's
        drafting and rejection sampling): where C kernels carry its matmuls, torch's operators on one thread
        (``kernels.cpu.host_work_single_threaded``), so libgomp's workers do not spin on the cores the
        next pass needs; elsewhere nothing."""
        if not any(isinstance(m, (GemvLinear, QuantLinear)) for m in model.modules()):
            return contextlib.nullcontext
        return host_work_single_threaded

    def step_graphs(self, model: DecoderOnlyLM, pool: CachePoolProtocol, max_batch: int, max_width: int,
                    say: Say | None = None) -> StepGraphs | None:
        """The CUDA graphs that replay ``model``'s passes over ``pool`` (``ModelRunner.graphs``), or
        None where this backend runs every pass eagerly."""
        return None


@dataclass(kw_only=True, eq=False)
class TorchBackend(Backend):
    """The PyTorch layers on the CPU, their linears pre-packed for oneDNN where torch has them."""

    name: ClassVar[str] = "torch"
    onednn: bool = False  # linears pre-packed for oneDNN

    def detail(self) -> str:
        return "oneDNN-packed linears" if self.onednn else "PyTorch operators"

    def install(self, model: DecoderOnlyLM) -> None:
        if self.onednn:
            if not model.fused:
                raise RuntimeError("a CPU backend needs the fused inference layout (fuse_projections first)")
            cpu_kernels.convert_linears(model, PackedLinear)  # a packed LM head gets its own copy of a tied embedding


@dataclass(kw_only=True, eq=False)
class CpuKernelBackend(Backend):
    """The C kernels: streaming products, the fused small operators, the decoder stack in one call."""

    name: ClassVar[str] = "cpu-kernels"
    library: KernelLibrary  # the variant in use
    fused: bool = False  # RMSNorm, RoPE and SwiGLU's activation in C
    stack: bool = False  # the whole decoder stack in one C call

    @property
    def capabilities(self) -> Capabilities:
        # The stack takes passes of up to MAX_ROWS tokens (every pass in exact mode: its limit is lifted).
        limit = None if self.cpu_stack is not None and self.cpu_stack.max_rows is None else MAX_ROWS
        return Capabilities(max_rows=limit, row_invariant=self.exact)

    @property
    def variant(self) -> str:
        return self.library.variant.name

    def detail(self) -> str:
        threads = torch.get_num_threads()
        parts = [self.library.variant.description, *(["fused operators"] if self.fused else []),
                 *(["decoder stack"] if self.stack else []),
                 f"{threads} threads, or 1 per kind of pass where that measures faster (shared cores)"
                 if threads > 1 else "1 thread"]
        return ", ".join(parts)

    def install(self, model: DecoderOnlyLM) -> None:
        if not model.fused:
            raise RuntimeError("a CPU backend needs the fused inference layout (fuse_projections first)")
        cpu_kernels.prepare(model, self.library, self.fused)
        self.cpu_stack = CpuStack.build(model, self.library) if self.stack else None
        if self.cpu_stack is not None and probes_own_block(model):
            # A block other than Llama's (its norms, gate, windows) is probed only when a model of its
            # family loads, on that family's layers.
            failure = probe_block_stack(self.library, self.cpu_stack.dtype, type(model),  # type: ignore[arg-type]
                                        model.config.model_type)  # (a class hashes; nn.Module's stub says otherwise)
            if failure is not None:
                self.cpu_stack, self.stack = None, False
                self.reasons.append(failure)
        if self.cpu_stack is not None and self.cpu_stack.quantized:
            assert self.cpu_stack.table.quant is not None
            quant = next(q.kernels for q in self.cpu_stack.table.quant if q is not None)
            failure = probe_quant_stack(self.library, quant)
            if failure is not None:
                self.cpu_stack, self.stack = None, False
                self.reasons.append(failure)
        if self.stack and self.cpu_stack is None:  # the startup line must not claim a stack that does not run
            self.stack = False
            self.reasons.append("the C decoder stack takes Llama-block models with float projections or quantized "
                                "ones (float32): running layer by layer")

    def run(self, model: DecoderOnlyLM, input_ids: torch.Tensor, positions: torch.Tensor | None,
            kv: KVBatch | None, aux: AuxCapture | None, logits: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The C decoder stack where it is built (it declines passes it cannot take: they run on the
        layers); the layers without a cache. ``aux``: the stack copies those layer inputs out in the same
        call; ``logits``: its call ends with the LM head where the stack has it."""
        if self.cpu_stack is None or kv is None:
            return super().run(model, input_ids, positions, kv, aux, logits)
        return self.cpu_stack.forward(model, input_ids, positions, kv, aux, logits)

    def takes_sequence(self, model: DecoderOnlyLM, width: int, store: torch.Tensor) -> bool:
        return self.cpu_stack is not None and self.cpu_stack.takes_sequence(model, width, store)

    def run_sequence(self, model: DecoderOnlyLM, tokens: Sequence[int], rows: SequenceRows,
                     logits: bool, aux: AuxCapture | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        assert self.cpu_stack is not None
        return self.cpu_stack.forward_sequence(model, tokens, rows, logits, aux)


@dataclass(kw_only=True, eq=False)
class CudaBackend(Backend):
    """The PyTorch layers on a GPU: Triton paged attention, compiled FlexAttention, CUDA graphs."""

    name: ClassVar[str] = "torch"  # --backend torch (or auto) on a CUDA device
    paged_attention: bool = False  # attention by the Triton paged kernel (no per-layer gather)

    fused_ops: bool = False  # RMSNorm + residual, RoPE and SwiGLU by the Triton kernels of backends.triton_ops

    def detail(self) -> str:
        parts = ["PyTorch operators", *(["Triton paged attention"] if self.paged_attention else []),
                 *(["Triton fused norms, RoPE and SwiGLU"] if self.fused_ops else [])]
        return ", ".join(parts)

    def install(self, model: DecoderOnlyLM) -> None:
        for module in model.modules():
            if isinstance(module, Attention):
                module.flex_attention = _compiled_flex_attention()
                if self.paged_attention:
                    module.paged_attention = triton_attention.attend
        # The fused operators go where the paged kernel goes (Triton runs here, and the pass is not
        # traced by the compiler): one kernel where the layers launch several for each norm, RoPE
        # and activation, each checked equal to the layers' (tests/models/test_triton_ops.py).
        if self.paged_attention:
            reason = triton_ops.install(model)
            self.fused_ops = reason is None
            if reason is not None:
                self.reasons.append(f"fused operators: {reason}")

    def step_graphs(self, model: DecoderOnlyLM, pool: CachePoolProtocol, max_batch: int, max_width: int,
                    say: Say | None = None) -> StepGraphs | None:
        if not self.cuda_graphs:
            return None
        from infer.backends.cuda_graphs import StepGraphs

        return StepGraphs(model, pool, max_batch, max_width, say)


@functools.cache
def _compiled_flex_attention() -> Any:
    """FlexAttention compiled, for tree masks on CUDA, where it pays (the layers' eager FlexAttention
    is a slow reference, for tests)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=True)


def choose_backend(device: torch.device | str, dtype: torch.dtype, requested: str = "auto",
                   compile: bool = False, exact: bool = False, cuda_graphs: bool = False,
                   tree_attention: str = "sdpa") -> Backend:
    """The backend for a model in ``dtype`` on ``device``, with its modes (``compile``: through
    torch.compile; ``exact``: exact greedy; ``cuda_graphs``: passes replayed as CUDA graphs;
    ``tree_attention``: a tree's mask dense for SDPA or a FlexAttention block mask).
    ``requested`` is ``auto`` or a name from ``BACKENDS``; one this machine cannot run raises
    ValueError with the reason."""
    if requested not in BACKENDS:
        raise ValueError(f"backend={requested!r} is invalid: use {', '.join(BACKENDS)}")
    device = torch.device(device)
    modes: dict[str, Any] = {"compiled": compile, "exact": exact, "cuda_graphs": cuda_graphs,
                             "tree_attention": tree_attention}
    forced = requested.startswith("cpu-kernels")
    variant = forced_variant(requested)
    if device.type != "cpu":
        if forced:
            raise ValueError(f"backend {requested!r} runs on the CPU; this model runs on {device}")
        unavailable = triton_attention.unavailable_reason(device)
        if unavailable is None and compile:
            unavailable = "compiled mode keeps SDPA attention (the compiler does not trace the Triton kernel)"
        return CudaBackend(paged_attention=unavailable is None,
                           reasons=[] if unavailable is None else [f"paged attention: {unavailable}"], **modes)
    if cuda_graphs:
        raise ValueError(f"cuda_graphs needs a CUDA device; this engine runs on {device}")
    reasons = []
    if requested == "torch":
        reasons.append("forced by --backend torch")
    else:
        if variant is not None and variant in kernels.build.VARIANT_NAMES:
            try:
                library: KernelLibrary | None = kernels.named_library(variant)
            except kernels.KernelUnavailable as err:
                raise ValueError(f"backend {requested!r} cannot run on this machine: {err}") from None
            assert library is not None
            if dtype not in library.dtypes:
                raise ValueError(f"backend {requested!r} has no {dtype} kernels (use --dtype float32)")
            refused = [f"kernel variant {variant} forced by --backend"]
        else:
            library = kernels.library_for(dtype)
            refused = list(kernels.selection().refused)
        if library is None:
            reason = kernels.unavailable_reason(dtype)
            if requested == "cpu-kernels":
                raise ValueError(f"backend 'cpu-kernels' cannot run {dtype} on this machine: {reason}")
            reasons.append(reason)
        else:
            # Compiled mode traces the layers (the compiler fuses their operators): no stack to probe.
            fused_failure = probe_fused(library, dtype)
            stack_failure = None if compile else probe_stack(library, dtype)
            for failure in (fused_failure, stack_failure):
                if failure is not None:
                    refused.append(failure)
            return CpuKernelBackend(library=library, fused=fused_failure is None,
                                    stack=fused_failure is None and stack_failure is None and not compile,
                                    reasons=refused, **modes)
    onednn = cpu_packing_available(dtype) and not compile
    if compile and cpu_packing_available(dtype):
        reasons.append("compiled mode keeps nn.Linear (Inductor cannot lower oneDNN-packed weights)")
    return TorchBackend(onednn=onednn, reasons=reasons, **modes)


def backend_of(model: DecoderOnlyLM) -> Backend:
    """The backend that prepared ``model`` (the loader's choice), or the plain PyTorch layers for a
    model built without the loader (training, tests)."""
    backend = model.backend
    if isinstance(backend, Backend):
        return backend
    return Backend(reasons=["not prepared by a backend (built without the loader)"])

