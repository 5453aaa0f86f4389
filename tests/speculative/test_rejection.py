"""Tests for the batched lossless rejection sampler.

The statistical tests run thousands of independent trials as rows of one batch using the global
RNG under a fixed seed (inside ``fork_rng`` so other tests are unaffected), which keeps them both
fast and deterministic.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from scipy.stats import chisquare

from infer.sampling.sampler import sample_from_probs
from infer.speculative.verification import Verdict, VerificationResult, greedy_verdict, verify_drafts

P_THRESHOLD = 1e-3
V = 4
# Target and draft first-position distributions that disagree a lot, so mistakes are visible.
P1 = torch.tensor([0.10, 0.40, 0.30, 0.20])
Q1 = torch.tensor([0.40, 0.10, 0.25, 0.25])
UNIFORM = torch.full((V,), 1.0 / V)

# Signature shared by verify_drafts and the deliberately wrong sampler of the negative control.
Sampler = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor | None,
        torch.Tensor,
        list[torch.Generator | None],
    ],
    VerificationResult,
]


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Fixed global RNG for the block without leaking state into other tests."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        yield


def chisq_pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value of integer ``samples`` against ``probs`` (any shape)."""
    flat = probs.double().flatten()
    counts = torch.bincount(samples.flatten(), minlength=flat.numel()).double()
    support = flat > 0
    if counts[~support].sum() > 0:
        return 0.0  # an impossible outcome happened
    expected = flat[support] / flat[support].sum() * counts.sum()
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def no_generators(batch: int) -> list[torch.Generator | None]:
    return [None] * batch


def verify_one_draft(drafts: torch.Tensor, draft_probs: torch.Tensor | None, sampler: Sampler = verify_drafts,
                     generators: list[torch.Generator | None] | None = None,
                     first: torch.Tensor = P1) -> VerificationResult:
    """One sampled (non-greedy) draft per row of ``drafts`` [n, 1] against target ``first``, then UNIFORM."""
    n = drafts.shape[0]
    target = torch.stack([first, UNIFORM]).expand(n, 2, V)
    return sampler(drafts, torch.ones(n, dtype=torch.long), target, draft_probs, torch.zeros(n, dtype=torch.bool),
                   no_generators(n) if generators is None else generators)


# --------------------------------------------------------------------------- (a) greedy rows


def test_greedy_match_mismatch_and_bonus() -> None:
    k = 3
    # Per-row argmax sequences of p_1..p_4, built from one-hot-ish (but soft) distributions.
    argmaxes = [[1, 2, 3, 0], [1, 2, 3, 0], [1, 2, 3, 0], [1, 2, 3, 0]]
    target = torch.full((4, k + 1, V), 0.1)
    for b, row in enumerate(argmaxes):
        for i, tok in enumerate(row):
            target[b, i, tok] = 0.7
    drafts = torch.tensor(
        [
            [1, 2, 0],  # mismatch at position 3
            [1, 2, 3],  # all accepted -> bonus argmax p_4
            [0, 2, 3],  # immediate mismatch
            [1, 0, 0],  # one real draft, rest is padding that must be ignored
        ]
    )
    num_draft = torch.tensor([3, 3, 3, 1])
    # q strongly favours the drafts; greedy rows must ignore it.
    q = torch.full((4, k, V), 0.01)
    q.scatter_(2, drafts.unsqueeze(2), 0.97)
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    states = [g.get_state() for g in gens]

    for draft_probs in (q, None):
        res = verify_drafts(drafts, num_draft, target, draft_probs, torch.ones(4, dtype=torch.bool), gens)
        assert res.num_accepted.tolist() == [2, 3, 0, 1]
        assert res.output_tokens.tolist() == [
            [1, 2, 3, -1],
            [1, 2, 3, 0],
            [1, -1, -1, -1],
            [1, 2, -1, -1],
        ]
        assert res.tokens_for(1) == [1, 2, 3, 0]
        assert res.tokens_for(2) == [1]
    # Greedy rows consume no randomness.
    for g, state in zip(gens, states, strict=True):
        assert torch.equal(g.get_state(), state)


