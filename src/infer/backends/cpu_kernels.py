"""The cpu-kernels backend's model form: the C kernels of ``infer.kernels`` in place of PyTorch's.

``prepare`` (called by ``Backend.prepare``) turns a loaded, fused model into that form in place:

* every plain ``nn.Linear`` becomes a ``GemvLinear`` (same weights; products of up to ``MAX_ROWS``
  rows stream through the C kernel);
* RMSNorm, the attention's RoPE and SwiGLU's activation become their ``Kernel*`` subclasses, whose
  methods call the fused C operator where the inputs allow and the layer's own math otherwise
  (the modules' class is swapped: the same weights, the same names, no copy);
* ``CpuStack`` runs every decoder layer in one C call for passes of up to ``MAX_ROWS`` tokens.

Only modules of exactly the Llama block's types are converted: another kind of linear (a quantized
one) or of norm keeps its own forward, and ``CpuStack.build`` declines a model holding one, which
then runs layer by layer. Each part was probed against the layers when the backend was chosen
(``probe_fused``, ``probe_stack``).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from infer.cache import make_pool
from infer.cache.protocol import KVBatch, SequenceRows, build_kv_batch
from infer.kernels.cpu import (
    MAX_ROWS,
    MAX_STACK_GROUP,
    MAX_STACK_HEAD_DIM,
    STACK_ACTIVATIONS,
    GemvLinear,
    KernelLibrary,
    QuantProjection,
    StackHead,
    StackTable,
)
from infer.models.block import LLAMA_BLOCK
from infer.models.config import ModelConfig
from infer.models.layers import (
    MLP,
    Attention,
    AuxCapture,
    DecoderLayer,
    DecoderOnlyLM,
    Embedding,
    RMSNorm,
    apply_rope,
    default_positions,
    rope_cos_sin,
)
from infer.models.quantized import QuantEmbedding, QuantKernels, QuantLinear


def _run_fused(library: KernelLibrary, *tensors: torch.Tensor) -> bool:
    """Whether a fused C operator takes these inputs: contiguous CPU tensors of a dtype it has,
    torch.compile not tracing (Inductor fuses these operators itself) and autograd not needing
    the operators recorded."""
    return (not torch.compiler.is_compiling()
            and all(t.is_contiguous() and t.device.type == "cpu" and t.dtype in library.dtypes for t in tensors)
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


class KernelRMSNorm(RMSNorm):
    library: KernelLibrary

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _run_fused(self.library, x, self.weight):
            return self.library.rms_norm(x, self.weight, self.eps)
        return super().forward(x)


class KernelAttention(Attention):
    library: KernelLibrary

    def rotate_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The kernel reads q and k where they lie in the projection's output (contiguous).
        if _run_fused(self.library, qkv, cos, sin):
            return self.library.rope(qkv[:, :, : self.num_heads + self.num_kv_heads], cos, sin)
        return super().rotate_qk(qkv, cos, sin)


class KernelMLP(MLP):
    library: KernelLibrary

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        if _run_fused(self.library, gate_up):
            return self.library.silu_mul(gate_up)
        return super().activate(gate_up)


# The layers' module types and their fused-kernel forms; subclasses (another family's) keep their own math.
_FUSED_FORMS: dict[type[nn.Module], type[nn.Module]] = {RMSNorm: KernelRMSNorm, Attention: KernelAttention,
                                                        MLP: KernelMLP}


def prepare(model: DecoderOnlyLM, library: KernelLibrary, fused: bool) -> None:
    """``model`` in the kernels' form, in place: its plain linears on the streaming kernel and, with
    ``fused``, its norms, RoPE and SwiGLU activation on the fused operators."""
    convert_linears(model, lambda linear: GemvLinear(linear, library))
    if fused:
        for module in model.modules():
            form = _FUSED_FORMS.get(type(module))
            if form is not None:
                module.__class__ = form
                module.library = library  # type: ignore[assignment]


def convert_linears(model: nn.Module, convert: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace every module of type exactly ``nn.Linear`` in ``model`` by ``convert(linear)``. A subclass
    (``GemvLinear``, a quantized linear) is left as it is: its forward is already its backend's."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, convert(child))


def _forms(module_type: type[nn.Module]) -> tuple[type[nn.Module], ...]:
    """A block's module type and its fused-kernel form where it has one (``prepare`` swaps one for the other)."""
    form = _FUSED_FORMS.get(module_type)
    return (module_type,) if form is None else (module_type, form)


