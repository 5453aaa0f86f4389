"""Read GGUF files (llama.cpp's format) with the ``gguf`` library: config, weights, tokenizer.

Weights in the block types the quantized kernels multiply stay in their blocks where the loader
asks for it (``infer.loader.quantized``: views of the file's mapping, or copies where rows are
reordered or fused); the others are dequantized once, at load, into the dtype the engine runs in.
The mapping follows llama.cpp's own
converter (``convert_hf_to_gguf.py``) backwards:

* config: ``<arch>.block_count``, ``.embedding_length``, ``.attention.head_count`` ... become the
  ``config.json`` fields; a file without ``output.weight`` has tied embeddings;
* tensors: ``blk.N.attn_q.weight`` -> ``model.layers.N.self_attn.q_proj.weight`` and so on. For the
  ``llama`` architecture the converter reorders each head's q/k rows so that GGML's RoPE, which
  rotates adjacent pairs, computes what Hugging Face's rotate-half RoPE computes; the rows are put
  back here. ``qwen2``/``qwen3``/``gemma3`` files use GGML's rotate-half RoPE and are stored as they
  are; the norms of a block that scales by ``1 + w`` (``BlockSpec.norm_offset``, ``gemma3``'s) are
  stored as ``1 + w``, and ``gemma3``'s four per-layer norms have their own names;
* tokenizer: ``tokenizer.ggml.tokens``/``merges``/``token_type`` become a byte-level BPE
  ``tokenizers`` object, split the way ``tokenizer.ggml.pre`` says llama.cpp splits text; a
  SentencePiece vocabulary (``llama`` tokenizer model, Gemma's) a BPE with byte fallback.
"""

from __future__ import annotations

import contextlib
import functools
import math
import mmap
import re
import struct
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf.constants import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGUF_MAGIC,
    GGMLQuantizationType,
    GGUFValueType,
)
from gguf.quants import quant_shape_to_byte_shape
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from infer.models import MODEL_REGISTRY
from infer.models.config import CheckpointError, ModelConfig, model_family
from infer.models.quantized import QuantRows

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")  # general.architecture values infer reads

# Tensor storage types infer dequantizes (with gguf.quants). Others (the IQ and ternary families,
# MXFP4, integer tensors) are refused by name rather than guessed at.
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1",
                          "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")

# GGUF tensor-name parts -> Hugging Face module names (per layer, then global).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its four per-layer norms differently: its ffn_norm is the norm before the MLP.
_GEMMA3_LAYER_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# The per-layer name tables by architecture (the common one for any not listed).
_ARCHITECTURE_LAYER_TENSORS = {"gemma3": _GEMMA3_LAYER_TENSORS}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")
ROPE_FREQS_TENSOR = "rope_freqs.weight"  # Llama 3.1-style precomputed RoPE frequency divisors

