"""The llama.cpp peer of ``infer bench generation --peer llama.cpp``, and what both engines are held to.

* ``LlamaCppRunner`` times llama-cpp-python (an optional extra: ``pip install 'infer[peer]'``) on a
  GGUF of the same model. It is fed infer's own prompt token ids, decodes greedily with the same
  thread count, and, like infer's rows, generates exactly ``max_tokens`` tokens past EOS.
* ``export_bf16_gguf`` writes a BF16 GGUF of a Hugging Face folder's weights, with the metadata
  (tokenizer, chat template, hyper-parameters) of a GGUF of the same model: that is how the peer
  gets the very weights infer runs in bfloat16 when the model came as a quantized GGUF.
* ``memory_bandwidth`` and ``weight_bytes_per_token``: plain decoding streams every weight once per
  token, so bytes per token / measured bandwidth is the fastest decode this machine allows.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib.util
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from infer.extras import MissingExtra, require

# Hugging Face module names -> GGUF tensor names (llama.cpp's converter's names).
_GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                      "lm_head.weight": "output.weight"}


def gguf_tensor_name(hf_name: str) -> str:
    if hf_name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".")
    if parts[:2] != ["model", "layers"]:
        raise ValueError(f"no GGUF name for tensor {hf_name!r}")
    module, kind = ".".join(parts[3:-1]), parts[-1]
    if module not in _GGUF_LAYER_NAMES:
        raise ValueError(f"no GGUF name for tensor {hf_name!r}")
    return f"blk.{parts[2]}.{_GGUF_LAYER_NAMES[module]}.{kind}"


def rope_pairs_row_order(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's rows of a q/k projection from Hugging Face's rotate-half RoPE layout
    (dimension i pairs with i + d/2) to the adjacent pairs GGML's ``llama`` RoPE rotates."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


# What ``export_gguf`` writes each matrix as (vectors stay float32, as llama.cpp's converter keeps
# them). Float types are converted here; the block types are quantized by gguf-py, every matrix the
# same ("pure": llama.cpp's own quantizer, ``quantize_gguf``, picks some tensors' types by rule).
EXPORT_TYPES = ("BF16", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
# llama.cpp's quantizer (llama-cpp-python): file type name -> its ``LLAMA_FTYPE_MOSTLY_*`` constant.
LLAMA_CPP_FILE_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K")


def export_bf16_gguf(model_dir: str | Path, like: str | Path, out: str | Path) -> Path:
    """``export_gguf`` in BF16: the very weights infer runs in bfloat16, for the peer."""
    return export_gguf(model_dir, like, out, "BF16")


def export_gguf(model_dir: str | Path, like: str | Path, out: str | Path, tensor_type: str = "BF16",
                say: Callable[[str], None] | None = None) -> Path:
    """Write ``model_dir``'s safetensors weights as a GGUF of ``tensor_type`` (``EXPORT_TYPES``): the
    hyper-parameters from its config.json, every other field (tokenizer, chat template, names)
    copied from ``like``, a GGUF of the same vocabulary. Llama only. Tensors are read, converted and
    written one at a time, so a model larger than memory exports too."""
    import gguf
    from safetensors import safe_open

    from infer.loader import load_config
    from infer.loader.gguf import open_gguf
    from infer.loader.weights import weight_files

    if tensor_type not in EXPORT_TYPES:
        raise ValueError(f"tensor type {tensor_type!r} is not one export_gguf writes: use {', '.join(EXPORT_TYPES)}")
    config = load_config(Path(model_dir))
    template = open_gguf(Path(like)).reader  # parsed once per process (a 49k-token vocabulary takes seconds)
    arch = str(template.fields["general.architecture"].contents())
    if arch != "llama" or config.model_type != "llama":
        raise ValueError(f"export_gguf handles llama models; {like} is {arch!r}, the folder {config.model_type!r}")
    qtype = gguf.GGMLQuantizationType[tensor_type]
    hyper = {
        "block_count": config.num_hidden_layers, "context_length": config.max_position_embeddings,
        "embedding_length": config.hidden_size, "feed_forward_length": config.intermediate_size,
        "attention.head_count": config.num_attention_heads, "attention.head_count_kv": config.num_key_value_heads,
        "rope.dimension_count": config.head_dim, "vocab_size": config.vocab_size,
    }
    floats = {"rope.freq_base": config.rope_theta, "attention.layer_norm_rms_epsilon": config.rms_norm_eps}
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in template.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type",
                                              "general.quantization_version"):
            continue
        if key.removeprefix(f"{arch}.") in hyper or key.removeprefix(f"{arch}.") in floats:
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)
    for key, value in hyper.items():
        writer.add_uint32(f"{arch}.{key}", value)
    for key, number in floats.items():
        writer.add_float32(f"{arch}.{key}", number)
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{tensor_type}"])
    if tensor_type not in ("BF16", "F16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)

    # First every tensor's name, type and size (the header precedes the data), then the data.
    files = weight_files(Path(model_dir))
    plan: list[tuple[Path, str]] = []
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                shape = [int(d) for d in f.get_slice(name).get_shape()]
                plan.append((path, name))
                if len(shape) == 1:
                    writer.add_tensor_info(gguf_tensor_name(name), shape, np.dtype(np.float32), 4 * shape[0])
                elif tensor_type in ("BF16", "F16"):
                    writer.add_tensor_info(gguf_tensor_name(name), shape, np.dtype(np.float16), 2 * int(np.prod(shape)),
                                           raw_dtype=qtype)
                else:
                    block, _ = gguf.GGML_QUANT_SIZES[qtype]
                    if shape[-1] % block:
                        raise ValueError(f"{name}: rows of {shape[-1]} values do not split into {tensor_type}'s "
                                         f"blocks of {block}")
                    byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, qtype)
                    writer.add_tensor_info(gguf_tensor_name(name), byte_shape, np.dtype(np.uint8),
                                           int(np.prod(byte_shape)), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for i, (path, name) in enumerate(plan):
        with safe_open(str(path), "pt") as f:
            tensor = f.get_tensor(name)
        if name.endswith("q_proj.weight"):
            tensor = rope_pairs_row_order(tensor, config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            tensor = rope_pairs_row_order(tensor, config.num_key_value_heads)
        if tensor.dim() == 1:
            data = tensor.float().numpy()
        elif tensor_type == "BF16":
            data = tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        elif tensor_type == "F16":
            data = tensor.to(torch.float16).numpy()
        else:
            data = gguf.quants.quantize(tensor.float().numpy(), qtype)
        writer.write_tensor_data(data)
        if say is not None and len(plan) >= 50 and (i + 1) % (len(plan) // 10) == 0:
            say(f"{out}: {i + 1}/{len(plan)} tensors")
    writer.close()
    return Path(out)


QUANTIZERS = ("auto", "llama.cpp", "gguf-py")  # auto: llama.cpp's where llama-cpp-python is installed


def quantized_by_llama_cpp(quantizer: str, file_types: Iterable[str]) -> bool:
    """Whether GGUFs of ``file_types`` are quantized by llama.cpp's quantizer (else gguf-py writes
    them); a type neither writes, or one only llama.cpp writes when it is not to be used, is refused."""
    if quantizer not in QUANTIZERS:
        raise ValueError(f"quantizer {quantizer!r} is invalid: use {', '.join(QUANTIZERS)}")
    file_types = list(file_types)
    unknown = [t for t in file_types if t not in (*EXPORT_TYPES, *LLAMA_CPP_FILE_TYPES)]
    if unknown:
        raise ValueError(f"GGUF types {unknown} are not written here: use {', '.join(EXPORT_TYPES)} or, with "
                         f"llama.cpp's quantizer, {', '.join(LLAMA_CPP_FILE_TYPES)}")
    if quantizer == "llama.cpp" or (quantizer == "auto" and importlib.util.find_spec("llama_cpp") is not None):
        return True
    needs = [t for t in file_types if t not in EXPORT_TYPES]
    if needs:
        raise MissingExtra(f"{', '.join(needs)} needs llama.cpp's quantizer: pip install 'infer[peer]' "
                           f"(gguf-py writes {', '.join(EXPORT_TYPES[2:])})")
    return False


def write_gguf(model_dir: str | Path, like: str | Path, out: str | Path, file_type: str, quantizer: str = "auto",
               say: Callable[[str], None] | None = None) -> Path:
    """``model_dir`` as a GGUF of ``file_type``: floats and gguf-py's types written directly, or through
    a F16 file (removed after) that llama.cpp's quantizer reads (``quantized_by_llama_cpp``)."""
    if file_type in ("BF16", "F16") or not quantized_by_llama_cpp(quantizer, [file_type]):
        return export_gguf(model_dir, like, out, file_type, say)
    f16 = Path(out).with_name(Path(out).name + ".F16.tmp")
    try:
        export_gguf(model_dir, like, f16, "F16", say)
        return quantize_gguf(f16, out, file_type)
    finally:
        f16.unlink(missing_ok=True)


