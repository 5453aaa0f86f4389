"""What a run picks when not told: the dtype (``auto``), the context length and KV pool size, and
the summary line that says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints import make_tiny_checkpoint
from infer import LLM
from infer import loader as loader_module
from infer.engine import engine as engine_module
from infer.loader import choose_dtype

pytestmark = pytest.mark.usefixtures("torch_single_thread")

LONG_CONTEXT = 8192


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama whose own context (8192) is longer than the old silent 4096 cap."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("long"), "llama", max_position_embeddings=LONG_CONTEXT)


@pytest.mark.parametrize(("feature", "expected"), [("avx512_bf16", torch.bfloat16), ("amx_bf16", torch.bfloat16),
                                                   (None, torch.float32)])
def test_auto_dtype_on_cpu_follows_native_bf16(monkeypatch: pytest.MonkeyPatch, feature: str | None,
                                               expected: torch.dtype) -> None:
    monkeypatch.setattr(loader_module, "cpu_bf16_feature", lambda: feature)
    dtype, reason = choose_dtype("auto", torch.device("cpu"))
    assert dtype == expected
    assert reason.startswith("auto") and (feature or "no native bfloat16") in reason


def test_explicit_dtype_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader_module, "cpu_bf16_feature", lambda: "avx512_bf16")
    assert choose_dtype("float32", torch.device("cpu")) == (torch.float32, "as requested")


def test_cpu_bf16_feature_agrees_with_proc_cpuinfo() -> None:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo on this system")
    flags = {f for line in cpuinfo.read_text().splitlines() if line.startswith(("flags", "Features"))
             for f in line.split(":", 1)[1].split()}
    feature = loader_module.cpu_bf16_feature()
    assert (feature is not None) == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})
    assert feature is None or feature in flags


def test_summary_says_dtype_and_why(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader_module, "cpu_bf16_feature", lambda: None)
    lines: list[str] = []
    llm = LLM(str(tiny_llama), device="cpu", progress=lines.append)
    assert llm.engine.dtype == torch.float32
    summary = next(line for line in lines if line.startswith("dtype"))
    assert "float32 (auto: this CPU has no native bfloat16" in summary and summary == llm.engine.summary


def test_context_defaults_to_the_models_own(long_context_model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda _device: 64 * 2**30)
    llm = LLM(str(long_context_model), dtype="float32", device="cpu", max_batch_size=2)
    assert llm.engine.max_seq_len == LONG_CONTEXT
    assert llm.engine.pool.free_kv_tokens() == 2 * LONG_CONTEXT  # max_batch_size full-length sequences
    assert f"context {LONG_CONTEXT} tokens (the model's max_position_embeddings" in llm.engine.summary


def test_context_and_pool_are_bounded_by_the_kv_budget(long_context_model: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 layers x 2 KV heads x 16 dims x (K and V) x 4 bytes = 512 bytes per token in float32
    budget_tokens = 1000
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda _device: budget_tokens * 512 * 2)
    llm = LLM(str(long_context_model), dtype="float32", device="cpu", max_batch_size=4, kv_memory_fraction=0.5)
    assert llm.engine.max_seq_len == 992  # the budget, in whole 16-token blocks
    assert llm.engine.pool.free_kv_tokens() == 992  # one full sequence, not four
    assert "KV budget 50%" in llm.engine.summary and f"below the model's {LONG_CONTEXT}" in llm.engine.summary
    out = llm.generate("def f(x):", None)[0]  # still generates
    assert out.finish_reason in ("stop", "length")


def test_slotted_context_is_bounded_for_every_slot(long_context_model: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "free_memory_bytes", lambda _device: 4000 * 512 * 2)
    llm = LLM(str(long_context_model), dtype="float32", device="cpu", max_batch_size=4, kv_cache_backend="slotted")
    assert llm.engine.max_seq_len == 992  # 4000 tokens over 4 slots


def test_explicit_context_wins_up_to_the_models_limit(long_context_model: Path) -> None:
    llm = LLM(str(long_context_model), dtype="float32", device="cpu", max_seq_len=100)
    assert llm.engine.max_seq_len == 100 and "as configured" in llm.engine.summary
    capped = LLM(str(long_context_model), dtype="float32", device="cpu", max_seq_len=10 * LONG_CONTEXT,
                 max_batch_size=1)
    assert capped.engine.max_seq_len == LONG_CONTEXT


def test_bad_kv_memory_fraction_is_named(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="kv_memory_fraction"):
        LLM(str(tiny_llama), dtype="float32", device="cpu", kv_memory_fraction=1.5)
