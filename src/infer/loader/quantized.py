"""Quantized weights at load: which tensors stay in their blocks, the kernels that multiply them, and
float checkpoints quantized at load (``--quantization``).

``quantization`` (``EngineConfig.quantization``, ``--quantization``) says what a checkpoint's linear
weights become:

* ``auto`` (default): a GGUF's quantized tensors of the types the kernels multiply (``KEPT_TYPES``)
  stay in their blocks; float tensors stay float;
* ``none``: everything dequantized into the run dtype (what infer did before it had the kernels);
* ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``: as ``auto``, and the float projections, LM head and
  embeddings (a safetensors folder's, an F16/F32 GGUF's) are quantized into that block type at load
  (``gguf.quants.quantize``, llama.cpp's rounding).

Only where the quantized kernels run (the CPU, a backend other than ``torch``, the kernels built and
probed: ``infer.kernels.quant``); elsewhere the model is dequantized to float and the startup line
says why. A tensor of another block type (Q5_1, Q2_K, the IQ types...) is dequantized, and so are
the other projections it is fused with (q/k/v, gate/up: a fused projection is all quantized or all
float), with a line naming them.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from infer.backends.plan import QuantChoice
from infer.models.quantized import QuantEmbedding, QuantLinear, QuantRows, weight_bytes
from infer.models.quantized import QuantKernels as KernelsProtocol

QUANTIZATIONS = ("auto", "none", "q8_0", "q4_0", "q4_1", "q5_0")
# Block types the quantized kernels multiply (what Q4_K_M, Q5_K_M, Q8_0 and Q4_0 files hold).
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")

# Weights that may be quantized: the projections, the LM head and the token embeddings.
_QUANTIZABLE = re.compile(r"(model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)"
                          r"|lm_head|model\.embed_tokens)\.weight")
# Projections fused into one matmul (``Attention.fuse``, ``MLP.fuse``): all quantized or all float.
_FUSED_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))
_LAYER_PART = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


def check_quantization(value: str, option: str = "quantization") -> None:
    if value not in QUANTIZATIONS:
        raise ValueError(f"{option}={value!r} is invalid: use {', '.join(QUANTIZATIONS)}")


def gguf_keep(tensor_types: dict[str, str]) -> tuple[Callable[[str, str], bool], list[str]]:
    """Which of a GGUF's tensors (Hugging Face name -> block type name) stay quantized: a quantizable
    weight of a kept type whose fused siblings are all of kept types too. Returns the rule and a
    line per reason another quantized weight is dequantized."""
    quantized = {name: t for name, t in tensor_types.items() if _QUANTIZABLE.fullmatch(name) and t not in ("F32", "F16", "BF16")}
    dropped: dict[str, str] = {}
    for name, type_name in quantized.items():
        if type_name not in KEPT_TYPES:
            dropped[name] = f"{type_name} has no quantized kernel"
    for name in list(quantized):
        match = _LAYER_PART.fullmatch(name)
        if match is None or name in dropped:
            continue
        layer, part = match.groups()
        for group in _FUSED_GROUPS:
            if part in group:
                siblings = [f"model.layers.{layer}.{p}.weight" for p in group]
                odd = [s for s in siblings if s not in quantized or s in dropped]
                if odd:
                    dropped[name] = f"fused with {odd[0].split('.', 3)[3]} ({tensor_types.get(odd[0], '?')})"
    keep = {name for name in quantized if name not in dropped}
    lines = []
    if dropped:
        by_reason: Counter[str] = Counter(dropped.values())
        lines.append("dequantized to float: " + "; ".join(f"{count} tensor{'s' if count > 1 else ''} ({reason}, e.g. "
                                                          f"{next(n for n, r in dropped.items() if r == reason)})"
                                                          for reason, count in by_reason.items()))
    return (lambda name, type_name: name in keep), lines


_EIGHT_BIT = ("model.embed_tokens.weight", "lm_head.weight")


def quantize_float_weights(state: dict[str, torch.Tensor], quantization: str) -> tuple[dict[str, QuantRows], list[str]]:
    """Quantize ``state``'s float projections into ``quantization``'s blocks and its LM head and
    embeddings into Q8_0 (every choice is 8 bits or fewer; llama.cpp's practice), each removed from
    ``state`` as it is done, so at most one float copy of a weight is held beside the blocks.
    Weights whose width is not a whole number of blocks stay float, with a line."""
    import gguf

    requested = gguf.GGMLQuantizationType[quantization.upper()]
    block = gguf.GGML_QUANT_SIZES[requested][0]
    out: dict[str, QuantRows] = {}
    skipped = []
    for name in [n for n in state if _QUANTIZABLE.fullmatch(n)]:
        weight = state[name]
        if weight.shape[-1] % block:
            skipped.append(name)
            continue
        del state[name]
        # The embedding table and the LM head stay at 8 bits under a 4- or 5-bit choice, as llama.cpp's
        # quantizer keeps its output tensor at Q6_K: in 4 bits they cost SmolLM2 much of its quality
        # (`infer bench quality`: perplexity 6.13 -> 7.69 with everything in Q4_0).
        out[name] = quantized_rows(weight, "Q8_0" if name in _EIGHT_BIT else requested.name)
    lines = [f"kept float ({len(skipped)} weights of a width not a multiple of {block}, e.g. {skipped[0]})"] if skipped else []
    return out, lines


def quantized_rows(weight: torch.Tensor, qtype: str) -> QuantRows:
    """A float matrix [rows, in_features] in ``qtype``'s blocks (``gguf.quants.quantize``, llama.cpp's rounding)."""
    import gguf

    blocks = gguf.quants.quantize(weight.detach().float().cpu().numpy(), gguf.GGMLQuantizationType[qtype])
    return QuantRows(qtype, int(weight.shape[-1]), torch.from_numpy(np.ascontiguousarray(blocks)))


def quantize_linears(module: nn.Module, kernels: KernelsProtocol, qtype: str = "Q8_0") -> int:
    """Every float ``nn.Linear`` in ``module`` whose input width is a whole number of blocks becomes a
    ``QuantLinear`` of ``qtype`` on ``kernels`` (``install_quantized``, packed on first use or after
    fusing); returns how many. For a module that only proposes (a draft head), where reading its
    weights from memory is the cost and a rounding never changes the output."""
    import gguf

    qtype = qtype.upper()
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    weights = {f"{name}.weight": quantized_rows(m.weight, qtype) for name, m in module.named_modules()
               if type(m) is nn.Linear and m.in_features % block == 0 and m.weight.is_floating_point()}
    install_quantized(module, weights, kernels, torch.float32)  # (the dtype is an embedding's: none here)
    return len(weights)


def quantize_draft_head(head: nn.Module, target: nn.Module) -> int:
    """A drafter head beside a ``target`` whose weights stay quantized: its projections in Q8_0 on the
    target's kernels (``quantize_linears``), since a target on the quantized kernels reads a quarter
    of a float head's bytes per token and drafting a depth would otherwise cost a sizeable share of a
    target step (a draft's rounding never changes the output: verification is exact). Returns how
    many projections were converted: 0 beside a float target."""
    kernels = next((m.kernels for m in target.modules() if isinstance(m, QuantLinear)), None)
    return 0 if kernels is None else quantize_linears(head, kernels)


def bytes_read_ratio(part: nn.Module, whole: nn.Module) -> float:
    """The weight bytes ``part`` reads per token over ``whole``'s (``weight_bytes``: a quantized
    projection's blocks count, not its parameters, which it has none of)."""
    return sum(weight_bytes(part)) / max(1, sum(weight_bytes(whole)))


def dequantized(rows: QuantRows) -> torch.Tensor:
    """The float32 matrix of ``rows`` (gguf's reference dequantization), in use order."""
    from gguf import GGMLQuantizationType, quants

    array = quants.dequantize(rows.materialized().numpy(), GGMLQuantizationType[rows.qtype])
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))


