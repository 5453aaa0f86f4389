"""Load models: Hugging Face-format folders (config, safetensors, tokenizer) and GGUF files."""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from infer.backends import Backend, choose_backend
from infer.backends.backend import TorchBackend
from infer.loader.hub import DEFAULT_MODEL, is_gguf_file, resolve_model_path
from infer.loader.tokenizer import Tokenizer
from infer.loader.weights import load_safetensors
from infer.models import MODEL_REGISTRY
from infer.models.config import CheckpointError, ModelConfig, model_family, split_packed
from infer.models.layers import rope_inv_freq

if TYPE_CHECKING:
    from infer.backends.plan import ExecutionPlan, QuantChoice
    from infer.models.layers import DecoderOnlyLM
    from infer.models.quantized import QuantRows

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"device={device!r} is invalid: use cpu, cuda, cuda:N or auto")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    return choose_dtype(dtype, device)[0]


def choose_dtype(dtype: str | torch.dtype, device: torch.device, quantized: bool = False) -> tuple[torch.dtype, str]:
    """The dtype to run in and why (for the run summary).

    A model whose weights stay quantized (``quantized``) runs float32 under ``auto``: the quantized
    kernels take float32 activations (and quantize them per block themselves).

    ``auto`` picks bfloat16 where the hardware computes it natively: a GPU with bf16 support, or
    a CPU with avx512_bf16 / AMX / ARM bf16 instructions (there, with pre-packed weights, it runs
    about twice as fast as float32). Elsewhere float32 on CPU (bf16 would be emulated and slower)
    and float16 on older GPUs.
    """
    if isinstance(dtype, torch.dtype):
        return dtype, "as requested"
    if dtype == "auto":
        if quantized:
            return torch.float32, "auto: quantized weights multiply float32 activations"
        if device.type == "cuda":
            if torch.cuda.is_bf16_supported():
                return torch.bfloat16, "auto: this GPU supports bfloat16"
            return torch.float16, "auto: this GPU has no bfloat16"
        feature = cpu_bf16_feature()
        if feature is not None:
            return torch.bfloat16, f"auto: this CPU computes bfloat16 natively, {feature}"
        return torch.float32, "auto: this CPU has no native bfloat16 instructions such as avx512_bf16 or amx_bf16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: use {', '.join(DTYPES)} or auto")
    return DTYPES[dtype], "as requested"


def cpu_bf16_feature() -> str | None:
    """The CPU flag that gives native bfloat16 arithmetic, or None (``kernels.build.cpu_flags``)."""
    from infer.kernels import build

    flags = build.cpu_flags()
    return next((flag for flag in ("amx_bf16", "avx512_bf16", "bf16") if flag in flags), None)


def load_config(ref: str | os.PathLike[str]) -> ModelConfig:
    """The model configuration of a folder (``config.json`` + generation config) or a GGUF file."""
    path = resolve_model_path(ref)
    if path.is_file():
        from infer.loader.gguf import gguf_config, open_gguf

        return gguf_config(open_gguf(path))
    config = ModelConfig.from_file(path / "config.json")
    gen = path / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{gen}: not valid JSON ({err})") from None
        if eos is not None:  # generation_config's EOS list is the one generation should stop on
            config.eos_token_ids = [eos] if isinstance(eos, int) else [int(e) for e in eos]
    return config


@dataclass
class Checkpoint:
    """A checkpoint's configuration and tensors as read (``read_checkpoint``), not yet a model:
    float tensors by Hugging Face name (with the file each came from), the blocks of the quantized
    ones kept as they are, and a GGUF's RoPE scaling."""

    path: Path
    config: ModelConfig
    tensors: dict[str, tuple[torch.Tensor, Path]]
    quantized: dict[str, QuantRows] = field(default_factory=dict)
    rope_divisors: torch.Tensor | None = None  # a GGUF's per-frequency RoPE scaling (Llama 3.1 and later)
    gguf_file: Any = None  # the open GGUF (its pages are released as the model takes the weights)
    implied_by: str = "config.json implies"  # how shape errors name the source of truth
    notes: list[str] = field(default_factory=list)  # why a quantized tensor was dequantized


