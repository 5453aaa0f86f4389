"""``infer convert gguf FILE OUT_DIR``: a GGUF file as the equivalent Hugging Face folder.

The folder holds the dequantized weights (``model.safetensors``), ``config.json``,
``generation_config.json``, ``tokenizer.json`` and ``tokenizer_config.json`` (with the chat
template), and loads in infer and in transformers alike.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from infer.loader import DTYPES, load_model, load_tokenizer, resolve_model_path
from infer.loader.gguf import ROPE_FREQS_TENSOR, open_gguf
from infer.loader.save import write_model_files, write_tokenizer_files
from infer.models.config import CheckpointError

HF_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def convert_gguf(source: str | os.PathLike[str], out_dir: str | os.PathLike[str], dtype: str = "float32") -> Path:
    """Write the Hugging Face folder equivalent to the GGUF ``source`` (a path or built-in name)."""
    path = resolve_model_path(source)
    if not path.is_file():
        raise CheckpointError(f"{path}: not a GGUF file")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is invalid: use {', '.join(DTYPES)}")
    gguf = open_gguf(path)
    if ROPE_FREQS_TENSOR in gguf.tensors:
        raise CheckpointError(f"{path}: {ROPE_FREQS_TENSOR} (precomputed RoPE scaling) has no config.json "
                              "equivalent infer can write; load the GGUF directly instead")
    model, config = load_model(path, dtype, "cpu", fuse=False)
    tokenizer = load_tokenizer(path, config)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_model_files(out, model, config, DTYPES[dtype], pad_token_id=gguf.get("tokenizer.ggml.padding_token_id"))
    write_tokenizer_files(out, tokenizer)
    return out


def add_subparser(sub: Any) -> None:
    p = sub.add_parser("convert", help="convert a model file to a Hugging Face folder")
    kinds = p.add_subparsers(dest="convert_kind", required=True)
    g = kinds.add_parser("gguf", help="GGUF file -> Hugging Face folder (dequantized safetensors + tokenizer)")
    g.add_argument("file", help="the .gguf file (or a built-in model name)")
    g.add_argument("out_dir", help="folder to write (created; files of the same name are replaced)")
    g.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="dtype of the written weights (float32 keeps every dequantized value exactly)")
    g.set_defaults(func=_run_convert_gguf)


def _run_convert_gguf(args: argparse.Namespace) -> int:
    print(f"[infer] converting {args.file} ({args.dtype})", file=sys.stderr, flush=True)
    out = convert_gguf(args.file, args.out_dir, args.dtype)
    print(f"[infer] wrote {out}: {', '.join(HF_FILES)}", file=sys.stderr)
    return 0