def install_quantized(model: nn.Module, weights: dict[str, QuantRows], kernels: KernelsProtocol,
                      dtype: torch.dtype) -> None:
    """Replace the modules whose weights are in ``weights`` (Hugging Face names) by quantized ones:
    ``nn.Linear`` -> ``QuantLinear`` (its loaded bias kept), ``nn.Embedding`` -> ``QuantEmbedding``
    returning ``dtype``. Call after the float weights are loaded and before fusing."""
    for name, rows in weights.items():
        path = name.removesuffix(".weight")
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        module = getattr(parent, attr)
        replacement: nn.Module
        if isinstance(module, nn.Embedding):
            replacement = QuantEmbedding(rows, kernels, dtype)
        elif isinstance(module, nn.Linear):
            bias = module.bias
            if bias is not None and bias.device.type == "meta":
                raise RuntimeError(f"{path}.bias was not loaded before its weight was quantized")
            replacement = QuantLinear([rows], bias, kernels)
        else:
            raise TypeError(f"{name}: a {type(module).__name__} cannot hold quantized weights")
        setattr(parent, attr, replacement)


def tie_head(model: nn.Module) -> bool:
    """A tied LM head over a quantized embedding: multiplies by the embedding's blocks. False if the
    embedding is float (the float head is tied as usual)."""
    embedding = model.model.embed_tokens  # type: ignore[union-attr]
    if not isinstance(embedding, QuantEmbedding):
        return False
    model.lm_head = QuantLinear.tied(embedding)  # type: ignore[assignment]
    return True


@dataclass
class QuantReport:
    """What the load did with quantized weights, for the startup line."""

    choice: QuantChoice
    types: Counter[str] = field(default_factory=Counter)  # block type -> weights kept in it
    notes: list[str] = field(default_factory=list)
    quantized_bytes: int = 0
    float_bytes: int = 0

    def measure(self, model: nn.Module) -> None:
        self.quantized_bytes, self.float_bytes = weight_bytes(model)

    def describe(self) -> str:
        """``weights 57.6 MiB quantized (Q4_1 x210, Q8_0 x1, on AVX-512 VNNI kernels) + 0.1 MiB float; ...``."""
        mib = 2 ** 20
        if self.types:
            kinds = ", ".join(f"{t} x{n}" for t, n in sorted(self.types.items()))
            variant = getattr(getattr(self.choice.kernels, "variant", None), "description", "quantized kernels")
            refused = f"; {self.choice.note}" if self.choice.note else ""
            text = (f"weights {self.quantized_bytes / mib:.1f} MiB quantized ({kinds}, on {variant}{refused}) + "
                    f"{self.float_bytes / mib:.1f} MiB float")
        else:
            text = f"weights {self.float_bytes / mib:.1f} MiB float"
            if self.choice.reason and self.choice.quantization != "none":
                text += f" (quantized weights dequantized: {self.choice.reason})"
        return "; ".join([text, *self.notes])


def gguf_keeps_blocks(path: Path) -> bool:
    """Whether the checkpoint at ``path`` (a folder or a GGUF file) holds a tensor of a type the
    kernels multiply, so that ``quantization=auto`` keeps some weights in their blocks."""
    if not path.is_file():
        return False
    from gguf import GGMLQuantizationType

    from infer.loader.gguf import open_gguf

    return any(GGMLQuantizationType(t.tensor_type).name in KEPT_TYPES for t in open_gguf(path).tensors.values())