def test_greedy_verdict_matches_verify_drafts_on_greedy_rows() -> None:
    # The runner's all-greedy path compares drafts with the target's argmax only; it must give what
    # verify_drafts gives greedy rows: same accepted counts, same emitted tokens, every case (all
    # accepted and a bonus, a rejection at each position, fewer drafts than K, no drafts), whether the
    # chain is given as a chain (parents None) or as the tree whose node i has parent i - 1.
    gen = torch.Generator().manual_seed(3)
    batch, k, vocab = 64, 4, 7
    target_probs = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen), dim=-1)
    argmax = target_probs.argmax(dim=-1)
    drafts = argmax[:, :k].clone()
    reject_at = torch.randint(0, k + 1, (batch,), generator=gen)  # k: nothing rejected
    for b in range(batch):
        if reject_at[b] < k:
            drafts[b, reject_at[b]] = (argmax[b, reject_at[b]] + 1) % vocab
    num_draft = torch.randint(0, k + 1, (batch,), generator=gen)
    expected = Verdict.of_chain(*verify_drafts(drafts, num_draft, target_probs, None,
                                               torch.ones(batch, dtype=torch.bool), [None] * batch).to_host())
    # host lists, ragged: row b's drafts and its num_draft[b] + 1 argmax tokens only
    counts = num_draft.tolist()
    nodes = [drafts[b, :n].tolist() for b, n in enumerate(counts)]
    choices = [argmax[b, : n + 1].tolist() for b, n in enumerate(counts)]
    for parents in (None, [list(range(-1, n - 1)) for n in counts]):
        got = greedy_verdict(nodes, counts, parents, choices)
        assert (got.paths, got.tokens, got.last_rows) == (expected.paths, expected.tokens, expected.last_rows)
    assert set(expected.num_accepted) == set(range(k + 1))  # every outcome was exercised
    with pytest.raises(ValueError, match="needs 2 draft tokens and 3 target tokens"):
        greedy_verdict([[1, 2]], [2], None, [[1, 2]])
    with pytest.raises(ValueError, match="one row per request"):
        greedy_verdict([[1]], [1, 1], None, [[1, 2]])


def test_greedy_rejects_likely_but_non_argmax_draft() -> None:
    # p(t) = 0.45 would often be accepted by sampling, but greedy needs an exact argmax match.
    target = torch.tensor([[[0.45, 0.55, 0.0], [1.0, 0.0, 0.0]]])
    res = verify_drafts(
        torch.tensor([[0]]), torch.tensor([1]), target, None, torch.tensor([True]), no_generators(1)
    )
    assert res.num_accepted.tolist() == [0]
    assert res.tokens_for(0) == [1]


# --------------------------------------------------------------------------- (b) acceptance rate


@pytest.mark.parametrize("one_hot", [False, True])
def test_single_draft_acceptance_probability(one_hot: bool) -> None:
    trials = 20_000
    n = trials * V
    drafts = (torch.arange(n) % V).unsqueeze(1)  # every token is tried `trials` times
    draft_probs = None if one_hot else Q1.expand(n, 1, V)
    with seeded(0):
        res = verify_one_draft(drafts, draft_probs)
    accepted = res.num_accepted.view(trials, V).double().mean(0)
    q = torch.ones(V) if one_hot else Q1
    expected = torch.clamp(P1 / q, max=1.0).double()
    std = (expected * (1 - expected) / trials).sqrt()
    assert torch.all((accepted - expected).abs() <= 5 * std + 1e-12), (accepted, expected)


# --------------------------------------------------------------------------- (c) + (h) first token