# How llama.cpp splits text before BPE, by ``tokenizer.ggml.pre`` (grouped as llama.cpp groups them).
_GPT2 = "gpt2"  # the GPT-2 regex (what tokenizers' ByteLevel pre-tokenizer applies)
_DIGITS_GPT2 = "digits+gpt2"  # every digit on its own, then the GPT-2 regex
_LLAMA3 = "llama3"
_QWEN2 = "qwen2"
PRE_TOKENIZER_STYLES = {
    "default": _GPT2, "gpt-2": _GPT2, "gpt2": _GPT2, "phi-2": _GPT2, "mpt": _GPT2, "olmo": _GPT2,
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2, "command-r": _DIGITS_GPT2,
    "codeshell": _DIGITS_GPT2, "exaone": _DIGITS_GPT2,
    "llama3": _LLAMA3, "llama-v3": _LLAMA3, "llama-bpe": _LLAMA3, "falcon3": _LLAMA3,
    "qwen2": _QWEN2, "deepseek-r1-qwen": _QWEN2, "megrez": _QWEN2,
}
_SPLIT_REGEX = {
    _LLAMA3: (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    _QWEN2: (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
             r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
}
# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor's entry (what ``gguf.ReaderTensor`` holds, less the raw header field)."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF order: fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int  # from the start of the file
    # A view of the file's mapping shaped as gguf.GGUFReader shapes it: float and integer types as
    # their numpy dtype, PyTorch's dimension order; block types as uint8 rows of blocks.
    data: np.ndarray[Any, Any]


# Scalar metadata types -> struct format (little-endian); the numpy dtypes are gguf-py's own.
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i", GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
# Tensor types gguf.GGUFReader gives their own numpy dtype (the others are bytes of blocks).
_ELEMENT_DTYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}


class _Truncated(Exception):
    """The header claims more bytes than the file holds."""


class GGUFFile:
    """One GGUF file, parsed once: metadata and memory-mapped tensors.

    The header is read here rather than by ``gguf.GGUFReader``, which builds a numpy view per
    element of every metadata array (seconds for a 49k-token vocabulary with its merges, ~10 s for
    Gemma's 262k tokens): numeric arrays are read whole with numpy and strings straight from the
    mapping. The layout, value and tensor types, block sizes and alignment rules are gguf-py's
    (``gguf.constants``), and ``tests/models/test_gguf.py`` checks every value against its reader.
    ``reader`` still gives gguf-py's own reader where a caller needs its raw fields.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as handle:
                self.mapping = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as err:  # ValueError: an empty file cannot be mapped
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
        self.data: np.ndarray[Any, Any] = np.frombuffer(self.mapping, dtype=np.uint8)
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensor] = {}
        try:
            self._parse()
        except _Truncated:
            raise CheckpointError(f"{path}: not a readable GGUF file (truncated: the header runs past the end "
                                  f"of its {len(self.mapping)} bytes)") from None
        except (ValueError, KeyError, UnicodeDecodeError, struct.error) as err:
            raise CheckpointError(f"{path}: not a readable GGUF file ({type(err).__name__}: {err})") from None
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{path}: no general.architecture in the GGUF metadata")
        self.architecture = arch

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value as ``gguf.ReaderField.contents()`` gives it (arrays as lists)."""
        value = self.fields.get(key)
        if value is None:
            return default
        return value.tolist() if isinstance(value, np.ndarray) else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: required GGUF metadata {key!r} is missing")
        return value

    def arch_key(self, suffix: str) -> str:
        return f"{self.architecture}.{suffix}"

    @functools.cached_property
    def reader(self) -> Any:
        """gguf-py's own ``GGUFReader`` of the file, for callers that need its raw fields (writing a
        file like this one): slow on a large vocabulary, so built only when asked for."""
        return gguf.GGUFReader(self.path)

    # -- parsing: layout as gguf.GGUFReader reads it

    def _unpack(self, fmt: str, offset: int) -> tuple[Any, int]:
        size = struct.calcsize(fmt)
        if offset + size > len(self.mapping):
            raise _Truncated
        return struct.unpack_from(fmt, self.mapping, offset)[0], offset + size

    def _string(self, offset: int) -> tuple[str, int]:
        length, offset = self._unpack("<Q", offset)
        end = offset + length
        if end > len(self.mapping):
            raise _Truncated
        return str(self.mapping[offset:end], encoding="utf-8"), end

    def _value(self, value_type: int, offset: int) -> tuple[Any, int]:
        kind = GGUFValueType(value_type)  # ValueError names an unknown type
        if kind == GGUFValueType.STRING:
            return self._string(offset)
        if kind != GGUFValueType.ARRAY:
            return self._unpack(_SCALAR_FORMATS[kind], offset)
        item_type, offset = self._unpack("<I", offset)
        count, offset = self._unpack("<Q", offset)
        item = GGUFValueType(item_type)
        if item in _SCALAR_FORMATS:  # numbers: one numpy read (a view of the mapping)
            dtype = np.dtype(gguf.GGUFReader.gguf_scalar_to_np[item]).newbyteorder("<")
            end = offset + count * dtype.itemsize
            if end > len(self.mapping):
                raise _Truncated
            return np.frombuffer(self.mapping, dtype=dtype, count=count, offset=offset), end
        if item == GGUFValueType.STRING:
            return self._strings(count, offset)
        values: list[Any] = []  # arrays of arrays: flattened, as gguf-py reads them
        for _ in range(count):
            value, offset = self._value(item, offset)
            values.extend(value.tolist() if isinstance(value, np.ndarray) else value)
        return values, offset

    def _strings(self, count: int, offset: int) -> tuple[list[str], int]:
        mapping, unpack, size = self.mapping, struct.Struct("<Q").unpack_from, len(self.mapping)
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if offset + 8 > size:
                raise _Truncated
            (length,) = unpack(mapping, offset)
            offset += 8
            end = offset + length
            if end > size:
                raise _Truncated
            append(str(mapping[offset:end], encoding="utf-8"))
            offset = end
        return out, offset

    def _parse(self) -> None:
        magic, offset = self._unpack("<I", 0)
        if magic != GGUF_MAGIC:
            raise ValueError("GGUF magic invalid")
        version, offset = self._unpack("<I", offset)
        supported = gguf.gguf_reader.READER_SUPPORTED_VERSIONS
        if version not in supported:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            if swapped in supported:
                raise ValueError(f"a big-endian GGUF file (version {swapped}); infer reads little-endian ones")
            raise ValueError(f"GGUF version {version} is not one gguf-py reads ({', '.join(map(str, supported))})")
        tensor_count, offset = self._unpack("<Q", offset)
        kv_count, offset = self._unpack("<Q", offset)
        self.fields.update({"GGUF.version": version, "GGUF.tensor_count": tensor_count, "GGUF.kv_count": kv_count})
        for _ in range(kv_count):
            key, offset = self._string(offset)
            value_type, offset = self._unpack("<I", offset)
            if key in self.fields:
                raise ValueError(f"duplicate metadata key {key!r}")
            if key == "general.alignment" and value_type != GGUFValueType.UINT32:
                raise ValueError("Bad type for general.alignment field")
            self.fields[key], offset = self._value(value_type, offset)
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(tensor_count):
            name, offset = self._string(offset)
            n_dims, offset = self._unpack("<I", offset)
            end = offset + 8 * n_dims
            if end > len(self.mapping):
                raise _Truncated
            dims = tuple(int(d) for d in np.frombuffer(self.mapping, dtype="<u8", count=n_dims, offset=offset))
            raw_type, offset = self._unpack("<I", end)
            relative, offset = self._unpack("<Q", offset)
            infos.append((name, dims, raw_type, relative))
        alignment = int(self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT))
        if alignment == 0 or alignment & (alignment - 1):
            raise ValueError("Invalid alignment: must be a non-zero power of two")
        start = offset + (-offset % alignment)
        for name, dims, raw_type, relative in infos:
            if name in self.tensors:
                raise ValueError(f"duplicate tensor {name!r}")
            self.tensors[name] = self._tensor(name, dims, GGMLQuantizationType(raw_type), start + relative)

    def _tensor(self, name: str, dims: tuple[int, ...], qtype: GGMLQuantizationType, offset: int) -> GGUFTensor:
        n_elements = math.prod(dims)  # exact (a corrupt header's sizes must not wrap around)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elements * type_size // block_size
        if offset + n_bytes > len(self.mapping):
            raise ValueError(f"tensor {name!r} ({n_bytes} bytes at offset {offset}) runs past the end of the "
                             f"file ({len(self.mapping)} bytes): truncated")
        shape = tuple(reversed(dims))
        element = _ELEMENT_DTYPES.get(qtype)
        if element is None:
            data = self.data[offset:offset + n_bytes].reshape(quant_shape_to_byte_shape(shape, qtype))
        else:
            data = self.data[offset:offset + n_bytes].view(np.dtype(element).newbyteorder("<")).reshape(shape)
        return GGUFTensor(name, qtype, dims, n_elements, n_bytes, offset, data)