def _weight(norm: nn.Module | None) -> torch.Tensor | None:
    """A norm's weight (None without the norm)."""
    if norm is None:
        return None
    weight = norm.weight
    assert isinstance(weight, torch.Tensor)
    return weight


def _eps(norm: nn.Module) -> float:
    return float(norm.eps)  # type: ignore[arg-type]


class CpuStack:
    """Every decoder layer as one C call (``KernelLibrary.decoder_stack``) for passes of up to
    ``MAX_ROWS`` tokens: the same kernels in the same order as the layers' own forward, minus
    the Python and PyTorch operators between them, and an attention that computes each token alone,
    so a token's logits are the same bits in a decode step and in any verification pass. The
    backend (``backends.Backend``) runs it where it passed its probe against the layers."""

    def __init__(self, library: KernelLibrary, table: StackTable) -> None:
        self.library = library
        self.table = table
        self.dtype = table.dtype
        # Passes of more rows run layer by layer (prefill: oneDNN's GEMM is faster there). Exact-greedy
        # mode lifts the limit (None): every pass then computes a token the same way.
        self.max_rows: int | None = MAX_ROWS
        # The model's final norm and LM head where a call can end with them (a quantized float32 Llama
        # stack whose head is one quantized matrix): a decode step's or a verification's logits then
        # come from the pass's own call (``forward(logits=True)``), not two more kernel calls after it.
        self.head: StackHead | None = None

    @classmethod
    def build(cls, model: DecoderOnlyLM, library: KernelLibrary) -> CpuStack | None:
        """The stack for ``model`` (fused, in the kernels' form), or None where it does not apply: a
        layer not exactly the family's block (``DecoderOnlyLM.layer_type`` and its module types), a
        block the C stack has no form for, sliding-window layers of more than one window, a
        projection on neither kernel, a head too wide, more than 16 query heads per KV head, or norms
        with different epsilons or attentions with different scales. The block's form comes from the
        model's ``block_spec`` (its norm kind, post norms, gate, q/k norms); a windowed layer runs
        through the pass's windowed view of the cache, with the model's ``local_rope`` tables where
        the block has a local RoPE base (``BlockSpec.local_rope``), else the model's one table."""
        from infer.backends.exact import exact_attention  # (exact imports the backend: not at the top)

        config, spec, layer_type = model.config, model.block_spec, model.layer_type
        if type(model).forward is not DecoderOnlyLM.forward:  # an architecture with its own pass
            return None
        layers = [layer for layer in model.model.layers if type(layer) is layer_type]
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        windows = {config.layer_window(i) for i in range(config.num_hidden_layers)} - {None}
        if (config.head_dim > MAX_STACK_HEAD_DIM or not layers or len(layers) != len(model.model.layers)
                or kv_heads < 1 or heads % kv_heads or heads > MAX_STACK_GROUP * kv_heads or len(windows) > 1
                or spec.activation not in STACK_ACTIVATIONS):
            return None
        qk_norm = spec.qk_norm or config.qk_norm
        attention_types, mlp_types = _forms(layer_type.attention_type), _forms(layer_type.mlp_type)
        norm_types = _forms(layer_type.norm_type)
        tensors: list[torch.Tensor | None] = []
        quant: list[QuantProjection | None] = []
        eps, scale = _eps(layers[0].input_layernorm), layers[0].self_attn.scale
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            before_attn, after_attn, before_mlp, after_mlp = layer.branch_norms()
            if any((n is not None) != spec.post_norms for n in (after_attn, after_mlp)):
                return None
            norms = [n for n in (before_attn, after_attn, before_mlp, after_mlp, attn.q_norm, attn.k_norm)
                     if n is not None]
            # The loader gives a quantized model's layers exact_attention (row-invariant, for passes
            # that run layer by layer); the stack's own attention is row-invariant too.
            if (type(attn) not in attention_types or type(mlp) not in mlp_types
                    or not all(type(n) in norm_types for n in norms)
                    or any(_eps(n) != eps for n in norms) or attn.scale != scale
                    or attn.attend not in (None, exact_attention)):
                return None
            found = cls._projections((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj), quant)
            if found is None:
                return None
            weights, biases = found
            tensors += [_weight(before_attn), weights[0], biases[0], _weight(attn.q_norm), _weight(attn.k_norm),
                        weights[1], biases[1], _weight(before_mlp), weights[2], biases[2], weights[3], biases[3],
                        _weight(after_attn), _weight(after_mlp)]
        shape = dict(hidden=config.hidden_size, heads=heads, kv_heads=kv_heads, head_dim=config.head_dim,
                     inter=config.intermediate_size, layers=len(layers))
        local = [config.layer_window(i) is not None for i in range(config.num_hidden_layers)]
        try:
            table = StackTable(tensors, shape, eps, qk_norm=qk_norm, quant=quant, norm_offset=spec.norm_offset,
                               post_norms=spec.post_norms, activation=spec.activation, local_layers=local,
                               scale=scale)
            table.addresses()  # checks every tensor now
        except ValueError:
            return None
        stack = cls(library, table)
        stack.head = cls._head(model) if table.quant is not None and table.dtype == torch.float32 else None
        if table.quant is not None:
            # Every pass of a quantized model runs here, prefill included: its projections run the
            # same quantized kernel in the stack as outside it (no faster GEMM for long passes, unlike
            # a float model's oneDNN), and a token must get the same bits in whatever pass computes
            # it (greedy speculation's exactness): one path for all passes is what guarantees that
            # (the layers' attention, even exact_attention, rounds differently from the stack's).
            stack.max_rows = None
        return stack

    @staticmethod
    def _head(model: DecoderOnlyLM) -> StackHead | None:
        """``model``'s final norm and LM head for the stack's call: where the norm is on the fused C
        operator (the kernel the call runs) and the head one quantized matrix with the plain logits."""
        norm, head = model.model.norm, model.lm_head
        if (type(model).compute_logits is not DecoderOnlyLM.compute_logits or type(norm) is not KernelRMSNorm
                or not isinstance(head, QuantLinear)):
            return None
        head.pack()
        if len(head.weights) != 1:
            return None
        try:
            return StackHead(norm.weight, norm.eps, QuantProjection(head.kernels, tuple(head.weights)),  # type: ignore[arg-type]
                             head.bias)  # type: ignore[arg-type]
        except ValueError:
            return None

    @staticmethod
    def _projections(linears: tuple[nn.Module | None, ...], quant: list[QuantProjection | None]) -> \
            tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None:
        """The float weights (None where quantized: its QuantProjection appended to ``quant``) and
        biases of a layer's projections, or None where one is on neither kernel."""
        if not all(isinstance(m, (GemvLinear, QuantLinear)) for m in linears):
            return None
        weights: list[torch.Tensor | None] = []
        biases: list[torch.Tensor | None] = []
        for linear in linears:
            if isinstance(linear, QuantLinear):
                linear.pack()
                weights.append(None)
                quant.append(QuantProjection(linear.kernels, tuple(linear.weights)))  # type: ignore[arg-type]
            else:
                assert isinstance(linear, GemvLinear)
                weights.append(linear.weight)
                quant.append(None)
            biases.append(linear.bias)  # type: ignore[arg-type]
        return weights, biases

    @property
    def quantized(self) -> bool:
        """Whether some projection runs on the quantized kernels."""
        return self.table.quant is not None

    def takes(self, x: torch.Tensor, kv: KVBatch) -> bool:
        """Whether this pass runs here: few enough rows, no FlexAttention mask (float models), not traced by
        torch.compile or recorded by autograd, and the activations and the cache on the CPU in the
        weights' dtype (a model moved or cast after packing runs its layers)."""
        # A quantized model's layers ignore a FlexAttention mask too (exact_attention reads kv.mask, as
        # the stack does), so its stack takes those passes: one path for all of a model's passes.
        return ((self.max_rows is None or x.shape[0] * x.shape[1] <= self.max_rows)
                and (kv.block_mask is None or self.quantized)
                and x.device.type == "cpu" and x.dtype == self.dtype and self._runs_over(kv.k_layers[0])
                and self._local_layout_fits(kv))

    def _runs_over(self, store: torch.Tensor) -> bool:
        """What every pass the stack takes needs: not traced by torch.compile nor recorded by
        autograd, and a cache like ``store`` and the weights on the CPU in the stack's dtype."""
        weight = self.table.tensors[0]
        return (not torch.compiler.is_compiling() and not torch.is_grad_enabled()
                and store.dtype == self.dtype and store.device.type == "cpu"
                and weight is not None and weight.dtype == self.dtype and weight.device.type == "cpu")

    def _local_layout_fits(self, kv: KVBatch) -> bool:
        """Whether the pool keeps the sliding-window layers where the stack reads them: in the
        shared rows (no local storage), or in local rows for exactly those layers."""
        if kv.local is None:
            return True
        flags = self.table.local_layers
        return flags is not None and kv.local_layers == frozenset(int(i) for i in flags.nonzero().flatten())

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: KVBatch,
                 local: tuple[torch.Tensor, torch.Tensor, KVBatch] | None = None,
                 capture: dict[int, torch.Tensor] | None = None,
                 logits: torch.Tensor | None = None) -> torch.Tensor:
        """The stack over ``x``; ``local`` (a stack with sliding-window layers) is their RoPE tables
        and their view of the cache (``DecoderOnlyLM.layer_kv``'s); ``capture``: layer inputs copied
        out during the call (``KernelLibrary.decoder_stack``); ``logits`` (a buffer [rows, vocab]):
        the call ends with the final norm (the output is then normed) and ``head``'s logits there."""
        head = None if logits is None else self.head
        if kv.packed is not None:
            # A ragged pass [1, N]: the stack finds a token's sequence by its row, so each token goes
            # as a sequence of its own (same keys, same order: the same bits as a padded pass).
            rows = x.shape[1]

            def per_row(t: torch.Tensor) -> torch.Tensor:
                return t.reshape(rows, 1, 1, -1).contiguous()

            if local is not None:
                local = (per_row(local[0]), per_row(local[1]), local[2].per_token())
            out = self.library.decoder_stack(x.reshape(rows, 1, -1).contiguous(), per_row(cos), per_row(sin),
                                             self.table, kv.per_token(), local, capture, head, logits)
            return out.view(x.shape)
        if local is not None:
            local = (local[0].contiguous(), local[1].contiguous(), local[2])
        return self.library.decoder_stack(x.contiguous(), cos.contiguous(), sin.contiguous(), self.table, kv, local,
                                          capture, head, logits)

    def forward(self, model: DecoderOnlyLM, input_ids: torch.Tensor, positions: torch.Tensor | None,
                kv: KVBatch, aux: AuxCapture | None = None, logits: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``model``'s forward pass with its decoder layers in one C call where ``takes`` allows:
        the final hidden states and, with ``logits`` where the stack has the model's LM head
        (``head``) and takes the pass, every row's logits (float32), computed in the same call;
        else None (the caller computes them).

        ``aux`` (the inputs of some layers, for an EAGLE-3 drafter) is copied out by the same C call
        (``capture``): no arithmetic changes, so every token gets the same bits as without it. A stack
        with sliding-window layers: its passes with ``aux`` run layer by layer."""
        if positions is None:
            positions = default_positions(input_ids)
        x, cos, sin = model.embed(input_ids, positions)
        out = None
        if aux is not None and (self.table.local_layers is not None or not self.takes(x, kv)):
            x = model.run_layers(x, cos, sin, positions, kv, aux)
        elif aux is not None:
            out = self._logits_buffer(x) if logits else None
            capture = self._capture_buffers(aux, x, out is not None)
            x = self(x, cos, sin, kv, capture=capture, logits=out)
            self._take_captures(aux, x, out is not None)
        elif not self.takes(x, kv):
            x = model.run_layers(x, cos, sin, positions, kv)
        elif self.table.local_layers is not None:
            # The local layers rotate with a RoPE base of their own where the block has one, else with
            # the model's table (a windowed Llama's).
            first = int(self.table.local_layers.nonzero()[0])
            local_cos, local_sin = model.local_rope(positions, x.dtype) if model.block_spec.local_rope else (cos, sin)
            x = self(x, cos, sin, kv, (local_cos, local_sin, model.layer_kv(kv, first, positions).batch))
        else:
            out = self._logits_buffer(x) if logits else None
            x = self(x, cos, sin, kv, logits=out)
        if out is not None:  # (the call normed x)
            return x, out.view(*x.shape[:-1], -1)
        return model.model.norm(x), None

    def takes_sequence(self, model: DecoderOnlyLM, width: int, store: torch.Tensor) -> bool:
        """Whether ``forward_sequence`` runs a pass of ``width`` new tokens of one sequence over a
        pool whose stores are like ``store``: ``takes``'s conditions, no sliding-window layers, a
        Llama embedding (float rows of the stack's dtype, or quantized ones dequantized to float32)
        and at most ``MAX_ROWS`` tokens (a decode step, a verification, a short prefill chunk)."""
        embedding = model.model.embed_tokens
        if isinstance(embedding, QuantEmbedding):
            embeds = embedding.dtype == self.dtype == torch.float32 and embedding.weight.data.device.type == "cpu"
        else:
            embeds = (type(embedding) in (nn.Embedding, Embedding) and embedding.max_norm is None
                      and embedding.weight.dtype == self.dtype
                      and embedding.weight.device.type == "cpu")
        return (embeds and 0 < width <= (MAX_ROWS if self.max_rows is None else min(self.max_rows, MAX_ROWS))
                and self.table.local_layers is None and type(model).embed is DecoderOnlyLM.embed
                and model.inv_freq.device.type == "cpu" and self._runs_over(store))

    def forward_sequence(self, model: DecoderOnlyLM, tokens: Sequence[int], rows: SequenceRows,
                         logits: bool, aux: AuxCapture | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward`` of one sequence's chain of new ``tokens`` (after ``takes_sequence``): the
        embedding rows, RoPE rows and cache rows handed to the C call as addresses
        (``KernelLibrary.sequence_stack``), with the same kernels and keys as ``forward``'s pass, so
        the same bits; hidden states [1, width, hidden] and, with ``logits`` where the stack has the
        head, the logits [1, width, vocab]. ``aux``: layer inputs copied out by the same call, as
        ``forward``'s (each [1, width, hidden])."""
        width, hidden = len(tokens), self.table.shape["hidden"]
        x = torch.empty(width, hidden, dtype=self.dtype)
        embedding = model.model.embed_tokens
        if isinstance(embedding, QuantEmbedding):
            embedding.kernels.dequantize_ids(embedding.weight, tokens, x)  # type: ignore[attr-defined]
        else:
            weight = embedding.weight
            vocab, size = weight.shape[0], hidden * weight.element_size()
            if any(not 0 <= t < vocab for t in tokens):
                raise ValueError(f"token ids must lie in [0, {vocab}), got {list(tokens)}")
            base, into = weight.data_ptr(), x.data_ptr()
            for i, token in enumerate(tokens):
                ctypes.memmove(into + i * size, base + token * size, size)
        cos, sin = model.rope_tables.rows(model.inv_freq, rows.context, self.dtype)  # type: ignore[arg-type]
        out = self._logits_buffer(x) if logits else None
        capture = None if aux is None else self._capture_buffers(aux, x.view(1, width, hidden), out is not None)
        self.library.sequence_stack(x, cos[rows.start: rows.context], sin[rows.start: rows.context], self.table,
                                    rows, None if out is None else self.head, out, capture)
        if aux is not None:
            self._take_captures(aux, x.view(1, width, hidden), out is not None)
        if out is None:
            return model.model.norm(x.view(1, width, hidden)), None
        return x.view(1, width, hidden), out.view(1, width, -1)

    def _capture_buffers(self, aux: AuxCapture, x: torch.Tensor, head: bool) -> dict[int, torch.Tensor]:
        """``aux``'s buffers (``AuxCapture.buffers``, column blocks of one tensor like ``x``) that the
        C call fills: every id past the embeddings but the last layer's output, which is x itself
        after the call unless the call goes on to the final norm (``head``). The embeddings (id 0)
        are copied in here, before the call works on x in place."""
        layers = self.table.shape["layers"]
        blocks = aux.buffers(x)
        if 0 in blocks:
            blocks[0].copy_(x)
        return {i: block for i, block in blocks.items() if 0 < i < layers + head}

    def _take_captures(self, aux: AuxCapture, x: torch.Tensor, head: bool) -> None:
        """Hand ``aux`` its filled buffers, copying in ``x`` (the call's output) as the last layer's
        output where the call stopped before the final norm."""
        layers = self.table.shape["layers"]
        for i, block in aux.blocks.items():
            if i == layers and not head:
                block.copy_(x)
            aux.take(i, block)

    def _logits_buffer(self, x: torch.Tensor) -> torch.Tensor | None:
        """The logits buffer of a pass over ``x`` whose call ends with the LM head, or None without one."""
        if self.head is None:
            return None
        return torch.empty(x.numel() // x.shape[-1], self.head.vocab, dtype=torch.float32)


def _tolerance(dtype: torch.dtype) -> float:
    return 2e-2 if dtype == torch.bfloat16 else 1e-5


@functools.cache
def probe_fused(library: KernelLibrary, dtype: torch.dtype) -> str | None:
    """None if RMSNorm, RoPE and SwiGLU's activation in C agree with the layers' on a probe, else
    which one did not."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 100, generator=gen).to(dtype)
    norm = RMSNorm(100, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(100, generator=gen))
    heads = torch.randn(2, 3, 5, 16, generator=gen).to(dtype)
    cos, sin = rope_cos_sin(torch.rand(8, generator=gen), torch.arange(6).view(2, 3), dtype)
    tol = _tolerance(dtype)
    checks = {"RMSNorm": (library.rms_norm(x, norm.weight, norm.eps), norm(x)),
              "RoPE": (library.rope(heads[:, :, :3], cos, sin), apply_rope(heads[:, :, :3], cos, sin)),
              "SwiGLU": (library.silu_mul(x), F.silu(x[..., :50]) * x[..., 50:])}
    for name, (ours, ref) in checks.items():
        if not torch.allclose(ours.float(), ref.float(), rtol=tol, atol=tol):
            return f"fused {name} failed its probe against the PyTorch layer: using the layers' operators"
    return None


# Tiny models the stack is probed on: grouped KV heads, two head dims (one a partial 16-lane
# chunk), biases, and Qwen3's q/k norms.
# The third is a windowed Llama (Mistral's block): its layers run as the stack's local ones, past the window.
_STACK_PROBES = (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, qkv_bias=True, o_bias=True),
                 dict(num_attention_heads=6, num_key_value_heads=2, head_dim=40, qk_norm=True, mlp_bias=True),
                 dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=3))


@functools.cache
def probe_stack(library: KernelLibrary, dtype: torch.dtype) -> str | None:
    """None if the C decoder stack computes what the layers compute on tiny models (on paged and
    slotted caches, one windowed): prefills, batched passes of uneven runs and decode steps; else
    what differed."""
    tol = _tolerance(dtype)
    for case_index, case in enumerate(_STACK_PROBES):
        config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=40,
                             num_hidden_layers=2, max_position_embeddings=64, **case)  # type: ignore[arg-type]
        model, stack = _probe_model(DecoderOnlyLM(config), library, dtype, case_index, norm_weight=1.0)
        if stack is None:
            return f"the decoder stack does not take probe model {case_index}"
        for cache in (("paged", "slotted")[case_index % 2],):  # each cache kind once: the probe runs at every load
            failure = _probe_mismatch(model, stack, cache, dtype, tol)
            if failure is not None:
                return (f"decoder stack failed its probe against the PyTorch layers ({cache} cache, model "
                        f"{case_index}, {failure}): running layer by layer")
    return None


def _probe_model(model: DecoderOnlyLM, library: KernelLibrary, dtype: torch.dtype, seed: int,
                 norm_weight: float = 0.0) -> tuple[DecoderOnlyLM, CpuStack | None]:
    """``model`` with random weights (``norm_weight`` added to the 1-D ones: a norm's scale of about
    one for a block that multiplies by w itself), in ``dtype``, fused, with the kernels, and its stack."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + (norm_weight if param.dim() == 1 else 0.0))
    model = model.to(dtype).eval()
    model.fuse_projections()
    prepare(model, library, fused=True)
    return model, CpuStack.build(model, library)


def _probe_mismatch(model: DecoderOnlyLM, stack: CpuStack, cache: str, dtype: torch.dtype, tol: float) -> str | None:
    """Which probe pass the stack computed unlike the layers on a ``cache`` pool, and by how much (None: none)."""
    outputs = [_probe_passes(model, stack, cache, dtype), _probe_passes(model, None, cache, dtype)]
    for index, (ours, ref) in enumerate(zip(*outputs, strict=True)):
        if not torch.allclose(ours, ref, rtol=tol, atol=4 * tol):
            return f"pass {index}, max error {(ours - ref).abs().max().item():.3g}"
    return None


def _probe_passes(model: DecoderOnlyLM, stack: CpuStack | None, cache: str, dtype: torch.dtype) -> list[torch.Tensor]:
    config = model.config
    windows = [config.layer_window(i) for i in range(config.num_hidden_layers)]
    pool = make_pool(cache, num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
                     head_dim=config.head_dim, max_seq_len=32, max_batch_size=2, block_size=4, num_blocks=None,
                     dtype=dtype, device=torch.device("cpu"), layer_windows=windows, max_pass_tokens=5)
    gen = torch.Generator().manual_seed(7)
    slots = [pool.allocate(), pool.allocate()]
    out = []
    passes: list[tuple[list[int], list[int]]] = [([slots[0]], [5]), ([slots[1]], [3]), (slots, [3, 1]), (slots, [1, 1])]
    if any(w is not None for w in windows):  # past the window: keys leave it (and a paged pool's local blocks)
        passes += [(slots, [1, 3]), ([slots[0]], [1]), (slots, [2, 2])]
    with torch.inference_mode():
        # Two prefills (the paged pool interleaves their blocks), a batched pass of uneven runs
        # (padding, a mask, row tables) and a decode step of both.
        for slots_now, lengths in passes:
            starts = [pool.seq_len(s) for s in slots_now]
            ids = torch.randint(config.vocab_size, (len(slots_now), max(lengths)), generator=gen)
            positions = torch.tensor(starts).unsqueeze(1) + torch.arange(max(lengths))
            kv = build_kv_batch(pool, slots_now, starts, lengths)
            if stack is not None and not stack.takes(model.embed(ids, positions)[0], kv):
                raise RuntimeError("the probed stack declined a probe pass")
            hidden = model(ids, positions, kv) if stack is None else stack.forward(model, ids, positions, kv)[0]
            out.append(hidden.float())
    return out


def probes_own_block(model: DecoderOnlyLM) -> bool:
    """Whether ``model``'s block is another than the one ``probe_stack`` probes (Llama's, windowed
    or not): the stack then runs that block's form, probed on the model's own family when one
    loads (``probe_block_stack``)."""
    return model.block_spec != LLAMA_BLOCK


# The tiny model a family's block is probed on (``probe_block_stack``, of the family's class): local
# and global layers (the window, 4, smaller than the probe's contexts), two RoPE bases, a scale apart
# from head_dim's, grouped KV heads, q/k norms. A field the family's block does not read is unused.
_BLOCK_PROBE = dict(vocab_size=64, hidden_size=48, intermediate_size=40, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                    sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                    rope_theta=1_000_000.0, rope_local_theta=10_000.0, query_pre_attn_scalar=24.0, qk_norm=True)


@functools.cache
def probe_block_stack(library: KernelLibrary, dtype: torch.dtype, family: type[DecoderOnlyLM],
                      model_type: str) -> str | None:
    """None if the C decoder stack's form of ``family``'s block (``family.block_spec``) computes what
    the family's layers compute on a tiny model (paged cache with the local layers' own blocks, and
    slotted), passes running past the window; else what differed. ``model_type``: the configuration's."""
    tol = _tolerance(dtype)
    config = ModelConfig(model_type=model_type, **_BLOCK_PROBE)  # type: ignore[arg-type]
    model, stack = _probe_model(family(config), library, dtype, seed=5)
    if stack is None:
        return f"the decoder stack does not take the {family.__name__} probe model"
    for cache in ("paged", "slotted"):
        failure = _probe_mismatch(model, stack, cache, dtype, tol)
        if failure is not None:
            return (f"the decoder stack's {family.__name__} block failed its probe against the layers "
                    f"({cache} cache, {failure}): running layer by layer")
    return None


# Tiny quantized models the stack is probed on: block types side by side in the fused q/k/v and
# gate/up (two kernel calls each), biases, grouped KV heads and Qwen3's q/k norms.
_QUANT_STACK_PROBES = (
    (dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, qkv_bias=True, o_bias=True),
     (("Q8_0", "Q8_0", "Q4_0"), ("Q4_1",), ("Q4_0", "Q8_0"), ("Q5_0",))),
    (dict(num_attention_heads=6, num_key_value_heads=2, head_dim=32, qk_norm=True, mlp_bias=True),
     (("Q4_0", "Q4_0", "Q4_0"), ("Q8_0",), ("Q4_1", "Q4_1"), ("Q8_0",))),
)
# The quantized stack against the layers: the same quantized products, attention rounded otherwise
# (the layers' exact_attention), and the int8 rounding of the next activations can turn that into a
# quantization step; a misplaced part or bias moves the outputs by their own size.
_QUANT_TOLERANCE = 1e-2


def quantized_probe_model(case_index: int, quant: QuantKernels) -> DecoderOnlyLM:
    """Probe model ``case_index`` of ``_QUANT_STACK_PROBES``: float32, fused, its projections
    ``QuantLinear``s over random blocks of the case's types (q, k, v / o / gate, up / down)."""
    from infer.kernels.quant import random_blocks
    from infer.models.quantized import QuantRows

    case, types = _QUANT_STACK_PROBES[case_index]
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=64,
                         num_hidden_layers=2, max_position_embeddings=64, **case)  # type: ignore[arg-type]
    gen = torch.Generator().manual_seed(100 + case_index)
    model = DecoderOnlyLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.3 + (1.0 if param.dim() == 1 else 0.0))
    model = model.float().eval()
    model.fuse_projections()
    q_rows, kv_rows = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        owners = ((attn, "qkv_proj", (q_rows, kv_rows, kv_rows)), (attn, "o_proj", (config.hidden_size,)),
                  (mlp, "gate_up_proj", (config.intermediate_size,) * 2), (mlp, "down_proj", (config.hidden_size,)))
        for (owner, name, rows), qtypes in zip(owners, types, strict=True):
            linear = getattr(owner, name)
            parts = [QuantLinear([QuantRows(t, linear.in_features, random_blocks(t, n, linear.in_features, gen))],
                                 None, quant) for t, n in zip(qtypes, rows, strict=True)]
            fused = QuantLinear.fused(parts)
            if linear.bias is not None:
                fused.register_buffer("bias", linear.bias.detach().float().contiguous(), persistent=False)
            fused.pack()
            setattr(owner, name, fused)
    return model


@functools.cache
def probe_quant_stack(library: KernelLibrary, quant: QuantKernels) -> str | None:
    """None if the C decoder stack with quantized projections computes what the quantized layers
    compute (with exact_attention, as the loader gives them) on tiny models, else what differed."""
    from infer.backends.exact import exact_attention

    for case_index in range(len(_QUANT_STACK_PROBES)):
        model = quantized_probe_model(case_index, quant)
        prepare(model, library, fused=True)
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.attend = exact_attention
        stack = CpuStack.build(model, library)
        if stack is None or not stack.quantized:
            return f"the decoder stack does not take quantized probe model {case_index}"
        cache = ("paged", "slotted")[case_index % 2]
        outputs = [_probe_passes(model, stack, cache, torch.float32), _probe_passes(model, None, cache, torch.float32)]
        for index, (ours, ref) in enumerate(zip(*outputs, strict=True)):
            scale = float(ref.abs().max())
            if not torch.allclose(ours, ref, rtol=0, atol=_QUANT_TOLERANCE * max(scale, 1.0)):
                return (f"the quantized decoder stack failed its probe against the layers ({cache} cache, model "
                        f"{case_index}, pass {index}, max error {(ours - ref).abs().max().item():.3g}): "
                        "running layer by layer")
    return None