def quantize_gguf(source: str | Path, out: str | Path, file_type: str, threads: int | None = None) -> Path:
    """llama.cpp's own quantizer (``llama-quantize``, through llama-cpp-python) from a F16/BF16/F32
    GGUF: the files llama.cpp users make (Q4_K_M keeps some tensors in Q6_K, and so on)."""
    if file_type not in LLAMA_CPP_FILE_TYPES:
        raise ValueError(f"file type {file_type!r}: llama.cpp's quantizer is used here for "
                         f"{', '.join(LLAMA_CPP_FILE_TYPES)}")
    llama_cpp = require("llama_cpp", "peer", f"{file_type} with llama.cpp's quantizer")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{file_type}")
    params.nthread = threads or torch.get_num_threads()
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source} to {file_type} (its log above says why)")
    return Path(out)


class LlamaCppRunner:
    """One llama-cpp-python model; ``run(prompt_ids)`` -> (tokens/s end to end, decode tokens/s, ids)."""

    def __init__(self, gguf_path: str | Path, max_tokens: int, context: int, lookup: int | None = None,
                 threads: int | None = None, all_logits: bool = False) -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise SystemExit("--peer llama.cpp needs llama-cpp-python: pip install 'infer[peer]' "
                             "(it builds llama.cpp from source, ~10+ minutes on 2 cores)") from None
        draft: Any = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        threads = threads or torch.get_num_threads()
        self.max_tokens = max_tokens
        self.all_logits = all_logits
        # all_logits keeps every position's logits of a pass (``logits``), not only the last one's.
        self.llm = Llama(model_path=str(gguf_path), n_ctx=context, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, draft_model=draft, logits_all=all_logits, verbose=False)

    def run(self, prompt_ids: list[int]) -> tuple[float, float | None, list[int]]:
        self.llm.reset()  # no KV reuse from the previous prompt: every run prefills in full, as infer's do
        out: list[int] = []
        start = time.perf_counter()
        first = start
        for token in self.llm.generate(prompt_ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(int(token))
            if len(out) == 1:
                first = time.perf_counter()
            if len(out) == self.max_tokens:
                break
        end = time.perf_counter()
        decode = (len(out) - 1) / (end - first) if len(out) > 1 else None
        return len(out) / (end - start), decode, out

    def prefill(self, prompt_ids: list[int]) -> float:
        """Seconds to process ``prompt_ids`` from an empty cache (the last row's logits, as a
        generation's first step computes them)."""
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(prompt_ids)
        return time.perf_counter() - start

    def logits(self, ids: list[int]) -> torch.Tensor:
        """float32 ``[len(ids), vocab]``: the next-token logits at every position of ``ids`` processed
        from an empty cache (the runner must be made with ``all_logits``)."""
        if not self.all_logits:
            raise ValueError("LlamaCppRunner.logits needs the runner made with all_logits=True")
        self.llm.reset()
        self.llm.eval(ids)
        return torch.from_numpy(np.array(self.llm.scores[: len(ids)], dtype=np.float32))


def memory_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second one reduction over a ``megabytes`` float32 buffer reads (all threads)."""
    buf = torch.ones(megabytes * 2**20 // 4)
    buf.sum()  # touch the pages first
    start = time.perf_counter()
    buf.sum()
    return buf.numel() * 4 / (time.perf_counter() - start)


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every tensor the model's modules hold (parameters,
    buffers and plain tensor attributes such as pre-packed or quantized weights and their scales),
    each storage counted once at its stored size. The embedding table (``embed_tokens``) is left
    out (a step reads one row of it) unless the LM head holds the same storage."""
    embedding: set[int] = set()
    head: set[int] = set()
    counted: dict[int, int] = {}
    for name, module in model.named_modules():
        part = name.rsplit(".", 1)[-1]
        for tensor in _held_tensors(module):
            key, counted[key] = _storage(tensor)
            if part == "embed_tokens":
                embedding.add(key)
            elif part == "lm_head":
                head.add(key)
    return sum(size for key, size in counted.items() if key not in embedding - head)


# Tensors models hold that are no weights: the RoPE frequencies (cos/sin come from them per pass).
_NOT_WEIGHTS = ("inv_freq",)


def _held_tensors(module: nn.Module) -> list[torch.Tensor]:
    """The tensors a module holds itself (not its children's), also inside lists, tuples, dicts and
    dataclasses such as a quantized weight's record (``_parameters`` and ``_buffers`` are dicts
    among its attributes)."""
    found: list[torch.Tensor] = []
    for key, value in vars(module).items():
        items = (value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple))
                 else [(key, value)])
        for name, item in items:
            if dataclasses.is_dataclass(item) and not isinstance(item, type):
                fields = (getattr(item, f.name) for f in dataclasses.fields(item))
                found += [v for v in fields if isinstance(v, torch.Tensor) and v.device.type != "meta"]
            elif isinstance(item, torch.Tensor) and item.device.type != "meta" and name not in _NOT_WEIGHTS:
                found.append(item)
    return found


def _storage(tensor: torch.Tensor) -> tuple[int, int]:
    """(an identity shared by every view of the same memory, its size in bytes)."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # opaque layouts (oneDNN-packed weights) have no storage
        return id(tensor), tensor.numel() * tensor.element_size()
    return storage.data_ptr(), storage.nbytes()


def gguf_weight_bytes_per_token(path: str | Path) -> int:
    """The same count for a GGUF file: every tensor's stored bytes, less the embedding table when
    the file has a separate output matrix (a file without one reads the table as its LM head)."""
    from infer.loader.gguf import open_gguf

    tensors = open_gguf(Path(path)).tensors
    return sum(t.n_bytes for name, t in tensors.items() if name != "token_embd.weight" or "output.weight" not in tensors)