@functools.lru_cache(maxsize=2)
def _open_cached(path: str, _mtime_ns: int, _size: int) -> GGUFFile:
    return GGUFFile(Path(path))


def open_gguf(path: Path) -> GGUFFile:
    """Parse ``path`` (cached: loading the model and then its tokenizer reads the file once)."""
    stat = path.stat()
    return _open_cached(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


# ------------------------------------------------------------------------------------------ config


def gguf_config(f: GGUFFile) -> ModelConfig:
    """The model configuration the metadata describes, checked like a ``config.json``."""
    if f.architecture not in GGUF_ARCHITECTURES:
        raise CheckpointError(f"{f.path}: GGUF architecture {f.architecture!r} is not supported; infer reads "
                              f"{', '.join(GGUF_ARCHITECTURES)}")
    heads = int(f.require(f.arch_key("attention.head_count")))
    hidden = int(f.require(f.arch_key("embedding_length")))
    kv_heads = _one_per_model(f, "attention.head_count_kv", heads)
    head_dim = int(f.get(f.arch_key("attention.key_length"), hidden // heads))
    rotary = f.get(f.arch_key("rope.dimension_count"))
    if rotary is not None and int(rotary) != head_dim:
        raise CheckpointError(f"{f.path}: RoPE on {rotary} of {head_dim} head dimensions (partial rotary) "
                              "is not supported")
    tokens = f.get("tokenizer.ggml.tokens")
    layers = f.require(f.arch_key("block_count"))  # before a family's reader, which counts them too
    family_fields = model_family(f.architecture).gguf_fields  # what the family's metadata adds
    extra = {} if family_fields is None else family_fields(lambda suffix: f.get(f.arch_key(suffix)), hidden, heads,
                                                           head_dim)
    raw: dict[str, Any] = {
        "model_type": f.architecture,
        "vocab_size": f.get(f.arch_key("vocab_size")) or (len(tokens) if tokens else None),
        "hidden_size": hidden,
        "intermediate_size": _one_per_model(f, "feed_forward_length", None),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": f.require(f.arch_key("context_length")),
        "rms_norm_eps": f.require(f.arch_key("attention.layer_norm_rms_epsilon")),
        "rope_theta": f.get(f.arch_key("rope.freq_base"), 10000.0),
        "rope_scaling": _rope_scaling(f),
        "tie_word_embeddings": "output.weight" not in f.tensors,
        "attention_bias": "blk.0.attn_q.bias" in f.tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in f.tensors,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": _eos_ids(f),
        "torch_dtype": "float32",
        **extra,
    }
    if raw["vocab_size"] is None:
        raise CheckpointError(f"{f.path}: neither {f.arch_key('vocab_size')} nor tokenizer.ggml.tokens "
                              "gives the vocabulary size")
    return ModelConfig.from_dict({k: v for k, v in raw.items() if v is not None}, str(f.path))


def _one_per_model(f: GGUFFile, suffix: str, default: int | None) -> int | None:
    """A per-model integer that some files store per layer: accepted when every layer agrees."""
    value = f.get(f.arch_key(suffix), default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise CheckpointError(f"{f.path}: {f.arch_key(suffix)} differs between layers ({sorted(set(value))}); "
                                  "infer needs the same value in every layer")
        value = value[0]
    return None if value is None else int(value)


def _rope_scaling(f: GGUFFile) -> dict[str, Any] | None:
    kind = f.get(f.arch_key("rope.scaling.type"), "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(f.require(f.arch_key("rope.scaling.factor")))}
    raise CheckpointError(f"{f.path}: RoPE scaling {kind!r} is not supported (none, linear, and Llama 3's "
                          f"{ROPE_FREQS_TENSOR} tensor are)")


def _eos_ids(f: GGUFFile) -> list[int]:
    """EOS, plus end-of-turn / end-of-message ids (chat models stop on those)."""
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = f.get(key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    return ids


# ----------------------------------------------------------------------------------------- weights


@dataclass
class GGUFWeights:
    state: dict[str, torch.Tensor]  # Hugging Face names, unfused
    rope_freq_divisors: torch.Tensor | None  # from rope_freqs.weight: inv_freq is divided by these
    # Weights kept in their blocks (``keep`` said so), under Hugging Face names: views of the file's
    # mapping, with llama q/k rows' HF order as a row index (applied when they are copied).
    quantized: dict[str, QuantRows] = field(default_factory=dict)


def gguf_weights(f: GGUFFile, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 keep: Callable[[str, str], bool] | None = None) -> GGUFWeights:
    """Every tensor under its Hugging Face name: dequantized into ``dtype`` on ``device``, or, where
    ``keep(hf_name, type_name)`` says so, left in its quantized blocks (``GGUFWeights.quantized``)."""
    state: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantRows] = {}
    divisors = None
    # A block whose norms scale by 1 + w (BlockSpec.norm_offset): llama.cpp's converter stores them as 1 + w.
    family = MODEL_REGISTRY.get(config.model_type)
    offset_norms = family is not None and family.block_spec.norm_offset
    for name, tensor in f.tensors.items():
        if name == ROPE_FREQS_TENSOR:
            divisors = dequantize(f, tensor)
            continue
        hf_name = hf_tensor_name(name, config.model_type)
        if hf_name is None:
            raise CheckpointError(f"{f.path}: unexpected tensor {name!r} for a {config.model_type} model")
        permuted = config.model_type == "llama" and (".attn_q." in name or ".attn_k." in name)
        heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
        type_name = tensor.tensor_type.name
        if keep is not None and len(tensor.shape) == 2 and keep(hf_name, type_name):
            raw = mapped_blocks(tensor)
            order = undo_rope_row_order(torch.arange(raw.shape[0]), heads) if permuted else None
            quantized[hf_name] = QuantRows(type_name, int(tensor.shape[0]), raw, order)
            continue
        weight = dequantize(f, tensor)
        if offset_norms and name.endswith("norm.weight"):
            weight = weight - 1  # GGML's norm scales by its weight: the file holds 1 + w; the model adds the 1
        if permuted:
            weight = undo_rope_row_order(weight, heads)
        state[hf_name] = weight.to(dtype).to(device)
    return GGUFWeights(state, divisors, quantized)


def mapped_blocks(tensor: Any) -> torch.Tensor:
    """A quantized tensor's blocks as a uint8 ``[rows, row_bytes]`` view of the file's mapping (no
    copy; pages are read when first used)."""
    data = tensor.data
    with warnings.catch_warnings():  # the mapping is read-only and stays so: nothing writes to these
        warnings.simplefilter("ignore", UserWarning)
        view = torch.from_numpy(data)
    return view.view(torch.uint8).reshape(data.shape[0], -1)


def release_mapped_pages(f: GGUFFile) -> None:
    """Drop the pages of ``f``'s mapping this process has read so far (what was dequantized or copied
    at load): they stay in the page cache, and the tensors still in use as views fault theirs back
    in when they are next read, so each weight is resident once."""
    if hasattr(mmap, "MADV_DONTNEED"):
        with contextlib.suppress(OSError, ValueError):
            f.mapping.madvise(mmap.MADV_DONTNEED)


def hf_tensor_name(name: str, model_type: str = "llama") -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None if unknown."""
    if name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[name]
    parts = _ARCHITECTURE_LAYER_TENSORS.get(model_type, _LAYER_TENSORS)
    match = _LAYER_NAME.fullmatch(name)
    if match is None or match.group(2) not in parts:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{parts[part]}.{kind}"


def dequantize(f: GGUFFile, tensor: Any) -> torch.Tensor:
    """One tensor as float32 in PyTorch's layout (GGUF lists dimensions fastest-first)."""
    from gguf import quants

    qtype = tensor.tensor_type
    if qtype.name not in SUPPORTED_TENSOR_TYPES:
        raise CheckpointError(f"{f.path}: tensor {tensor.name!r} is stored as {qtype.name}, which infer does not "
                              f"dequantize (supported: {', '.join(SUPPORTED_TENSOR_TYPES)})")
    array = quants.dequantize(tensor.data, qtype)
    if not array.flags.writeable:  # an F32 tensor comes back as a view of the read-only file mapping
        array = array.copy()
    shape = tuple(int(d) for d in reversed(tensor.shape))
    return torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).reshape(shape)


def undo_rope_row_order(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reverse llama.cpp's q/k row reordering for GGML's adjacent-pair RoPE.

    Within each head the converter interleaves the first and second halves of the rows
    (row ``i`` of half ``h`` goes to ``2 i + h``); reading them back de-interleaves. Works for a
    weight ``[rows, in]`` and a bias ``[rows]`` alike.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# --------------------------------------------------------------------------------------- tokenizer


def gguf_tokenizer(f: GGUFFile) -> tuple[HFTokenizer, dict[str, Any]]:
    """A ``tokenizers`` object plus the ``tokenizer_config.json`` fields (special tokens, chat template)."""
    kind = f.get("tokenizer.ggml.model")
    if kind == "llama":
        return _with_specials(f, sentencepiece_bpe(f))
    if kind != "gpt2":
        raise CheckpointError(f"{f.path}: tokenizer model {kind!r} is not supported; infer builds byte-level BPE "
                              "(tokenizer.ggml.model 'gpt2') and SentencePiece BPE ('llama') tokenizers from GGUF files")
    tokens: list[str] = list(f.require("tokenizer.ggml.tokens"))
    merges: list[str] = list(f.require("tokenizer.ggml.merges"))
    types: list[int] = list(f.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    pre = f.get("tokenizer.ggml.pre", "default")
    style = PRE_TOKENIZER_STYLES.get(pre)
    if style is None:
        raise CheckpointError(f"{f.path}: pre-tokenizer {pre!r} (tokenizer.ggml.pre) is not supported; infer knows "
                              f"{', '.join(sorted(PRE_TOKENIZER_STYLES))}")

    # Vocabulary entries are spelled in GPT-2's byte alphabet; added tokens may be stored as plain text.
    alphabet = byte_alphabet()
    letters = set(alphabet.values())
    vocab: dict[str, int] = {}
    for index, (token, kind_id) in enumerate(zip(tokens, types, strict=True)):
        spelled = token
        if kind_id not in (_CONTROL, _USER_DEFINED) and not set(token) <= letters:
            spelled = "".join(alphabet[b] for b in token.encode("utf-8"))
        vocab.setdefault(spelled, index)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=style == _LLAMA3, fuse_unk=False)  # type: ignore[arg-type]
    tok = HFTokenizer(model)
    tok.pre_tokenizer = _pre_tokenizer(style)
    tok.decoder = decoders.ByteLevel()
    # Control tokens (<|im_end|>) are special; user-defined ones (<think>) are matched whole but kept
    # in decoded text. Both are already in the vocabulary, so they keep the file's ids.
    added = {index: kind_id for index, kind_id in enumerate(types) if kind_id in (_CONTROL, _USER_DEFINED)}
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, k in added.items() if k == _CONTROL])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, k in added.items() if k == _USER_DEFINED])
    for index in added:
        if tok.token_to_id(tokens[index]) != index:  # a duplicate spelling would renumber the vocabulary
            raise CheckpointError(f"{f.path}: added token {tokens[index]!r} would get id "
                                  f"{tok.token_to_id(tokens[index])}, the file says {index}")
    return _with_specials(f, tok)


def _with_specials(f: GGUFFile, tok: HFTokenizer) -> tuple[HFTokenizer, dict[str, Any]]:
    """BOS/EOS added as the file says (a post-processor) and the ``tokenizer_config.json`` fields."""
    tokens: list[str] = list(f.require("tokenizer.ggml.tokens"))
    vocab = tok.get_vocab(with_added_tokens=True)

    def token_at(key: str) -> str | None:
        index = f.get(f"tokenizer.ggml.{key}")
        return tokens[int(index)] if index is not None and 0 <= int(index) < len(tokens) else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise (so does transformers).
    add_bos = bool(f.get("tokenizer.ggml.add_bos_token", f.get("tokenizer.ggml.model") == "llama"))
    add_eos = bool(f.get("tokenizer.ggml.add_eos_token", False))
    template = [*([f"{bos}:0"] if add_bos and bos else []), "$A:0", *([f"{eos}:0"] if add_eos and eos else [])]
    specials = [(t, vocab[t]) for t in {bos, eos} if t is not None and t in vocab]
    tok.post_processor = processors.TemplateProcessing(single=" ".join(template), special_tokens=specials)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "unk_token": token_at("unknown_token_id"),
        "pad_token": token_at("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(f.get(f.arch_key("context_length"), 2048)),
    }
    chat_template = f.get("tokenizer.chat_template")
    if isinstance(chat_template, str):
        config["chat_template"] = chat_template
    return tok, {k: v for k, v in config.items() if v is not None}


# The architectures (name prefixes) whose SentencePiece vocabulary ``sentencepiece_bpe`` reads: the
# form below (no space prefix, merges in vocabulary order) is theirs.
_SENTENCEPIECE_ARCHITECTURES = ("gemma",)


def sentencepiece_bpe(f: GGUFFile) -> HFTokenizer:
    """A SentencePiece BPE vocabulary (``tokenizer.ggml.model`` 'llama') as a ``tokenizers`` BPE with
    byte fallback, built the way transformers builds it from the same file (the reference the tests
    compare with): spaces become U+2581 before BPE runs over the whole text, and the merges, which
    the file does not list, are every split of a vocabulary entry into two entries, best first.

    Only Gemma's form is read: no space prefix (``add_space_prefix`` false). Its merge order is the
    vocabulary's order (Gemma's scores do not follow it), and its all-space entries are stored as
    spaces although BPE meets them as U+2581 runs, so they are respelled.
    """
    if f.get("tokenizer.ggml.add_space_prefix", True) or not f.architecture.startswith(_SENTENCEPIECE_ARCHITECTURES):
        raise CheckpointError(f"{f.path}: SentencePiece vocabulary of a {f.architecture!r} model (tokenizer.ggml.model "
                              "'llama' with a space prefix, Llama 2 style) is not supported; infer reads Gemma's")
    raw: list[str] = list(f.require("tokenizer.ggml.tokens"))
    types: list[int] = list(f.get("tokenizer.ggml.token_type") or [1] * len(raw))
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in raw]
    vocab = {token: index for index, token in enumerate(tokens)}  # a repeated spelling keeps its last id
    unk = f.get("tokenizer.ggml.unknown_token_id")
    model = models.BPE(vocab=vocab, merges=_merges_by_rank(vocab), byte_fallback=True, fuse_unk=True,  # type: ignore[arg-type]
                       unk_token=raw[int(unk)] if unk is not None else None)
    tok = HFTokenizer(model)
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    # Control tokens are special; user-defined ones ("\n\n", "<start_of_turn>" in Gemma) are matched whole.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(raw, types, strict=True) if k == _CONTROL])
    known = tok.get_vocab(with_added_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(raw, types, strict=True) if k == _USER_DEFINED and t in known])
    return tok


def _merges_by_rank(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Every (left, right) split of an entry into two entries, ordered by the entry's id, then the
    longer left piece first (SentencePiece merges the best-ranked pair; rank = position here)."""
    merges: list[tuple[int, int, str, str]] = []
    for token, index in vocab.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in vocab and right in vocab:
                merges.append((index, -len(left), left, right))
    merges.sort(key=lambda m: (m[0], m[1]))
    return [(left, right) for _, _, left, right in merges]


def _pre_tokenizer(style: str) -> pre_tokenizers.PreTokenizer:
    if style == _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if style == _DIGITS_GPT2:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_SPLIT_REGEX[style]), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping
