"""Byte-level BPE tokenizer training (via the `tokenizers` library) in Hugging Face format.

Byte-level BPE maps every input byte to a base symbol before merging, so any string —
code with indentation, newlines, arbitrary unicode — round-trips exactly through
encode/decode. That matters for tiny models trained on source code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
PAD_TOKEN = "<|pad|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"

# Order defines the ids: the trainer assigns special tokens the first ids, in this order.
SPECIAL_TOKENS: tuple[str, ...] = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
BOS_ID, EOS_ID, PAD_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

# ChatML. No BOS in the template: whether to prepend BOS is the engine's decision.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_MIN_VOCAB = 256 + len(SPECIAL_TOKENS)


def train_bpe_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    out_dir: str | Path | None = None,
    *,
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
    model_max_length: int = 2048,
) -> Tokenizer:
    """Train a byte-level BPE tokenizer; optionally save it in HF format to ``out_dir``.

    Special tokens get ids 0..4 (see SPECIAL_TOKENS). No post-processor is installed,
    so ``encode`` never adds BOS/EOS on its own. The vocab may come out smaller than
    ``vocab_size`` if the texts do not support that many merges.
    """
    if vocab_size < _MIN_VOCAB:
        # Below this the 256 byte symbols plus specials do not fit, and some bytes would
        # be unencodable, breaking the round-trip guarantee.
        raise ValueError(f"vocab_size must be >= {_MIN_VOCAB} (256 bytes + specials), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would not survive decode, breaking round-trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # Seed with all 256 byte symbols so every byte is encodable even if unseen in training.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:  # guard against a tokenizers behaviour change
            raise RuntimeError(f"special token {s!r} got id {tok.token_to_id(s)}, expected {i}")
    if out_dir is not None:
        save_tokenizer(tok, out_dir, chat_template=chat_template, model_max_length=model_max_length)
    return tok


def tokenizer_config(
    tok: Tokenizer,
    *,
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
    model_max_length: int = 2048,
) -> dict[str, Any]:
    """The `tokenizer_config.json` content transformers needs to load `tok` as a fast tokenizer."""
    added: dict[str, dict[str, Any]] = {}
    for s in SPECIAL_TOKENS:
        idx = tok.token_to_id(s)
        if idx is None:
            raise ValueError(f"tokenizer lacks special token {s!r}")
        added[str(idx)] = {
            "content": s,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    cfg: dict[str, Any] = {
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START_TOKEN, IM_END_TOKEN],
        # The engine, not the tokenizer, decides about BOS (see module docstring).
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    return cfg


def save_tokenizer(
    tok: Tokenizer,
    out_dir: str | Path,
    *,
    chat_template: str | None = DEFAULT_CHAT_TEMPLATE,
    model_max_length: int = 2048,
) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` to ``out_dir``; return the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = tokenizer_config(tok, chat_template=chat_template, model_max_length=model_max_length)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return out