def wrong_sampler(draft_tokens: torch.Tensor, num_draft: torch.Tensor, target_probs: torch.Tensor,
                  draft_probs: torch.Tensor | None, greedy: torch.Tensor,
                  generators: list[torch.Generator | None]) -> VerificationResult:
    """Single-draft sampler with the classic bug: the correction is drawn from p, not the residual."""
    assert draft_tokens.shape[1] == 1 and not bool(greedy.any())
    t = draft_tokens[:, 0]
    p = target_probs[:, 0]
    p_t = p.gather(1, t[:, None]).squeeze(1)
    q_t = torch.ones_like(p_t) if draft_probs is None else draft_probs[:, 0].gather(1, t[:, None]).squeeze(1)
    accept = (torch.rand(t.shape) * q_t < p_t) & (num_draft > 0)
    correction = torch.multinomial(p, 1).squeeze(1)
    bonus = torch.multinomial(target_probs[:, 1], 1).squeeze(1)
    first = torch.where(accept, t, correction)
    second = torch.where(accept, bonus, torch.full_like(bonus, -1))
    return VerificationResult(num_accepted=accept.long(), output_tokens=torch.stack([first, second], 1))


def first_token_trial(
    sampler: Sampler, one_hot: bool, seed: int, n: int = 40_000
) -> tuple[torch.Tensor, VerificationResult]:
    """One draft per row from Q1 (or a fixed one-hot proposal) against target P1."""
    with seeded(seed):
        if one_hot:
            drafts = torch.full((n, 1), 2)  # a deterministic proposal, as an n-gram drafter would make
            draft_probs = None
        else:
            drafts = torch.multinomial(Q1.expand(n, V), 1)
            draft_probs = Q1.expand(n, 1, V)
        res = verify_one_draft(drafts, draft_probs, sampler)
    return drafts[:, 0], res


@pytest.mark.parametrize("one_hot", [False, True])
def test_first_token_distribution_equals_target(one_hot: bool) -> None:
    drafts, res = first_token_trial(verify_drafts, one_hot, seed=1)
    first = res.output_tokens[:, 0]
    accepted = res.num_accepted == 1
    # Accepted rows emit their draft; a correction never repeats the rejected draft.
    assert torch.equal(first[accepted], drafts[accepted])
    assert bool((first[~accepted] != drafts[~accepted]).all())
    assert bool((res.output_tokens[~accepted, 1] == -1).all())
    assert chisq_pvalue(first, P1) > P_THRESHOLD


@pytest.mark.parametrize("one_hot", [False, True])
def test_negative_control_wrong_sampler_is_detected(one_hot: bool) -> None:
    # Same harness, same seed, only the sampler differs: the check above has real power.
    _, res = first_token_trial(wrong_sampler, one_hot, seed=1)
    assert chisq_pvalue(res.output_tokens[:, 0], P1) < P_THRESHOLD


def test_every_fixed_one_hot_proposal_gives_target_distribution() -> None:
    # A deterministic proposal is exactly "drafted from q = one_hot(t)", so for every t (including
    # p(t) = 0) the output must be p. (With a full q the draft must really be sampled from q.)
    p = torch.tensor([0.5, 0.0, 0.3, 0.2])
    n = 20_000
    for tok in range(V):
        with seeded(10 + tok):
            res = verify_one_draft(torch.full((n, 1), tok), None, first=p)
        assert chisq_pvalue(res.output_tokens[:, 0], p) > P_THRESHOLD, tok


