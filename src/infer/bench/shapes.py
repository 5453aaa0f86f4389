"""``infer bench shapes``: random-weight models of real models' shapes, to compare engines at a size.

A decode step's cost depends on the shapes of the weights, not on what they learnt, so a model of
Llama-3.2-1B's or 3B's shape with random weights times like the real one. Each shape is written as
a Hugging Face folder (bfloat16 safetensors, tokenizer) and as GGUF files of the same tensors
(F16, and Q8_0 / Q4_0 / Q4_K_M ...), with the vocabulary, tokenizer and chat template of a template
GGUF (by default SmolLM2's built-in file: 49,152 tokens), so every engine runs the same model.

Weights are normal(0, 0.02) (norms 1), a scale at which the residual stream and the logits stay
finite in float16. The GGUF quantized files come from llama.cpp's own quantizer when
llama-cpp-python is installed (the files its users have; Q4_K_M needs it), otherwise from gguf-py
(Q8_0, Q4_0, ...: every matrix in the type, llama.cpp's ``--pure``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    description: str


SHAPES = {
    "1b": Shape(2048, 16, 32, 8, 8192, "Llama-3.2-1B's shape"),
    "3b": Shape(3072, 28, 24, 8, 8192, "Llama-3.2-3B's shape"),
    # The default model's shape in bfloat16, for a machine the real file cannot be carried to (a GPU's
    # decode speed depends on the shape, not on the weights or their GGUF type).
    "smollm2": Shape(576, 30, 9, 3, 1536, "SmolLM2-135M's shape"),
    "tiny": Shape(64, 2, 4, 2, 128, "a tiny model, for a quick check of the tooling"),
}
DEFAULT_TYPES = ("F16", "Q8_0", "Q4_0", "Q4_K_M")
CONTEXT = 4096  # positions in config.json: what a KV pool is sized for by default
SHARD_BYTES = 2**30  # safetensors shards of about 1 GiB: a layer group is generated, written and freed


def default_shapes_dir() -> Path:
    from infer.fileio import default_cache_dir

    return default_cache_dir() / "shapes"


def write_shape(name: str, out_dir: str | os.PathLike[str], types: tuple[str, ...] = DEFAULT_TYPES,
                like: str | os.PathLike[str] | None = None, seed: int = 0, quantizer: str = "auto",
                shape: Shape | None = None, say: Callable[[str], None] = print) -> list[Path]:
    """Write ``out_dir/NAME`` (the Hugging Face folder) and ``out_dir/NAME.TYPE.gguf`` for each of
    ``types``; returns their paths. ``shape`` defaults to ``SHAPES[name]``; ``like`` is the GGUF
    whose tokenizer and metadata are copied (default: the built-in SmolLM2 file)."""
    from infer.bench.peer import export_gguf, quantize_gguf, quantized_by_llama_cpp
    from infer.loader.hub import DEFAULT_MODEL, builtin_model_path

    shape = shape or SHAPES[name]
    with_llama_cpp = quantized_by_llama_cpp(quantizer, types)  # refuses what cannot be written, before writing
    like_path = Path(like) if like is not None else builtin_model_path(DEFAULT_MODEL)
    out = Path(out_dir)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    say(f"[{name}] {shape.description}: writing the Hugging Face folder {folder} (bfloat16, random weights, "
        f"seed {seed})")
    write_hf_folder(folder, shape, like_path, seed, say)
    written = [folder]
    by_llama_cpp = [t for t in types if with_llama_cpp and t not in ("F16", "BF16")]
    f16 = out / f"{name}.F16.gguf"
    if "F16" in types or by_llama_cpp:  # by_llama_cpp: the quantizer's input, written once for every type
        say(f"[{name}] writing {f16}")
        export_gguf(folder, like_path, f16, "F16", say)
        written += [f16] if "F16" in types else []
    for file_type in (t for t in types if t != "F16"):
        path = out / f"{name}.{file_type}.gguf"
        if file_type in by_llama_cpp:
            say(f"[{name}] quantizing {f16} to {file_type} with llama.cpp's quantizer")
            quantize_gguf(f16, path, file_type)
        else:
            say(f"[{name}] writing {path} (gguf-py{'' if file_type == 'BF16' else f', every matrix {file_type}'})")
            export_gguf(folder, like_path, path, file_type, say)
        written.append(path)
    if by_llama_cpp and "F16" not in types:
        f16.unlink()
    for path in written:
        say(f"[{name}] wrote {path}")
    return written


def write_hf_folder(folder: Path, shape: Shape, like: Path, seed: int, say: Callable[[str], None]) -> None:
    """config.json, generation_config.json, the tokenizer files and the bfloat16 safetensors."""
    from safetensors.torch import save_file

    from infer.loader import load_tokenizer
    from infer.loader.gguf import gguf_config, open_gguf
    from infer.loader.save import write_config_files, write_tokenizer_files

    template = open_gguf(like)
    base = gguf_config(template)
    if base.model_type != "llama":
        raise ValueError(f"{like}: the template must be a llama GGUF (it is {base.model_type!r})")
    config = replace(base, hidden_size=shape.hidden_size, num_hidden_layers=shape.num_hidden_layers,
                     num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
                     head_dim=shape.hidden_size // shape.num_attention_heads,
                     intermediate_size=shape.intermediate_size, max_position_embeddings=CONTEXT,
                     tie_word_embeddings=True, rope_scaling=None)
    write_config_files(folder, config, torch.bfloat16, pad_token_id=template.get("tokenizer.ggml.padding_token_id"))
    write_tokenizer_files(folder, load_tokenizer(like))
    for old in [*folder.glob("*.safetensors"), folder / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a previous run's shards would be read along with these

    generator = torch.Generator().manual_seed(seed)

    def random(*size: int) -> torch.Tensor:
        return (torch.randn(*size, generator=generator) * 0.02).to(torch.bfloat16)

    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim, inter = config.head_dim, config.intermediate_size
    layer_bytes = 2 * (2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + 3 * hidden * inter)
    per_shard = max(1, SHARD_BYTES // layer_bytes)
    groups = [list(range(i, min(i + per_shard, config.num_hidden_layers)))
              for i in range(0, config.num_hidden_layers, per_shard)]
    weight_map: dict[str, str] = {}
    total = 0
    for g, layers in enumerate(groups):
        state: dict[str, torch.Tensor] = {}
        if g == 0:
            state["model.embed_tokens.weight"] = random(config.vocab_size, hidden)
        for i in layers:
            prefix = f"model.layers.{i}."
            state |= {
                prefix + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                prefix + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
                prefix + "self_attn.q_proj.weight": random(heads * head_dim, hidden),
                prefix + "self_attn.k_proj.weight": random(kv_heads * head_dim, hidden),
                prefix + "self_attn.v_proj.weight": random(kv_heads * head_dim, hidden),
                prefix + "self_attn.o_proj.weight": random(hidden, heads * head_dim),
                prefix + "mlp.gate_proj.weight": random(inter, hidden),
                prefix + "mlp.up_proj.weight": random(inter, hidden),
                prefix + "mlp.down_proj.weight": random(hidden, inter),
            }
        if g == len(groups) - 1:
            state["model.norm.weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        file = "model.safetensors" if len(groups) == 1 else f"model-{g + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(state, str(folder / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(state, file)
        total += sum(t.numel() * t.element_size() for t in state.values())
        say(f"{folder}: layers {layers[0]}-{layers[-1]} of {config.num_hidden_layers} written")
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