def read_checkpoint(ref: str | os.PathLike[str], dtype: torch.dtype, device: torch.device,
                    keep_blocks: bool = False) -> Checkpoint:
    """Read a checkpoint: a folder's safetensors, or a GGUF's tensors (with ``keep_blocks``, the
    quantized ones the kernels run kept in their blocks, else dequantized into ``dtype``), on
    ``device``, under the names of the text model (a multimodal Gemma 3's vision parts left out)."""
    path = resolve_model_path(ref)
    config = load_config(path)
    checkpoint = Checkpoint(path, config, {})
    if path.is_file():
        from gguf import GGMLQuantizationType

        from infer.loader.gguf import gguf_weights, hf_tensor_name, open_gguf
        from infer.loader.quantized import gguf_keep

        gguf_file = open_gguf(path)
        keep = None
        if keep_blocks:
            types = {hf_tensor_name(name, config.model_type) or name: GGMLQuantizationType(t.tensor_type).name
                     for name, t in gguf_file.tensors.items()}
            keep, checkpoint.notes = gguf_keep(types)
        weights = gguf_weights(gguf_file, config, dtype, device, keep)
        tensors: dict[str, tuple[torch.Tensor, Path]] = {name: (tensor, path) for name, tensor in weights.state.items()}
        checkpoint.quantized = weights.quantized
        checkpoint.rope_divisors = weights.rope_freq_divisors
        checkpoint.gguf_file = gguf_file
        checkpoint.implied_by = "the GGUF metadata implies"
    else:
        tensors = load_safetensors(path, dtype, device)
    rename = model_family(config.model_type).tensor_name
    for name, (tensor, source) in tensors.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if rename is not None:
            name = rename(name)
            if not name:  # a part the family's model does not run (a multimodal Gemma 3's image tower)
                continue
        checkpoint.tensors[name] = (tensor, source)
    return checkpoint