def test_per_row_generators_statistically_correct() -> None:
    # Same check through the per-row generator path (smaller n: that path loops over rows).
    n = 4_000
    gens: list[torch.Generator | None] = [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    draft_gen = torch.Generator().manual_seed(7)
    drafts = torch.multinomial(Q1.expand(n, V), 1, generator=draft_gen)
    res = verify_one_draft(drafts, Q1.expand(n, 1, V), generators=gens)
    assert chisq_pvalue(res.output_tokens[:, 0], P1) > P_THRESHOLD


# --------------------------------------------------------------------------- (d) two positions


@pytest.mark.parametrize("one_hot", [False, True])
def test_joint_distribution_of_two_tokens(one_hot: bool) -> None:
    v = 3
    n = 60_000
    p1 = torch.tensor([0.2, 0.5, 0.3])
    p2 = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.3, 0.4, 0.3]])  # p2[x1] = p(x2 | x1)
    q1 = torch.tensor([0.5, 0.2, 0.3])
    q2 = torch.tensor([[0.2, 0.2, 0.6], [0.4, 0.4, 0.2], [0.3, 0.4, 0.3]])
    uniform = torch.full((v,), 1.0 / v)
    greedy = torch.zeros(n, dtype=torch.bool)

    with seeded(3):
        # Round 1: draft two tokens; the second draft and p_2 are conditioned on the drafted x1.
        if one_hot:
            x1 = torch.zeros(n, dtype=torch.long)
            x2 = (x1 + 1) % v  # a deterministic drafter that depends on its context
            draft_probs = None
        else:
            x1 = torch.multinomial(q1.expand(n, v), 1).squeeze(1)
            x2 = torch.multinomial(q2[x1], 1).squeeze(1)
            draft_probs = torch.stack([q1.expand(n, v), q2[x1]], 1)
        target = torch.stack([p1.expand(n, v), p2[x1], uniform.expand(n, v)], 1)
        res = verify_drafts(
            torch.stack([x1, x2], 1), torch.full((n,), 2), target, draft_probs, greedy, no_generators(n)
        )
        y1 = res.output_tokens[:, 0]
        y2 = res.output_tokens[:, 1].clone()

        # Rows that rejected x1 emitted one token; their second token comes from the next round.
        again = res.num_accepted == 0
        m = int(again.sum())
        z1 = y1[again]
        if one_hot:
            z = ((z1 + 1) % v).unsqueeze(1)
            draft_probs2 = None
        else:
            z = torch.multinomial(q2[z1], 1)
            draft_probs2 = q2[z1].unsqueeze(1)
        res2 = verify_drafts(
            z,
            torch.ones(m, dtype=torch.long),
            torch.stack([p2[z1], uniform.expand(m, v)], 1),
            draft_probs2,
            torch.zeros(m, dtype=torch.bool),
            no_generators(m),
        )
        y2[again] = res2.output_tokens[:, 0]

    assert 0 < m < n  # both paths were exercised
    joint = p1[:, None] * p2  # joint[x1, x2]
    assert chisq_pvalue(y1 * v + y2, joint) > P_THRESHOLD


# --------------------------------------------------------------------------- (e) residual fallback


def test_zero_residual_falls_back_to_target() -> None:
    n = 20_000
    p = torch.tensor([0.5, 0.5, 0.0, 0.0])
    # p == q and the draft has zero probability: rejection is certain and max(0, p - q) == 0.
    with seeded(4):
        res = verify_drafts(
            torch.full((n, 1), 2),
            torch.ones(n, dtype=torch.long),
            torch.stack([p, UNIFORM]).expand(n, 2, V),
            p.expand(n, 1, V),
            torch.zeros(n, dtype=torch.bool),
            no_generators(n),
        )
    assert res.num_accepted.sum() == 0
    assert chisq_pvalue(res.output_tokens[:, 0], p) > P_THRESHOLD


def test_nearly_equal_p_and_q_stay_finite() -> None:
    gen = torch.Generator().manual_seed(5)
    n, k, v = 512, 4, 50
    logits = torch.randn(n, k + 1, v, generator=gen)
    target = logits.softmax(-1)
    draft = (logits[:, :k] + 1e-7).softmax(-1)  # equal up to rounding
    drafts = torch.multinomial(draft.reshape(-1, v), 1, generator=gen).view(n, k)
    with seeded(5):
        res = verify_drafts(
            drafts, torch.full((n,), k), target, draft, torch.zeros(n, dtype=torch.bool), no_generators(n)
        )
    emitted = res.output_tokens[torch.arange(n), res.num_accepted]
    assert bool(((emitted >= 0) & (emitted < v)).all())
    assert res.num_accepted.float().mean() > 3.9  # p == q: essentially everything is accepted


# --------------------------------------------------------------------------- (f) num_draft = 0


