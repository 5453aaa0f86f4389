"""Distribution exactness of Medusa tree speculation through the whole engine.

Same harness as ``tests/speculative/test_exactness.py`` (the reference enumeration and chi-square helpers of
``tests/helpers.py``): a V = 10 target, thousands of seeded requests with max_tokens=4, and the generated
(x1, x2, x3) compared with the target's exact distribution. x1 comes from prefill; the first
Medusa round verifies a tree of depth <= 2 for (x2, x3), so both in-round acceptance of tree
paths (siblings tried in turn) and the correction/bonus draws are covered. The negative control
breaks the residual (the correction drawn from p, not from p without the rejected siblings) and
must be caught.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import infer.speculative.verification as verification
from checkpoints import make_medusa_heads
from helpers import (
    P_CONTROL,
    P_THRESHOLD,
    PROMPT,
    TREE_CONFIGS,
    TREE_NUM_SAMPLES,
    first_token_chisquare,
    generate_unseeded,
    grouped_chisquare,
    reference,
)
from infer import LLM, SamplingParams


@pytest.fixture(scope="module")
def engine(small_target: Path, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    heads = make_medusa_heads(small_target, tmp_path_factory.mktemp("medusa_small_heads") / "medusa",
                              num_heads=2, tree_size=10, top_k=4, jitter=0.2)
    # A fixed tree: every round verifies all 10 nodes (the measured-size default could settle on plain steps
    # for this batch of 256, leaving the tree acceptance untested).
    return LLM(str(small_target), speculator="medusa", medusa_heads=str(heads), dtype="float32", device="cpu",
               max_batch_size=256, max_seq_len=32, medusa_tree_size=10)


def run_engine(llm: LLM, params: dict[str, Any], n: int = TREE_NUM_SAMPLES, seed0: int = 0) -> tuple[np.ndarray, int, int]:
    outputs = generate_unseeded(llm, [PROMPT] * n, SamplingParams(max_tokens=4, ignore_eos=True, **params), seed0)
    assert all(len(o.token_ids) == 4 for o in outputs)
    samples = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
    return samples, sum(o.metrics.proposed_tokens for o in outputs), sum(o.metrics.accepted_tokens for o in outputs)


@pytest.mark.parametrize("config", list(TREE_CONFIGS))
def test_medusa_samples_follow_target_distribution(engine: LLM, small_target: Path, config: str) -> None:
    samples, proposed, accepted = run_engine(engine, TREE_CONFIGS[config])
    ref = reference(small_target, PROMPT, SamplingParams(**TREE_CONFIGS[config]))  # type: ignore[arg-type]
    assert proposed > TREE_NUM_SAMPLES // 2 and 0 < accepted < proposed  # both verdicts were exercised

    first = first_token_chisquare(samples, ref)
    assert first.impossible == 0 and first.pvalue > P_THRESHOLD, f"x1: chi2={first.statistic:.1f}"
    joint = grouped_chisquare(samples, ref)
    assert joint.impossible == 0, f"{joint.impossible} samples fell on zero-probability (x2, x3) cells"
    assert joint.dof >= 20
    assert joint.pvalue > P_THRESHOLD, f"(x2, x3 | x1): chi2={joint.statistic:.1f}, dof={joint.dof}"


def test_negative_control_broken_residual_is_detected(engine: LLM, small_target: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(probs: torch.Tensor, rejected: Any) -> torch.Tensor:
        return probs  # forgets that the rejected siblings must not be drawn again

    monkeypatch.setattr(verification, "residual_after_rejections", broken)
    samples, _, _ = run_engine(engine, TREE_CONFIGS["temperature_1"], n=2000, seed0=10_000_000)
    ref = reference(small_target, PROMPT, SamplingParams(temperature=1.0))
    assert grouped_chisquare(samples, ref).pvalue < P_CONTROL
