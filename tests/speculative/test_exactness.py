"""Distribution exactness of the whole speculative engine path (draft, verify, rollback, stop rules).

``tests/speculative/test_rejection.py`` checks the rejection sampler on hand-made distributions. Here the
real engine runs thousands of seeded requests through ``LLM.generate`` with a draft model or
n-gram lookup, and the generated tokens are compared against the target model's exact
distribution, enumerated with plain (cache-free) transformers forward passes and the engine's own
sampling transform. The vocabulary is tiny (V = 10) so every two-token continuation can be
enumerated.

Speculation starts after the prefill token x1, so the test measures (x2, x3) with max_tokens=4:
the first round drafts two tokens (K is clamped to max_tokens - generated - 1), and a rejection
makes x3 come from a second round, so both the in-round and the cross-round paths are covered.
Samples are grouped by x1 and compared cell by cell with P(x2, x3 | prompt, x1) in a pooled
chi-square test; x1 itself is checked against P(x1 | prompt).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

import infer.speculative.verification as verification
from helpers import (
    P_CONTROL,
    PENALTY_CONFIG,
    PROMPT,
    SAMPLING_CONFIGS,
    assert_follows_reference,
    chisquare_cells,
    generate_unseeded,
    grouped_chisquare,
    reference,
)
from infer import LLM, SamplingParams

NUM_SAMPLES = 10_000
SPEC_LENGTH = 3
DRAFTERS = ("draft", "ngram")


@pytest.fixture(scope="module")
def engines(small_target: Path, small_draft: Path) -> dict[str, LLM]:
    common = dict(dtype="float32", device="cpu", spec_length=SPEC_LENGTH, spec_length_policy="fixed", max_batch_size=256, max_seq_len=32)
    return {
        "draft": LLM(str(small_target), draft_model=str(small_draft), **common),  # type: ignore[arg-type]
        "ngram": LLM(str(small_target), speculator="ngram", ngram_min=1, ngram_max=3, **common),  # type: ignore[arg-type]
    }


def test_pooled_chisquare_helper() -> None:
    """The statistic helper itself: exact fit gives 0, impossible cells are counted, pooling works."""
    probs = np.array([0.5, 0.3, 0.2, 0.0])
    exact = chisquare_cells(np.array([50, 30, 20, 0]), probs)
    assert exact.statistic == pytest.approx(0.0) and exact.dof == 2 and exact.pvalue == 1.0
    assert chisquare_cells(np.array([50, 30, 19, 1]), probs).impossible == 1
    assert chisquare_cells(np.array([50, 30, 19, 1]), probs).pvalue == 0.0
    # 10 samples: expected (5, 3, 2): the two small cells pool into one of 5 -> 1 dof.
    assert chisquare_cells(np.array([5, 3, 2, 0]), probs).dof == 1


# ----------------------------------------------------------------------------- sampling


@dataclass
class Run:
    samples: np.ndarray  # [N, 3] (x1, x2, x3)
    proposed: int
    accepted: int


_RUNS: dict[tuple[str, str], Run] = {}


def run_engine(llm: LLM, params: dict[str, float | int], n: int = NUM_SAMPLES, seed0: int = 0) -> Run:
    outputs = generate_unseeded(llm, [PROMPT] * n, SamplingParams(max_tokens=4, ignore_eos=True, **params), seed0)  # type: ignore[arg-type]
    assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in outputs)
    samples = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
    return Run(samples, sum(o.metrics.proposed_tokens for o in outputs),
               sum(o.metrics.accepted_tokens for o in outputs))


def cached_run(engines: dict[str, LLM], drafter: str, config: str) -> Run:
    key = (drafter, config)
    if key not in _RUNS:
        _RUNS[key] = run_engine(engines[drafter], SAMPLING_CONFIGS[config])
    return _RUNS[key]


# ----------------------------------------------------------------------------- the tests


# Plain temperature sampling in the fast tier (make test-fast); the other processors in the full suite.
@pytest.mark.parametrize("config", [pytest.param(c, marks=() if c == "temperature_1" else pytest.mark.slow)
                                    for c in SAMPLING_CONFIGS])
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculative_samples_follow_target_distribution(engines: dict[str, LLM], small_target: Path,
                                                         drafter: str, config: str) -> None:
    run = cached_run(engines, drafter, config)
    ref = reference(small_target, PROMPT, SamplingParams(**SAMPLING_CONFIGS[config]))  # type: ignore[arg-type]

    # Speculation really happened, and both verdicts (accept and reject) were exercised.
    assert run.proposed > NUM_SAMPLES // 4, f"only {run.proposed} drafts proposed"
    assert 0 < run.accepted < run.proposed

    assert_follows_reference(run.samples, ref)


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_penalties_and_logit_bias_stay_exact(engines: dict[str, LLM], small_target: Path, drafter: str) -> None:
    """presence/frequency penalties count the drafts on the path before each verified position (and a
    draft model's q counts its own drafts): the output follows the penalised target exactly."""
    run = run_engine(engines[drafter], PENALTY_CONFIG, n=NUM_SAMPLES // 2, seed0=20_000_000)
    assert 0 < run.accepted < run.proposed
    assert_follows_reference(run.samples, reference(small_target, PROMPT, SamplingParams(**PENALTY_CONFIG)))
    # The penalties and bias matter: the same samples do not fit the unpenalised target.
    plain = reference(small_target, PROMPT, SamplingParams(temperature=1.0))
    assert grouped_chisquare(run.samples, plain).pvalue < P_CONTROL


def test_negative_control_wrong_reference_is_rejected(engines: dict[str, LLM], small_target: Path,
                                                      small_draft: Path) -> None:
    """The test has power: the same samples fail against distributions that are somewhat off."""
    run = cached_run(engines, "draft", "temperature_1")
    # The draft model's own distribution (what an "accept every draft" bug would produce).
    wrong = reference(small_draft, PROMPT, SamplingParams(temperature=1.0))
    assert grouped_chisquare(run.samples, wrong).pvalue < P_CONTROL
    # The target at a 30% higher temperature.
    hotter = reference(small_target, PROMPT, SamplingParams(temperature=1.3))
    assert grouped_chisquare(run.samples, hotter).pvalue < P_CONTROL


def test_negative_control_broken_verifier_is_detected(engines: dict[str, LLM], small_target: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A plausible indexing bug inside the engine (draft t_i judged against q_{i-1} instead of q_i)
    biases the output, and the same grouped chi-square test catches it.

    (Dropping q altogether, i.e. accepting t with probability p(t) and resampling from p without
    t, would NOT be a useful control: that scheme is itself exact, only less efficient.)
    """
    real_verify = verification.verify_drafts

    def shifted_verify(tokens: torch.Tensor, num: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None,
                       greedy: torch.Tensor, generators: list[torch.Generator | None]) -> object:
        return real_verify(tokens, num, target, None if draft is None else draft.roll(1, dims=1), greedy,
                           generators)

    monkeypatch.setattr(verification, "verify_drafts", shifted_verify)
    run = run_engine(engines["draft"], SAMPLING_CONFIGS["temperature_1"], n=NUM_SAMPLES // 2, seed0=10_000_000)
    ref = reference(small_target, PROMPT, SamplingParams(temperature=1.0))
    assert grouped_chisquare(run.samples, ref).pvalue < P_CONTROL
