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

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from infer.backends.onednn import PackedLinear

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


def export_bf16_gguf(model_dir: str | Path, like: str | Path, out: str | Path) -> Path:
    """Write ``model_dir``'s safetensors weights as a BF16 GGUF, every other field copied from ``like``
    (a GGUF of the same model, e.g. the quantized file it was converted from). Llama only."""
    import gguf
    from safetensors import safe_open

    from infer.loader import load_config

    config = load_config(Path(model_dir))
    template = gguf.GGUFReader(str(like))
    arch = str(template.fields["general.architecture"].contents())
    if arch != "llama" or config.model_type != "llama":
        raise ValueError(f"export_bf16_gguf handles llama models; {like} is {arch!r}, the folder {config.model_type!r}")
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in template.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type", "general.quantization_version"):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for path in files:
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.endswith("rotary_emb.inv_freq"):
                    continue
                tensor = f.get_tensor(name)
                if name.endswith("q_proj.weight"):
                    tensor = rope_pairs_row_order(tensor, config.num_attention_heads)
                elif name.endswith("k_proj.weight"):
                    tensor = rope_pairs_row_order(tensor, config.num_key_value_heads)
                if tensor.dim() == 1:  # norms stay float32, as llama.cpp's converter keeps them
                    writer.add_tensor(gguf_tensor_name(name), tensor.float().numpy())
                else:
                    bits = tensor.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
                    writer.add_tensor(gguf_tensor_name(name), bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)


class LlamaCppRunner:
    """One llama-cpp-python model; ``run(prompt_ids)`` -> (tokens/s end to end, decode tokens/s, ids)."""

    def __init__(self, gguf_path: str | Path, max_tokens: int, context: int, lookup: int | None = None) -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise SystemExit("--peer llama.cpp needs llama-cpp-python: pip install 'infer[peer]' "
                             "(it builds llama.cpp from source, ~10+ minutes on 2 cores)") from None
        draft: Any = None
        if lookup:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup)
        threads = torch.get_num_threads()
        self.max_tokens = max_tokens
        self.llm = Llama(model_path=str(gguf_path), n_ctx=context, n_batch=512, n_threads=threads,
                         n_threads_batch=threads, draft_model=draft, verbose=False)

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


def memory_bandwidth(megabytes: int = 512) -> float:
    """Bytes per second one reduction over a ``megabytes`` float32 buffer reads (all threads)."""
    buf = torch.ones(megabytes * 2**20 // 4)
    buf.sum()  # touch the pages first
    start = time.perf_counter()
    buf.sum()
    return buf.numel() * 4 / (time.perf_counter() - start)


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every projection, the LM head and the norms. The
    embedding table is not counted (a step reads one row of it) unless it is the LM head too."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, PackedLinear):
            total += module.weight_numel * module.packed_weight.element_size()
        elif isinstance(module, nn.Embedding):
            seen.add(module.weight.data_ptr())
    tied_head = getattr(model, "lm_head", None)
    for param in model.parameters():
        ptr = param.data_ptr()
        is_head = isinstance(tied_head, nn.Linear) and param is tied_head.weight
        if ptr in seen and not is_head:
            continue
        seen.add(ptr)
        total += param.numel() * param.element_size()
    return total


def gguf_weight_bytes_per_token(path: str | Path) -> int:
    """The same count for a GGUF file: every tensor's stored bytes, less the embedding table when
    the file has a separate output matrix (a file without one reads the table as its LM head)."""
    import gguf

    tensors = gguf.GGUFReader(str(path)).tensors
    names = {t.name for t in tensors}
    return sum(int(t.n_bytes) for t in tensors if t.name != "token_embd.weight" or "output.weight" not in names)
