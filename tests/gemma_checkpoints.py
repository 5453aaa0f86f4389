"""Tiny random Gemma 3 and Mistral (sliding-window) checkpoints, built with transformers.

Windows are a few tokens wide, so every test prompt runs past them; the Gemma 3 layers alternate
local and global, the scale ``query_pre_attn_scalar`` differs from head_dim, and the two RoPE
bases differ, so a loader or model that ignores any of them fails parity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from checkpoints import _init_weights, shared_tokenizer
from infer.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, save_tokenizer

GEMMA_WINDOW = 8


def make_tiny_gemma3(out_dir: str | Path, *, seed: int = 0, window: int = GEMMA_WINDOW, num_layers: int = 4,
                     softcap: float | None = None, hidden_size: int = 64, **overrides: Any) -> Path:
    """A Gemma3ForCausalLM (text-only) with layers local, global, local, global ... (pattern 2)."""
    import transformers

    settings: dict[str, Any] = dict(
        vocab_size=shared_tokenizer().get_vocab_size(), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=512, sliding_window=window, sliding_window_pattern=2,
        query_pre_attn_scalar=24, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
        final_logit_softcapping=softcap, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        tie_word_embeddings=True, dtype="float32")
    config = transformers.Gemma3TextConfig(**{**settings, **overrides})
    return _save(config, out_dir, seed)


def make_tiny_mistral(out_dir: str | Path, *, seed: int = 0, window: int = GEMMA_WINDOW) -> Path:
    """A MistralForCausalLM: Llama's block with a sliding window in every layer."""
    import transformers

    config = transformers.MistralConfig(
        vocab_size=shared_tokenizer().get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=window, rope_theta=10_000.0, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        tie_word_embeddings=False, dtype="float32")
    return _save(config, out_dir, seed)


def _save(config: Any, out_dir: str | Path, seed: int) -> Path:
    import transformers
    from transformers.utils import logging as hf_logging

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed)
    model.eval()
    model.generation_config = transformers.GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID,
                                                            pad_token_id=PAD_ID)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out)
    finally:
        hf_logging.enable_progress_bar()
    save_tokenizer(shared_tokenizer(), out, model_max_length=512)
    return out
