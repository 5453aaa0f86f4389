"""Distribution exactness of the whole speculative engine path (draft, verify, rollback, stop rules).

``tests/test_rejection.py`` checks the rejection sampler on hand-made distributions. Here the
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
from scipy.stats import chi2

import infer.engine.speculative_runner as speculative_runner
from checkpoints import load_hf_model
from infer import LLM, SamplingParams
from infer.sampling.transforms import SamplingBatch, probs_from_logits, token_presence

V = 10  # the vocabulary of the small_target / small_draft pair (conftest.py)
# Only four of the ten tokens, repeated: n-gram lookup finds a match whenever x1 is one of them,
# and the repetition penalty's context differs between continuations.
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
NUM_SAMPLES = 10_000
SPEC_LENGTH = 3
P_THRESHOLD = 1e-3
P_CONTROL = 1e-6
MIN_EXPECTED = 5.0

CONFIGS: dict[str, dict[str, float | int]] = {
    "temperature_1": {"temperature": 1.0},
    "temperature_0.7_top_k_3": {"temperature": 0.7, "top_k": 3},
    "top_p_0.8": {"temperature": 1.0, "top_p": 0.8},
    "repetition_penalty_1.5": {"temperature": 1.0, "repetition_penalty": 1.5},
}
DRAFTERS = ("draft", "ngram")


@pytest.fixture(scope="module")
def engines(small_target: Path, small_draft: Path) -> dict[str, LLM]:
    common = dict(dtype="float32", device="cpu", spec_length=SPEC_LENGTH, max_batch_size=256, max_seq_len=32)
    return {
        "draft": LLM(str(small_target), draft_model=str(small_draft), **common),  # type: ignore[arg-type]
        "ngram": LLM(str(small_target), speculator="ngram", ngram_min=1, ngram_max=3, **common),  # type: ignore[arg-type]
    }


# ----------------------------------------------------------------------------- reference distribution


@dataclass
class Reference:
    """Exact target distributions after the sampling transform."""

    p1: np.ndarray  # [V]       P(x1 | prompt)
    p23: np.ndarray  # [V, V, V] P(x2, x3 | prompt, x1), indexed [x1, x2, x3]




@torch.no_grad()
def reference(model_path: Path, prompt: list[int], params: SamplingParams) -> Reference:
    """Enumerate every (x1, x2) continuation with plain forward passes (no KV cache)."""
    model = load_hf_model(model_path)

    def next_probs(contexts: list[list[int]]) -> torch.Tensor:
        logits = model(torch.tensor(contexts)).logits[:, -1].float()
        batch = SamplingBatch.from_params([params] * len(contexts), "cpu")
        presence = token_presence(contexts, V, "cpu") if batch.use_penalty else None
        probs = probs_from_logits(logits, batch, presence).double()
        return probs / probs.sum(dim=-1, keepdim=True)

    p1 = next_probs([prompt])[0]
    p2 = next_probs([prompt + [a] for a in range(V)])  # [x1, x2]
    p3 = next_probs([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)  # [x1, x2, x3]
    return Reference(p1.numpy(), (p2[:, :, None] * p3).numpy())


# ----------------------------------------------------------------------------- statistics


@dataclass
class ChiSquare:
    statistic: float
    dof: int
    impossible: int  # samples that fell on a zero-probability cell

    @property
    def pvalue(self) -> float:
        if self.impossible:
            return 0.0
        return float(chi2.sf(self.statistic, self.dof)) if self.dof else 1.0

    def __add__(self, other: ChiSquare) -> ChiSquare:
        return ChiSquare(self.statistic + other.statistic, self.dof + other.dof, self.impossible + other.impossible)


def chisquare_cells(counts: np.ndarray, probs: np.ndarray) -> ChiSquare:
    """Goodness of fit of ``counts`` to ``probs`` (same shape, any); cells expected < 5 are pooled."""
    counts, probs = counts.ravel().astype(np.float64), probs.ravel().astype(np.float64)
    total = counts.sum()
    support = probs > 0
    impossible = int(counts[~support].sum())
    if total == 0:
        return ChiSquare(0.0, 0, impossible)
    observed = counts[support]
    expected = total * probs[support] / probs[support].sum()
    big = expected >= MIN_EXPECTED
    cells_o, cells_e = list(observed[big]), list(expected[big])
    small_o, small_e = observed[~big].sum(), expected[~big].sum()
    if small_e > 0:
        if small_e >= MIN_EXPECTED or not cells_e:
            cells_o.append(small_o)
            cells_e.append(small_e)
        else:  # too little mass for a cell of its own: fold into the smallest big cell
            i = int(np.argmin(cells_e))
            cells_o[i] += small_o
            cells_e[i] += small_e
    o, e = np.array(cells_o), np.array(cells_e)
    return ChiSquare(float(((o - e) ** 2 / e).sum()), len(cells_e) - 1, impossible)


def grouped_chisquare(samples: np.ndarray, ref: Reference) -> ChiSquare:
    """Sum over x1 groups of the (x2, x3) goodness of fit to P(x2, x3 | x1)."""
    result = ChiSquare(0.0, 0, 0)
    for x1 in range(V):
        group = samples[samples[:, 0] == x1]
        counts = np.zeros((V, V))
        np.add.at(counts, (group[:, 1], group[:, 2]), 1)
        result = result + chisquare_cells(counts, ref.p23[x1])
    return result


def first_token_chisquare(samples: np.ndarray, ref: Reference) -> ChiSquare:
    return chisquare_cells(np.bincount(samples[:, 0], minlength=V), ref.p1)


def assert_follows_reference(samples: np.ndarray, ref: Reference) -> None:
    """x1 and (x2, x3 | x1) both fit the exact distributions, and no sample is impossible."""
    first = first_token_chisquare(samples, ref)
    assert first.impossible == 0
    assert first.pvalue > P_THRESHOLD, f"x1: chi2={first.statistic:.1f}, dof={first.dof}"
    joint = grouped_chisquare(samples, ref)
    assert joint.impossible == 0, f"{joint.impossible} samples fell on zero-probability (x2, x3) cells"
    assert joint.dof >= 20  # enough cells for the test to mean something
    assert joint.pvalue > P_THRESHOLD, f"(x2, x3 | x1): chi2={joint.statistic:.1f}, dof={joint.dof}"


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
    sampling = [SamplingParams(max_tokens=4, ignore_eos=True, seed=seed0 + i, **params) for i in range(n)]  # type: ignore[arg-type]
    outputs = llm.generate([PROMPT] * n, sampling)
    assert all(len(o.token_ids) == 4 and o.finish_reason == "length" for o in outputs)
    samples = np.array([o.token_ids[:3] for o in outputs], dtype=np.int64)
    return Run(samples, sum(o.metrics.proposed_tokens for o in outputs),
               sum(o.metrics.accepted_tokens for o in outputs))


def cached_run(engines: dict[str, LLM], drafter: str, config: str) -> Run:
    key = (drafter, config)
    if key not in _RUNS:
        _RUNS[key] = run_engine(engines[drafter], CONFIGS[config])
    return _RUNS[key]


# ----------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculative_samples_follow_target_distribution(engines: dict[str, LLM], small_target: Path,
                                                         drafter: str, config: str) -> None:
    run = cached_run(engines, drafter, config)
    ref = reference(small_target, PROMPT, SamplingParams(**CONFIGS[config]))  # type: ignore[arg-type]

    # Speculation really happened, and both verdicts (accept and reject) were exercised.
    assert run.proposed > NUM_SAMPLES // 4, f"only {run.proposed} drafts proposed"
    assert 0 < run.accepted < run.proposed

    assert_follows_reference(run.samples, ref)


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
    real_verify = speculative_runner.verify_drafts

    def shifted_verify(tokens: torch.Tensor, num: torch.Tensor, target: torch.Tensor, draft: torch.Tensor | None,
                       greedy: torch.Tensor, generators: list[torch.Generator | None]) -> object:
        return real_verify(tokens, num, target, None if draft is None else draft.roll(1, dims=1), greedy,
                           generators)

    monkeypatch.setattr(speculative_runner, "verify_drafts", shifted_verify)
    run = run_engine(engines["draft"], CONFIGS["temperature_1"], n=NUM_SAMPLES // 2, seed0=10_000_000)
    ref = reference(small_target, PROMPT, SamplingParams(temperature=1.0))
    assert grouped_chisquare(run.samples, ref).pvalue < P_CONTROL
