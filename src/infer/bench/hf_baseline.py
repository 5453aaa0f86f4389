"""The same workload through Hugging Face transformers: generate, assisted generation, prompt lookup."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from infer.bench.generation import BenchSettings, RunFn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def from_pretrained_args(ref: str) -> tuple[str, dict[str, Any]]:
    """transformers' ``from_pretrained`` arguments for an infer model reference: a folder as is; a
    GGUF file or built-in name as its folder plus ``gguf_file`` (transformers dequantizes it)."""
    from infer.loader import resolve_model_path

    path = resolve_model_path(ref)
    return (str(path), {}) if path.is_dir() else (str(path.parent), {"gguf_file": path.name})


def transformers_runners(settings: BenchSettings) -> list[tuple[str, RunFn, int | None]]:
    """(name, run, spec_length) for transformers generate, assisted generation and prompt lookup.

    ``run(prompt, seed)`` generates exactly ``max_tokens`` tokens (up to them and EOS with
    ``stop_at_eos``) and returns (tokens/s, None).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = "cuda" if settings.device in ("cuda", "auto") and torch.cuda.is_available() else settings.device
    dtype = DTYPES.get(settings.dtype, torch.float32)
    folder, gguf = from_pretrained_args(settings.model)
    tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    target: Any = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **gguf).to(device).eval()  # type: ignore[arg-type]
    draft: Any = None
    if settings.draft_model is not None:
        draft_folder, draft_gguf = from_pretrained_args(settings.draft_model)
        draft = AutoModelForCausalLM.from_pretrained(draft_folder, dtype=dtype, **draft_gguf).to(device).eval()  # type: ignore[arg-type]
    k = max(settings.spec_lengths)
    modes: list[tuple[str, dict[str, Any]]] = [("transformers generate", {})]
    if draft is not None:
        modes.append(("transformers assisted", {"assistant_model": draft}))
    if settings.ngram and settings.temperature == 0:  # transformers' prompt lookup is greedy-only
        modes.append(("transformers prompt lookup", {"prompt_lookup_num_tokens": k}))
    sampling: dict[str, Any] = {"do_sample": False}
    if settings.temperature > 0:
        sampling = {"do_sample": True, "temperature": settings.temperature, "top_k": 0, "top_p": 1.0}

    def runner(extra: dict[str, Any]) -> RunFn:
        def run(prompt: str | list[int], seed: int) -> tuple[float, Any]:
            torch.manual_seed(seed)
            ids = torch.tensor([prompt if isinstance(prompt, list) else tokenizer.encode(prompt)], device=device)
            length = {} if settings.stop_at_eos else {"min_new_tokens": settings.max_tokens}
            start = time.perf_counter()
            with torch.inference_mode():
                out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=settings.max_tokens,
                                      pad_token_id=tokenizer.pad_token_id or 0, **length, **sampling, **extra)
            return (out.shape[1] - ids.shape[1]) / (time.perf_counter() - start), None

        return run

    return [(name, runner(extra), extra.get("prompt_lookup_num_tokens")) for name, extra in modes]