def test_zero_drafts_is_plain_sampling() -> None:
    n, k = 40_000, 2
    target = torch.stack([P1, UNIFORM, UNIFORM]).expand(n, k + 1, V)
    # Padding ids are arbitrary (even out of range) and must be ignored.
    drafts = torch.full((n, k), -1)
    with seeded(6):
        res = verify_drafts(
            drafts,
            torch.zeros(n, dtype=torch.long),
            target,
            Q1.expand(n, k, V),
            torch.zeros(n, dtype=torch.bool),
            no_generators(n),
        )
    assert res.num_accepted.sum() == 0
    assert bool((res.output_tokens[:, 1:] == -1).all())
    assert chisq_pvalue(res.output_tokens[:, 0], P1) > P_THRESHOLD
    # Greedy with no drafts is plain argmax.
    greedy = verify_drafts(
        drafts[:2],
        torch.zeros(2, dtype=torch.long),
        target[:2],
        None,
        torch.ones(2, dtype=torch.bool),
        no_generators(2),
    )
    assert greedy.output_tokens.tolist() == [[1, -1, -1], [1, -1, -1]]


def test_k_zero_batch() -> None:
    n = 3
    target = P1.expand(n, 1, V)
    res = verify_drafts(
        torch.zeros(n, 0, dtype=torch.long),
        torch.zeros(n, dtype=torch.long),
        target,
        torch.zeros(n, 0, V),
        torch.tensor([True, False, False]),
        [None, torch.Generator().manual_seed(0), None],
    )
    assert res.num_accepted.tolist() == [0, 0, 0]
    assert res.output_tokens.shape == (n, 1)
    assert res.output_tokens[0, 0] == 1


# --------------------------------------------------------------------------- (g) mixed batch


def one_hot_dist(tok: int, v: int = V) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(tok), v).float()


def test_mixed_batch_deterministic_outcomes() -> None:
    half = torch.tensor([0.5, 0.5, 0.0, 0.0])
    rows = [
        # (drafts, num_draft, greedy, p_1..p_4, q_1..q_3, expected output)
        # Sampled, p == q on the drafts (accept is certain), bonus p_4 is one-hot at 3.
        ([0, 1, 2], 3, False, [P1, P1, P1, one_hot_dist(3)], [P1, P1, P1], [0, 1, 2, 3]),
        # Sampled, first accepted for sure, second has p(t) = 0; residual max(0, p - q) = [0.5, 0, 0, 0].
        (
            [1, 2, 0],
            2,
            False,
            [P1, half, P1, P1],
            [P1, torch.tensor([0.0, 0.5, 0.5, 0.0]), P1],
            [1, 0, -1, -1],
        ),
        # Greedy, one matching draft, bonus is argmax p_2.
        ([2, 0, 0], 1, True, [one_hot_dist(2), P1, P1, P1], [Q1, Q1, Q1], [2, 1, -1, -1]),
        # Sampled plain decode step from a one-hot p_1.
        ([0, 0, 0], 0, False, [one_hot_dist(2), P1, P1, P1], [Q1, Q1, Q1], [2, -1, -1, -1]),
        # Greedy, immediate mismatch.
        ([0, 1, 2], 3, True, [P1, P1, P1, P1], [Q1, Q1, Q1], [1, -1, -1, -1]),
    ]
    drafts = torch.tensor([r[0] for r in rows])
    num_draft = torch.tensor([r[1] for r in rows])
    greedy = torch.tensor([r[2] for r in rows])
    target = torch.stack([torch.stack(r[3]) for r in rows])
    draft_probs = torch.stack([torch.stack(r[4]) for r in rows])
    gens: list[torch.Generator | None] = [torch.Generator().manual_seed(i) for i in range(len(rows))]
    gens[3] = None  # mixing own and global generators in one batch
    res = verify_drafts(drafts, num_draft, target, draft_probs, greedy, gens)
    assert res.output_tokens.tolist() == [r[5] for r in rows]
    assert res.num_accepted.tolist() == [3, 1, 1, 0, 0]
    assert res.output_tokens.dtype == torch.long and res.num_accepted.dtype == torch.long
    assert [len(res.tokens_for(b)) for b in range(len(rows))] == [4, 2, 2, 1, 1]