def build_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, backend: Backend,
                quant: QuantChoice, fuse: bool = True, progress: Callable[[str], None] | None = None) -> DecoderOnlyLM:
    """The architecture ``checkpoint`` names, filled with its tensors (checked against the
    architecture's names and shapes), in ``dtype`` on ``device``: weights quantized as ``quant``
    says, projections fused (``fuse``), and put in ``backend``'s form with its modes
    (``Backend.prepare``, which records it as ``model.backend``). ``model.weights_summary`` says
    what the weights became."""
    from infer.loader.quantized import QuantReport, install_quantized, quantize_float_weights, tie_head
    from infer.models.quantized import pack_quantized

    path, config = checkpoint.path, checkpoint.config
    report = QuantReport(quant)
    report.notes += checkpoint.notes
    with torch.device("meta"):
        model = MODEL_REGISTRY[config.model_type](config)
    expected = model.state_dict()
    quantized = dict(checkpoint.quantized)
    implied_by = checkpoint.implied_by
    state: dict[str, torch.Tensor] = {}
    tensors = _split_packed(checkpoint.tensors, model_family(config.model_type).packed_modules, expected, implied_by)
    for name, (tensor, source) in tensors.items():
        if name not in expected:
            raise CheckpointError(f"{source}: unexpected tensor {name!r} for a {config.model_type} model")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                  f"{implied_by} {tuple(expected[name].shape)}")
        state[name] = tensor
    for name, rows in quantized.items():
        if name not in expected:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for a {config.model_type} model")
        if (rows.rows, rows.in_features) != tuple(expected[name].shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {(rows.rows, rows.in_features)}, "
                                  f"{implied_by} {tuple(expected[name].shape)}")
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        quantized.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    if quant.keeps_blocks and quant.quantization not in ("auto", "none"):
        made, notes = quantize_float_weights(state, quant.quantization)
        quantized.update(made)
        report.notes += notes
    missing = sorted(set(expected) - set(state) - set(quantized))
    if missing:
        raise CheckpointError(f"{path}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                              + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""))
    model.load_state_dict(state, strict=False, assign=True)
    if quantized:
        assert quant.kernels is not None
        report.types.update(rows.qtype for rows in quantized.values())
        install_quantized(model, quantized, quant.kernels, dtype)
    if config.tie_word_embeddings and not tie_head(model):
        model.lm_head.weight = model.model.embed_tokens.weight
    inv_freq = rope_inv_freq(config)
    rope_divisors = checkpoint.rope_divisors
    if rope_divisors is not None:  # a GGUF's precomputed per-frequency RoPE scaling (Llama 3.1 and later)
        if rope_divisors.shape != inv_freq.shape:
            raise CheckpointError(f"{path}: rope_freqs has shape {tuple(rope_divisors.shape)}, "
                                  f"expected {tuple(inv_freq.shape)}")
        inv_freq = inv_freq / rope_divisors.float()
    model.inv_freq = inv_freq.to(device)
    if fuse:
        model.fuse_projections()
    gguf_file = checkpoint.gguf_file
    if gguf_file is not None:
        from infer.loader.gguf import release_mapped_pages

        # the pages fusing read, then those each repacking reads: each weight resident once
        release_mapped_pages(gguf_file)
        pack_quantized(model, functools.partial(release_mapped_pages, gguf_file))
    else:
        pack_quantized(model)
    if quantized:
        # A token must get the same bits in a decode step and in any verification pass (greedy
        # speculation's exactness). The quantized kernels are row-invariant; PyTorch's attention is
        # not, so the layers get exact_attention. Where the C decoder stack takes the model
        # (CpuStack.build: its own attention computes each token alone) it runs every pass, prefill
        # included (its max_rows is lifted), so the layers run only where it declines a pass (a
        # FlexAttention tree mask, autograd, torch.compile) or is not built; those passes must be
        # row-invariant too, so exact_attention stays set either way (the stack ignores it). The
        # layers' and the stack's attention round differently: a model runs its passes one way.
        from infer.backends.exact import make_attention_exact

        make_attention_exact(model)
    backend.prepare(model, progress)  # the backend's form of the model and its modes, recorded on it
    if gguf_file is not None:
        from infer.loader.gguf import release_mapped_pages

        release_mapped_pages(gguf_file)
    report.measure(model)
    model.weights_summary = report.describe()
    return model.eval()


def plan_load(ref: str | os.PathLike[str], dtype: str | torch.dtype = "auto", device: str = "auto",
              fuse: bool = True, pack: bool | None = None, backend: str = "auto", compile: bool = False,
              quantization: str = "auto", exact: bool = False, cuda_graphs: bool = False,
              tree_attention: str = "sdpa") -> ExecutionPlan:
    """How ``ref`` will run (``backends.plan.ExecutionPlan``), decided before a weight is read, so a
    refusal comes quickly: whether weights stay quantized and on which kernels, the dtype (float32
    activations under ``auto`` where they do), the backend and its modes. The options are
    ``load_model``'s."""
    from infer.backends.plan import ExecutionPlan, QuantChoice, choose_quant_kernels
    from infer.loader.quantized import check_quantization, gguf_keeps_blocks

    path = resolve_model_path(ref)
    dev = resolve_device(device)
    check_quantization(quantization)
    if pack is None:
        pack = fuse and dev.type == "cpu"
    inference = pack or dev.type != "cpu"  # the inference layout (else training or conversion's)
    if not inference and backend.startswith("cpu-kernels"):
        raise ValueError(f"backend {backend!r} needs the packed inference layout (fuse=True, pack=True)")
    if fuse and inference and not compile:
        quant = choose_quant_kernels(quantization, dev, backend)
    elif quantization in ("auto", "none"):
        quant = QuantChoice(quantization, None, "compiled mode" if compile else "loaded unpacked")
    else:
        raise ValueError(f"quantization={quantization!r} needs the packed inference layout and eager mode "
                         "(fuse=True, pack=True, compile=False)")
    keeps = quant.keeps_blocks and (quantization != "auto" or gguf_keeps_blocks(path))
    torch_dtype, dtype_reason = choose_dtype(dtype, dev, keeps)
    if inference or cuda_graphs:  # (unpacked is on the CPU, where choose_backend refuses cuda_graphs)
        chosen = choose_backend(dev, torch_dtype, backend, compile, exact=exact, cuda_graphs=cuda_graphs,
                                tree_attention=tree_attention)
    else:
        chosen = TorchBackend(reasons=["loaded unpacked (training or conversion layout)"], compiled=compile, exact=exact,
                              tree_attention=tree_attention)
    return ExecutionPlan(dev, torch_dtype, dtype_reason, chosen, quant, fuse)


def load_model(ref: str | os.PathLike[str], dtype: str | torch.dtype = "auto",
               device: str = "auto", fuse: bool = True, pack: bool | None = None, backend: str = "auto",
               compile: bool = False, quantization: str = "auto", exact: bool = False, cuda_graphs: bool = False,
               progress: Callable[[str], None] | None = None,
               plan: ExecutionPlan | None = None) -> tuple[DecoderOnlyLM, ModelConfig]:
    """Read a checkpoint (``read_checkpoint``) and build its model (``build_model``) as ``plan``
    says (``plan_load``; made from the other options where not given): a folder's safetensors, or a
    GGUF's tensors (quantized ones kept in their blocks where the quantized kernels run, else
    dequantized into the plan's dtype).

    ``fuse`` merges q/k/v and gate/up projections for faster inference; pass False to get the
    Hugging Face module layout (training, saving). ``pack`` gives a fused model on CPU the inference
    form of ``backend`` (``infer.backends``: ``auto``, ``torch``, ``cpu-kernels``), recorded as
    ``model.backend``; the default packs a fused CPU model. The backend's modes: ``compile`` (the
    forward through torch.compile), ``exact`` (exact greedy, checked on this machine),
    ``cuda_graphs`` (CUDA only). ``quantization`` (``loader.quantized``: ``auto``, ``none``,
    ``q8_0``, ``q4_0``, ``q4_1``, ``q5_0``) says which weights stay or become quantized; ``dtype``
    ``auto`` runs float32 activations where they do (``choose_dtype``). ``model.weights_summary``
    says what it did. ``progress`` hears what takes time.
    """
    if plan is None:
        plan = plan_load(ref, dtype, device, fuse, pack, backend, compile, quantization, exact, cuda_graphs)
    checkpoint = read_checkpoint(resolve_model_path(ref), plan.dtype, plan.device, keep_blocks=plan.quant.keeps_blocks)
    model = build_model(checkpoint, plan.dtype, plan.device, plan.backend, plan.quant, plan.fuse, progress)
    return model, checkpoint.config


def forget_parsed_checkpoints() -> None:
    """Drop the GGUF metadata parsed for loading a model and its tokenizer (``gguf.open_gguf`` keeps
    it so the file is parsed once for both): about 8 MB of strings for a 49k-token vocabulary and
    its merges. The weights keep their own mapping of the file."""
    from infer.loader.gguf import _open_cached

    _open_cached.cache_clear()


def _split_packed(tensors: dict[str, tuple[torch.Tensor, Path]], packed: Mapping[str, tuple[str, ...]],
                  expected: dict[str, torch.Tensor], implied_by: str) -> dict[str, tuple[torch.Tensor, Path]]:
    """``tensors`` with each fused one the family declares (``ModelFamily.packed_modules``: Phi-3's
    ``qkv_proj``) split along its rows into the modules it stacks, each taking the rows the
    architecture gives it. The parts are views of the fused tensor: no copy is made."""
    if not packed:
        return tensors
    out: dict[str, tuple[torch.Tensor, Path]] = {}
    for name, (tensor, source) in tensors.items():
        parts = None if name in expected else split_packed(name, packed)
        if parts is None or not all(part in expected for part in parts):
            out[name] = (tensor, source)  # (a name the model lacks is reported as unexpected)
            continue
        rows = [expected[part].shape[0] for part in parts]
        want = (sum(rows), *expected[parts[0]].shape[1:])
        if tuple(tensor.shape) != want:
            raise CheckpointError(f"{source}: tensor {name!r} has shape {tuple(tensor.shape)}, {implied_by} {want} "
                                  f"({', '.join(p.rsplit('.', 2)[-2] for p in parts)} stacked)")
        for part, piece in zip(parts, tensor.split(rows), strict=True):
            out[part] = (piece, source)
    return out


def load_tokenizer(ref: str | os.PathLike[str], config: ModelConfig | None = None) -> Tokenizer:
    path = resolve_model_path(ref)
    config = config or load_config(path)
    if path.is_file():
        from infer.loader.gguf import gguf_tokenizer, open_gguf

        backend, tokenizer_config = gguf_tokenizer(open_gguf(path))
        return Tokenizer(backend, tokenizer_config, eos_token_ids=config.eos_token_ids,
                         source=f"{path} (tokenizer.chat_template)")
    return Tokenizer.from_folder(path, eos_token_ids=config.eos_token_ids)


__all__ = ["DEFAULT_MODEL", "Checkpoint", "CheckpointError", "ModelConfig", "Tokenizer", "build_model", "choose_dtype",
           "cpu_bf16_feature", "forget_parsed_checkpoints", "is_gguf_file", "load_config", "load_model", "load_tokenizer",
           "plan_load", "read_checkpoint", "resolve_device", "resolve_dtype", "resolve_model_path"]
