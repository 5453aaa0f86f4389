"""The engine's phase times (``infer bench step``): off unless asked, and when on, each phase of a
plain step and of a speculative round is counted, none twice, the model pass holding the kernels'."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from infer import LLM, SamplingParams
from infer.bench.step import measure
from infer.phases import PHASES

pytestmark = pytest.mark.usefixtures("torch_single_thread")


def test_phases_are_off_unless_started(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    assert not PHASES.enabled and PHASES.mark() == 0.0
    before = dict(PHASES.seconds)  # what an earlier measurement left (stop() keeps its figures)
    llm.generate(["hello"], SamplingParams(temperature=0.0, max_tokens=4))
    assert PHASES.seconds == before  # nothing recorded while off


@pytest.mark.parametrize("clock", [time.perf_counter, time.thread_time], ids=["wall", "cpu"])
def test_a_plain_step_splits_into_its_phases(tiny_llama: Path, clock: object) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", backend="cpu-kernels")
    out = measure(llm, 12, clock)  # type: ignore[arg-type]
    assert not PHASES.enabled
    for phase in ("scheduling", "model pass", "sampling", "detokenization"):
        assert out[phase] > 0, phase
    named = sum(v for k, v in out.items() if k in ("scheduling", "model pass", "sampling", "detokenization"))
    assert named + out["rest of engine.step"] + out["output"] == pytest.approx(out["step"])
    assert out["rest of engine.step"] >= -1e-6 and out["tokens per step"] == 1.0
    assert 0 < out.get("kernels", 0.0) <= out["model pass"]  # the C kernels' calls, inside the pass


@pytest.mark.parametrize("speculator", ["ngram", "suffix"])
def test_a_speculative_round_splits_into_drafting_verification_and_rejection(tiny_llama: Path, speculator: str) -> None:
    """n-gram (a chain) and suffix decoding (a tree, verified by the tree path) draft from a prompt
    that repeats itself: rounds that verify drafts."""
    # A fixed draft length: every round drafts and verifies (goodput may skip a round's drafts).
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator=speculator, spec_length_policy="fixed",
              **({"suffix_scope": "request"} if speculator == "suffix" else {}))
    out = measure(llm, 24, time.perf_counter, prompt="a b c d e f g a b c d e f g a b c d e f g a b c d")
    for phase in ("scheduling", "drafting", "verify pass", "rejection", "KV truncation", "detokenization"):
        assert out[phase] > 0, phase
    assert out["rest of engine.step"] >= -1e-6
