"""Seeded sampling: each token drawn by noise keyed by (seed, position), whatever computes it.

* The keyed draw itself (``KeyedDraw``, the inverse CDF at a keyed uniform) is exactly distributed
  as p: a chi-square test over many seeds, and a negative control (the square of the uniform, a
  skewed noise) that the same test rejects.
* The same seeds give the same tokens with every drafter as with plain decoding (draft model, EAGLE-3,
  n-gram, suffix, Medusa), on the V = 10 pair of the exactness tests, and those tokens follow the
  target's distribution; speculation really ran and both verdicts occurred.
* A seeded request's tokens on a suffix-decoding engine do not depend on the traffic it served
  before or beside it, and the n copies of a request (seed, seed + 1, ...) each get their own stream.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from checkpoints import make_eagle3_head, make_medusa_heads
from helpers import (
    P_CONTROL,
    P_THRESHOLD,
    PROMPT,
    SAMPLING_CONFIGS,
    assert_follows_reference,
    chisquare_cells,
    reference,
)
from infer import LLM, SamplingParams
from infer.sampling.sampler import KeyedDraw, inverse_cdf, keyed_sample, sample_from_probs

NUM_SAMPLES = 3000
PROBS = torch.tensor([0.3, 0.2, 0.15, 0.1, 0.1, 0.08, 0.04, 0.02, 0.01, 0.0])


def test_keyed_draw_is_exactly_distributed_and_deterministic() -> None:
    draws = [KeyedDraw(seed, 7) for seed in range(20_000)]
    tokens = keyed_sample(PROBS.expand(len(draws), -1), draws)
    fit = chisquare_cells(np.bincount(tokens.numpy(), minlength=len(PROBS)), PROBS.double().numpy())
    assert fit.impossible == 0 and fit.pvalue > P_THRESHOLD, fit
    # A deterministic function of (seed, position, p): again the same tokens, whatever the batch.
    assert torch.equal(keyed_sample(PROBS.expand(len(draws), -1), draws), tokens)
    assert int(sample_from_probs(PROBS[None], [draws[5]])[0]) == int(tokens[5])
    # Positions and neighbouring seeds have their own noise (seed + 1 at p is not seed at p + 1).
    noise = KeyedDraw(3, 4).uniform()
    assert 0.0 <= noise < 1.0
    for other in (KeyedDraw(3, 5), KeyedDraw(4, 4), KeyedDraw(4, 3), KeyedDraw(2, 5)):
        assert other.uniform() != noise
    assert KeyedDraw(3, 4).uniform() == noise


def test_negative_control_uniform_noise_is_detected() -> None:
    """The inverse CDF at u squared (a noise skewed towards 0) favours the first tokens: the same test fails."""
    draws = [KeyedDraw(seed, 7) for seed in range(20_000)]
    skewed = torch.tensor([d.uniform() ** 2 for d in draws], dtype=torch.float64)
    tokens = inverse_cdf(PROBS.expand(len(draws), -1), skewed)
    fit = chisquare_cells(np.bincount(tokens.numpy(), minlength=len(PROBS)), PROBS.double().numpy())
    assert fit.pvalue < P_CONTROL


@pytest.fixture(scope="module")
def engines(small_target: Path, small_draft: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LLM]:
    # A fixed draft length: every round drafts, so the keyed verification is exercised throughout.
    common: dict[str, Any] = dict(dtype="float32", device="cpu", max_batch_size=256, max_seq_len=32,
                                  spec_length_policy="fixed")
    heads = make_medusa_heads(small_target, tmp_path_factory.mktemp("seeded_medusa") / "medusa", num_heads=2,
                              tree_size=10, top_k=4, jitter=0.2)
    eagle = make_eagle3_head(small_target, tmp_path_factory.mktemp("seeded_eagle") / "eagle", std=0.3)
    return {
        "plain": LLM(str(small_target), **common),
        "draft": LLM(str(small_target), draft_model=str(small_draft), spec_length=3, **common),
        "ngram": LLM(str(small_target), speculator="ngram", ngram_min=1, ngram_max=3, spec_length=3, **common),
        "suffix": LLM(str(small_target), speculator="suffix", spec_length=3, suffix_min_prob=0.02, **common),
        "medusa": LLM(str(small_target), speculator="medusa", medusa_heads=str(heads), medusa_tree_size=10,
                      **common),
        "eagle": LLM(str(small_target), speculator="eagle", eagle_head=str(eagle), eagle_tree_size=8, spec_length=2,
                     **common),
    }


@pytest.mark.parametrize("config", ["temperature_1", pytest.param("repetition_penalty_1.5", marks=pytest.mark.slow)])
def test_seeded_tokens_are_plain_decoding_s_with_every_drafter(engines: dict[str, LLM], small_target: Path,
                                                                config: str) -> None:
    params = [SamplingParams(max_tokens=4, ignore_eos=True, seed=1000 * i + 3, **SAMPLING_CONFIGS[config])  # type: ignore[arg-type]
              for i in range(NUM_SAMPLES)]
    runs = {}
    for name, llm in engines.items():
        outputs = llm.generate([PROMPT] * NUM_SAMPLES, params)
        runs[name] = [o.token_ids for o in outputs]
        if name != "plain":
            proposed = sum(o.metrics.proposed_tokens for o in outputs)
            accepted = sum(o.metrics.accepted_tokens for o in outputs)
            assert proposed > NUM_SAMPLES // 2 and 0 < accepted < proposed, (name, proposed, accepted)
    for name in engines:
        assert runs[name] == runs["plain"], name
    samples = np.array([ids[:3] for ids in runs["plain"]], dtype=np.int64)
    assert_follows_reference(samples, reference(small_target, PROMPT, SamplingParams(**SAMPLING_CONFIGS[config])))  # type: ignore[arg-type]


def test_seeded_request_ignores_the_traffic_a_suffix_engine_has_seen(tiny_llama: Path) -> None:
    """The suffix store is shared: other requests' outputs change the drafts, never a seeded
    request's tokens. Its n copies (seed, seed + 1, ...) draw different tokens."""
    prompt = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
    seeded = [SamplingParams(max_tokens=24, temperature=1.0, seed=7 + i, ignore_eos=True) for i in range(3)]
    plain = [o.token_ids for o in LLM(str(tiny_llama), dtype="float32", device="cpu").generate([prompt] * 3, seeded)]
    assert len({tuple(ids) for ids in plain}) == 3  # each copy its own stream
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="suffix", spec_length=4,
              spec_length_policy="fixed")
    first = [o.token_ids for o in llm.generate([prompt] * 3, seeded)]
    noise = [SamplingParams(max_tokens=24, temperature=1.0) for _ in range(6)] + [
        SamplingParams(max_tokens=24, temperature=0.0)]
    llm.generate([prompt, "def sub(a, b):\n", prompt, "import os\nimport", prompt, prompt, prompt], noise)
    again = llm.generate([prompt] * 3 + ["import os\n", prompt], seeded + noise[:2])
    assert first == plain and [o.token_ids for o in again[:3]] == plain
    assert sum(o.metrics.accepted_tokens for o in again) > 0  # the store drafted, and drafts were kept