def test_rows_reproducible_regardless_of_batch_composition() -> None:
    gen = torch.Generator().manual_seed(8)
    b, k, v = 6, 5, 7
    target = torch.rand(b, k + 1, v, generator=gen).softmax(-1)
    draft = torch.rand(b, k, v, generator=gen).softmax(-1)
    drafts = torch.multinomial(draft.reshape(-1, v), 1, generator=gen).view(b, k)
    num_draft = torch.tensor([5, 0, 3, 5, 1, 2])
    greedy = torch.tensor([False, False, True, False, False, False])

    def run(rows: list[int], seeds: dict[int, int]) -> VerificationResult:
        gens: list[torch.Generator | None] = [torch.Generator().manual_seed(seeds[r]) for r in rows]
        return verify_drafts(drafts[rows], num_draft[rows], target[rows], draft[rows], greedy[rows], gens)

    seeds = {r: 100 + r for r in range(b)}
    together = run(list(range(b)), seeds)
    for r in range(b):
        # Alone the row sees K = its own padding width; it must still produce the same tokens.
        kr = max(int(num_draft[r]), 1)
        alone = verify_drafts(
            drafts[r : r + 1, :kr],
            num_draft[r : r + 1],
            target[r : r + 1, : kr + 1],
            draft[r : r + 1, :kr],
            greedy[r : r + 1],
            [torch.Generator().manual_seed(seeds[r])],
        )
        assert alone.tokens_for(0) == together.tokens_for(r)
    assert run(list(range(b)), seeds).output_tokens.tolist() == together.output_tokens.tolist()


# --------------------------------------------------------------------------- sample_from_probs


def test_sample_from_probs_distribution_and_generators() -> None:
    n = 40_000
    with seeded(9):
        samples = sample_from_probs(P1.expand(n, V), no_generators(n))
    assert samples.shape == (n,) and samples.dtype == torch.long
    assert chisq_pvalue(samples, P1) > P_THRESHOLD

    probs = torch.stack([P1, Q1, one_hot_dist(3), UNIFORM * 7])  # unnormalised weights are fine

    def draw() -> list[int]:
        gens = [torch.Generator().manual_seed(1), None, torch.Generator().manual_seed(2), None]
        return sample_from_probs(probs, gens).tolist()

    first, second = draw(), draw()
    assert first[0] == second[0] and first[2] == second[2] == 3


def test_input_validation() -> None:
    d = torch.zeros(2, 3, dtype=torch.long)
    nd = torch.ones(2, dtype=torch.long)
    tp = torch.full((2, 4, V), 0.25)
    g = torch.zeros(2, dtype=torch.bool)
    gens = no_generators(2)
    with pytest.raises(ValueError, match="target_probs"):
        verify_drafts(d, nd, tp[:, :3], None, g, gens)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_drafts(d, nd, tp, tp, g, gens)
    with pytest.raises(ValueError, match="num_draft"):
        verify_drafts(d, torch.tensor([1, 4]), tp, None, g, gens)
    with pytest.raises(ValueError, match="generators"):
        verify_drafts(d, nd, tp, None, g, gens[:1])
    with pytest.raises(ValueError, match="probs"):
        sample_from_probs(torch.ones(V), [None])


# --------------------------------------------------------------------------- device


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_runs_on_cuda() -> None:
    dev = torch.device("cuda")
    n, k = 20_000, 1
    with seeded(11):
        drafts = torch.multinomial(Q1.to(dev).expand(n, V), 1)
        gens: list[torch.Generator | None] = no_generators(n)
        gens[0] = torch.Generator(device=dev).manual_seed(0)
        res = verify_drafts(
            drafts,
            torch.ones(n, dtype=torch.long, device=dev),
            torch.stack([P1, UNIFORM]).to(dev).expand(n, 2, V),
            Q1.to(dev).expand(n, k, V),
            torch.zeros(n, dtype=torch.bool, device=dev),
            gens,
        )
    assert res.output_tokens.device.type == "cuda"
    assert chisq_pvalue(res.output_tokens[:, 0].cpu(), P1) > P_THRESHOLD
