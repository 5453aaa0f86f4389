"""A tiny Llama shape with SmolLM2's first 2,048 tokens, written as a folder and GGUF files in
milliseconds: the bench tests' model (``infer.bench.shapes``)."""

from __future__ import annotations

from pathlib import Path

from infer.bench.shapes import Shape

TINY = Shape(64, 2, 4, 2, 128, "tiny")
VOCAB = 2048


def small_vocab_template(path: Path) -> Path:
    """SmolLM2's GGUF metadata with its first 2,048 tokens (and the merges among them), no tensors: a
    template whose models parse in milliseconds (49,152 token strings take gguf-py seconds per file)."""
    import gguf

    from infer.loader.gguf import open_gguf
    from infer.loader.hub import builtin_model_path

    source = open_gguf(builtin_model_path("smollm2-135m-instruct")).reader
    tokens = source.fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    kept = set(tokens)
    merges = [m for m in source.fields["tokenizer.ggml.merges"].contents()
              if all(part in kept for part in (*m.split(" "), m.replace(" ", "")))]
    small = {"tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": merges, "llama.vocab_size": VOCAB,
             "tokenizer.ggml.token_type": source.fields["tokenizer.ggml.token_type"].contents()[:VOCAB]}
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in source.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, small.get(key, field.contents()), field.types[0], sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
