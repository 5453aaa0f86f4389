"""Sampling: each transform against hand-computed distributions, seeding, validation, engine reproducibility."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from infer import LLM, SamplingParams
from infer.sampling import SamplingBatch, probs_from_logits, sample_from_probs, sample_next_tokens
from infer.sampling.sampler import inverse_cdf
from infer.sampling.transforms import drafts_on_path, greedy_tokens, token_counts

pytestmark = pytest.mark.usefixtures("torch_single_thread")

ATOL = 1e-6


def probs_for(logits: list[float] | torch.Tensor, presence: torch.Tensor | None = None,
              **params: object) -> torch.Tensor:
    """The transform for one row with ``params``."""
    row = torch.as_tensor(logits, dtype=torch.float32).unsqueeze(0)
    batch = SamplingBatch.from_params([SamplingParams(**params)], "cpu")  # type: ignore[arg-type]
    return probs_from_logits(row, batch, presence)[0]


def softmax(values: list[float]) -> list[float]:
    exps = [math.exp(v) for v in values]
    return [e / sum(exps) for e in exps]


def assert_probs(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=ATOL, rtol=0)


# Logits whose softmax is exactly [1/8, 1/2, 1/8, 1/4] (shuffled, so sorting matters).
DYADIC = [math.log(0.125), math.log(0.5), math.log(0.125), math.log(0.25)]


# ------------------------------------------------------------------------- single transforms


def test_plain_softmax() -> None:
    assert_probs(probs_for([1.0, 2.0, 3.0, 0.0]), softmax([1.0, 2.0, 3.0, 0.0]))
    assert_probs(probs_for(DYADIC), [0.125, 0.5, 0.125, 0.25])


@pytest.mark.parametrize("temperature", [0.5, 2.0, 0.01])
def test_temperature(temperature: float) -> None:
    logits = [1.0, 2.0, 3.0, 0.0]
    assert_probs(probs_for(logits, temperature=temperature), softmax([v / temperature for v in logits]))


def test_top_k() -> None:
    logits = [1.0, 2.0, 3.0, 0.0, -1.0]
    assert_probs(probs_for(logits, top_k=2), [0.0, *softmax([2.0, 3.0]), 0.0, 0.0])
    assert_probs(probs_for(logits, top_k=1), [0.0, 0.0, 1.0, 0.0, 0.0])
    # top_k >= vocab keeps everything; top_k applies after temperature (same set, sharper shape)
    assert_probs(probs_for(logits, top_k=50), softmax(logits))
    assert_probs(probs_for(logits, top_k=3, temperature=0.5), [*softmax([2.0, 4.0, 6.0]), 0.0, 0.0])


def test_top_p_keeps_the_boundary_token() -> None:
    # sorted probs: 0.5 (idx 1), 0.25 (idx 3), 0.125, 0.125
    # top_p=0.55: 0.5 alone is not enough, so the token that crosses 0.55 (idx 3) is kept
    assert_probs(probs_for(DYADIC, top_p=0.55), [0.0, 2 / 3, 0.0, 1 / 3])
    assert_probs(probs_for(DYADIC, top_p=0.45), [0.0, 1.0, 0.0, 0.0])
    # 0.8 needs a third token; the two 1/8 tokens tie, exactly one of them is kept
    p = probs_for(DYADIC, top_p=0.8)
    assert p[1].item() == pytest.approx(0.5 / 0.875) and p[3].item() == pytest.approx(0.25 / 0.875)
    assert sorted([p[0].item(), p[2].item()]) == pytest.approx([0.0, 0.125 / 0.875])
    assert_probs(probs_for(DYADIC, top_p=1.0), [0.125, 0.5, 0.125, 0.25])
    # a tiny top_p keeps only the most likely token
    assert_probs(probs_for(DYADIC, top_p=1e-6), [0.0, 1.0, 0.0, 0.0])


def test_min_p() -> None:
    # threshold = 0.5 * min_p
    assert_probs(probs_for(DYADIC, min_p=0.3), [0.0, 2 / 3, 0.0, 1 / 3])
    assert_probs(probs_for(DYADIC, min_p=0.2), [0.125, 0.5, 0.125, 0.25])  # threshold 0.1 keeps all
    assert_probs(probs_for(DYADIC, min_p=0.9), [0.0, 1.0, 0.0, 0.0])
    assert_probs(probs_for(DYADIC, min_p=0.0), [0.125, 0.5, 0.125, 0.25])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = [2.0, -1.0, 0.5, -2.0, 1.0]
    presence = torch.tensor([[True, True, False, False, False]])
    expected = softmax([2.0 / 2, -1.0 * 2, 0.5, -2.0, 1.0])
    assert_probs(probs_for(logits, presence, repetition_penalty=2.0), expected)
    # a penalty below 1 rewards repetition the same way round
    expected = softmax([2.0 / 0.5, -1.0 * 0.5, 0.5, -2.0, 1.0])
    assert_probs(probs_for(logits, presence, repetition_penalty=0.5), expected)
    # no seen tokens: nothing changes
    assert_probs(probs_for(logits, torch.zeros(1, 5, dtype=torch.bool), repetition_penalty=2.0), softmax(logits))
    with pytest.raises(ValueError, match="presence"):
        probs_for(logits, None, repetition_penalty=2.0)


def test_penalty_applies_before_temperature() -> None:
    logits = [2.0, -1.0, 0.5]
    presence = torch.tensor([[True, True, False]])
    expected = softmax([2.0 / 2 / 0.5, -1.0 * 2 / 0.5, 0.5 / 0.5])
    assert_probs(probs_for(logits, presence, repetition_penalty=2.0, temperature=0.5), expected)


def test_greedy_is_one_hot_on_the_argmax() -> None:
    assert_probs(probs_for([1.0, 2.0, 3.0, 0.0], temperature=0), [0.0, 0.0, 1.0, 0.0])
    # top-k/top-p/min-p do not change a greedy row
    assert_probs(probs_for([1.0, 2.0, 3.0, 0.0], temperature=0, top_k=2, top_p=0.1, min_p=0.5),
                 [0.0, 0.0, 1.0, 0.0])
    # the penalty does: greedy picks the argmax of the penalised logits (as transformers does)
    presence = torch.tensor([[False, False, True, False]])
    assert_probs(probs_for([1.0, 2.0, 3.0, 0.0], presence, temperature=0, repetition_penalty=2.0),
                 [0.0, 1.0, 0.0, 0.0])


def test_all_transforms_in_order() -> None:
    """penalty -> temperature -> top-k -> top-p -> min-p, computed by hand."""
    logits = [3.0, 1.0, 2.0, -1.0, 0.0, 2.5]
    presence = torch.tensor([[True, False, False, True, False, False]])
    penalised = [1.5, 1.0, 2.0, -2.0, 0.0, 2.5]
    scaled = [v / 0.8 for v in penalised]
    # top_k=4 keeps indices 5, 2, 0, 1
    kept = [0, 1, 2, 5]
    p = softmax([scaled[i] for i in kept])
    by_index = dict(zip(kept, p, strict=True))
    # top_p=0.8 over sorted (5, 2, 0, 1): keep while the mass before a token is < 0.8
    order = sorted(kept, key=lambda i: -by_index[i])
    mass, top_p_kept = 0.0, []
    for i in order:
        if mass < 0.8:
            top_p_kept.append(i)
        mass += by_index[i]
    assert len(top_p_kept) == 3  # the case exercises a real cut
    total = sum(by_index[i] for i in top_p_kept)
    after_top_p = {i: by_index[i] / total for i in top_p_kept}
    # min_p=0.5 against the largest remaining probability
    threshold = 0.5 * max(after_top_p.values())
    after_min_p = {i: v for i, v in after_top_p.items() if v >= threshold}
    assert len(after_min_p) == 2
    total = sum(after_min_p.values())
    expected = [after_min_p.get(i, 0.0) / total for i in range(6)]
    actual = probs_for(logits, presence, repetition_penalty=2.0, temperature=0.8, top_k=4, top_p=0.8, min_p=0.5)
    assert_probs(actual, expected)


def test_mixed_batch_rows_use_their_own_parameters() -> None:
    base = torch.tensor([1.0, 2.0, 3.0, 0.0, -1.0])
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.5),
        SamplingParams(top_k=2),
        SamplingParams(top_p=0.5),
        SamplingParams(min_p=0.3),
        SamplingParams(repetition_penalty=3.0),
        SamplingParams(),
    ]
    presence = torch.zeros(len(params), 5, dtype=torch.bool)
    presence[:, 2] = True  # every row has seen token 2; only row 5 penalises it
    logits = base.repeat(len(params), 1)
    probs = probs_from_logits(logits, SamplingBatch.from_params(params, "cpu"), presence)
    for row, p in enumerate(params):
        alone = probs_from_logits(base.unsqueeze(0), SamplingBatch.from_params([p], "cpu"), presence[row: row + 1])
        torch.testing.assert_close(probs[row], alone[0], atol=ATOL, rtol=0, msg=f"row {row}: {p}")
    assert_probs(probs[0], [0.0, 0.0, 1.0, 0.0, 0.0])
    assert_probs(probs[1], softmax([2.0, 4.0, 6.0, 0.0, -2.0]))
    assert_probs(probs[2], [0.0, *softmax([2.0, 3.0]), 0.0, 0.0])
    assert_probs(probs[6], softmax(base.tolist()))
    assert_probs(probs[5], softmax([1.0, 2.0, 1.0, 0.0, -1.0]))
    assert torch.allclose(probs.sum(-1), torch.ones(len(params)))


def test_drafts_on_path_counts_the_drafts_before_each_position() -> None:
    vocab = 7
    drafts = torch.tensor([[2, 3, 2], [5, 6, 4]])
    out = drafts_on_path(drafts, vocab)
    assert out.shape == (2, 4, vocab)
    for b, row in enumerate(drafts.tolist()):
        for i in range(4):
            assert out[b, i].tolist() == [float(row[:i].count(t)) for t in range(vocab)], (b, i)
    assert torch.equal(drafts_on_path(torch.zeros(2, 0, dtype=torch.long), vocab), torch.zeros(2, 1, vocab))


def test_presence_frequency_penalties_and_logit_bias_as_openai_defines_them() -> None:
    """logit - frequency * count - presence * [count > 0] + bias, on generated tokens only."""
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]])
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25, logit_bias={3: 2.0, 0: -1.0})
    counts = token_counts([[1, 1, 2]], 4, "cpu")
    assert counts.tolist() == [[0.0, 2.0, 1.0, 0.0]]
    probs = probs_from_logits(logits, SamplingBatch.from_params([params], "cpu"), counts=counts)
    expected = torch.tensor([[1.0 - 1.0, 2.0 - 0.5 - 0.5, 0.5 - 0.25 - 0.5, -1.0 + 2.0]])
    assert torch.allclose(probs, torch.softmax(expected, dim=-1))
    with pytest.raises(ValueError, match="counts"):
        probs_from_logits(logits, SamplingBatch.from_params([params], "cpu"))
    # Greedy rows take the argmax after them: the bias moves it.
    greedy = SamplingParams(temperature=0.0, logit_bias={0: 5.0})
    assert probs_from_logits(logits, SamplingBatch.from_params([greedy], "cpu")).argmax().item() == 0


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": float("nan")}, "frequency_penalty"),
    ({"logit_bias": {1: 101.0}}, "logit_bias"), ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {"5": 1.0}}, "logit_bias"),
])
def test_penalty_and_bias_bounds(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{field}="):
        SamplingParams(**kwargs)  # type: ignore[arg-type]


# ------------------------------------------------------------------------- drawing tokens


def _generators(seed: int, n: int) -> list[torch.Generator | None]:
    return [torch.Generator().manual_seed(seed + i) for i in range(n)]


def test_sample_next_tokens_is_reproducible_with_a_seed() -> None:
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0)] * 4
    contexts: list[list[int]] = [[]] * 4

    def draw(seed: int) -> list[int]:
        gens = _generators(seed, 4)
        return [t for _ in range(10) for t in sample_next_tokens(logits, params, contexts, gens).tolist()]

    torch.manual_seed(123)  # the global RNG must not matter when every row has a generator
    first = draw(1)
    torch.manual_seed(456)
    assert draw(1) == first
    assert draw(2) != first


def test_sample_next_tokens_greedy_rows_take_the_argmax() -> None:
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0)]
    out = sample_next_tokens(logits, params, [[]] * 3, _generators(0, 3))
    assert out[0].item() == logits[0].argmax().item() and out[2].item() == logits[2].argmax().item()


def test_sample_from_probs_frequencies_match() -> None:
    probs = torch.tensor([0.1, 0.2, 0.0, 0.3, 0.4])
    n = 20000
    torch.manual_seed(0)
    shared = sample_from_probs(probs.repeat(n, 1), [None] * n)
    freq = torch.bincount(shared, minlength=5).float() / n
    torch.testing.assert_close(freq, probs, atol=0.015, rtol=0)
    assert freq[2] == 0  # zero-probability tokens are never drawn

    # per-row generators (and unnormalised weights) give the same distribution
    n = 3000
    gen = torch.Generator().manual_seed(1)
    own = sample_from_probs((probs * 3).repeat(n, 1), [gen] * n)
    freq = torch.bincount(own, minlength=5).float() / n
    torch.testing.assert_close(freq, probs, atol=0.03, rtol=0)
    assert freq[2] == 0


def test_inverse_cdf_boundaries() -> None:
    """Each uniform lands on the token whose cumulative interval holds it: boundaries go to the next
    token of positive weight, a uniform just below 1 to the last token of positive weight (never a
    zero-weight one, nor past the vocabulary), and unnormalised weights scale with their total."""
    weights = torch.tensor([[0.0, 0.25, 0.0, 0.25, 0.5, 0.0, 0.0]]).expand(7, -1)
    uniforms = torch.tensor([0.0, 0.2499, 0.25, 0.4999, 0.5, 0.75, 1.0 - 2.0**-53], dtype=torch.float64)
    assert inverse_cdf(weights, uniforms).tolist() == [1, 1, 3, 3, 4, 4, 4]
    assert inverse_cdf(weights * 8, uniforms).tolist() == [1, 1, 3, 3, 4, 4, 4]
    # The other convention (the first cumulative weight at or above the point) would draw token 0,
    # of weight 0, at u = 0; this one never draws a zero-weight token, over many uniforms either.
    wrong = torch.searchsorted(weights[:1].double().cumsum(-1), torch.tensor([[0.0]], dtype=torch.float64))
    assert int(wrong) == 0
    many = inverse_cdf(weights[:1].expand(10_000, -1), torch.rand(10_000, dtype=torch.float64))
    assert set(many.tolist()) == {1, 3, 4}


def test_sample_from_probs_refuses_undrawable_rows() -> None:
    """Rows multinomial refuses are refused too: nan, inf, a negative weight, no mass."""
    for bad in ([0.5, float("nan"), 0.5], [0.5, float("inf"), 0.5], [0.5, -0.1, 0.6], [0.0, 0.0, 0.0]):
        with pytest.raises(RuntimeError, match="inf, nan or a negative"):
            sample_from_probs(torch.tensor([[0.2, 0.3, 0.5], bad]), [None, None])


def test_sample_from_probs_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError):
        sample_from_probs(torch.ones(4), [None])
    with pytest.raises(ValueError):
        sample_from_probs(torch.ones(2, 4), [None])


# ------------------------------------------------------------------------- validation


@pytest.mark.parametrize(("field", "value"), [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("temperature", -1.0),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_k", -1),
    ("min_p", 2.0),
    ("min_p", -0.1),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    # Values the float32 transform cannot compute (they used to fail the whole batch at run time).
    ("temperature", float("nan")),
    ("temperature", float("inf")),
    ("temperature", 1e39),
    ("repetition_penalty", 1e-300),
    ("repetition_penalty", 1e300),
    ("repetition_penalty", float("nan")),
    ("top_p", float("nan")),
    ("min_p", float("nan")),
    ("seed", 2**64),
    ("seed", -(2**63) - 1),
])
def test_invalid_sampling_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_valid_edge_values_are_accepted() -> None:
    SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=0, min_p=1.0, repetition_penalty=0.01)
    assert SamplingParams(temperature=0).greedy and not SamplingParams(temperature=0.1).greedy
    assert SamplingParams(stop="x").stop == ["x"]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-45), SamplingParams(temperature=5e-324), SamplingParams(temperature=1e-5),
    SamplingParams(temperature=3e38), SamplingParams(top_k=2**70), SamplingParams(repetition_penalty=0.01),
    SamplingParams(repetition_penalty=100.0, temperature=1e-5), SamplingParams(min_p=1e-320)])
def test_accepted_extremes_give_finite_distributions(params: SamplingParams) -> None:
    """Whatever validation accepts, the transform computes: no NaN/inf, so no batch ever fails on it."""
    logits = torch.tensor([[30.0, -30.0, 5.0, 0.0, 29.9]])
    presence = torch.tensor([[True, True, False, False, False]])
    probs = probs_from_logits(logits, SamplingBatch.from_params([params], "cpu"), presence)
    assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1.0) < 1e-5
    assert params.greedy == (params.temperature < 1e-5)


# ------------------------------------------------------------------------- through the engine


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", device="cpu", block_size=4, max_batch_size=4)


def test_seeded_generation_is_reproducible_across_calls(llm: LLM) -> None:
    prompt = "def foo(x):"
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234, ignore_eos=True)
    first = llm.generate(prompt, params)[0].token_ids
    torch.manual_seed(99)  # unrelated global RNG use in between
    second = llm.generate(prompt, params)[0].token_ids
    assert first == second and len(first) == 16
    other = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=4321,
                                                ignore_eos=True))[0].token_ids
    assert other != first


def test_seeded_generation_is_independent_of_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    alone = llm.generate(["import json"], seeded)[0].token_ids
    others = ["class A:\n    pass\n", "x", "The quick brown fox jumps over the lazy dog"]
    batch_params = [SamplingParams(max_tokens=9, temperature=0.7), seeded,
                    SamplingParams(max_tokens=20, temperature=1.0, seed=3), SamplingParams(max_tokens=5, temperature=0)]
    outputs = llm.generate([others[0], "import json", others[1], others[2]], batch_params)
    assert outputs[1].token_ids == alone
    # and in another position with different neighbours
    outputs = llm.generate(["import json", others[2]], [seeded, SamplingParams(max_tokens=3, temperature=1.5)])
    assert outputs[0].token_ids == alone


def test_greedy_tokens_is_torch_argmax_on_ties_nans_batches_and_views() -> None:
    """The NumPy route takes the same index as ``torch.argmax``: the first of tied maxima, the first
    NaN, every row of a batch, a strided view; other dtypes go through torch itself."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.randn(3, 5, 49152, generator=gen)
    wide[0, 0, 7] = wide[0, 0, 9] = wide[0, 0].max() + 1  # a tie: index 7
    wide[1, 2, 11] = wide[1, 2, 4] = float("nan")  # NaNs: the first, 4
    wide[2, 1] = float("-inf")  # all -inf: index 0
    cases = [wide, wide[:, 1], wide[..., ::3], wide.transpose(0, 1), wide.to(torch.bfloat16), torch.zeros(2, 1)]
    for logits in cases:
        got = greedy_tokens(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(dim=-1)), logits.shape
    assert int(greedy_tokens(wide)[0, 0]) == 7 and int(greedy_tokens(wide)[1, 2]) == 4
