"""Rejection sampling that waits for the device once per round (``verification.verify_drafts`` given
host lists, then ``VerificationResult.to_host``).

* the final token is drawn as plain sampling draws it (``sample_from_probs``: the same uniform from
  the same source, the same token), without a host read;
* with host lists, a round reads the device once: counted on CPU by patching every ``Tensor``
  method that returns a host value, through the runner of a live engine too; on CUDA,
  ``torch.cuda.set_sync_debug_mode`` refuses any synchronising call (``pytest -m cuda``);
* sampled output is distributed exactly as the target (chi-square with fixed seeds, per-row
  generators as unseeded requests have, greedy rows mixed in), and a misreported q fails the same test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from infer import LLM, SamplingParams
from infer.sampling.sampler import KeyedDraw, RandomSource, sample_from_probs
from infer.speculative import verification as rejection
from infer.speculative.verification import VerificationResult, verify_drafts

P_THRESHOLD = 1e-3
# Tensor methods that hand a value to the host (each waits for the device where it is not the CPU).
HOST_READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextmanager
def counting_host_reads(counts: dict[str, int], active: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """Count calls of ``HOST_READS`` on tensors (while ``active()``) in ``counts``."""
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def counted(name: str) -> Callable[..., Any]:
        real = originals[name]

        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if active():
                counts[name] = counts.get(name, 0) + 1
            return real(self, *args, **kwargs)
        return method

    for name in HOST_READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield
    finally:
        for name, real in originals.items():
            setattr(torch.Tensor, name, real)


def batch_of(kinds: list[str], k: int, vocab: int, device: str = "cpu", seed: int = 0,
             with_q: bool = True) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor | None, list[bool],
                                           list[RandomSource]]:
    """Random drafts, counts and distributions; row b is greedy, shared (global RNG), own (its generator)
    or keyed (a seeded request)."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(kinds)
    p = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen) * 2, -1)
    q = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 2, -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=gen).view(batch, k)
    num = torch.randint(0, k + 1, (batch,), generator=gen).tolist()
    sources: list[RandomSource] = [
        None if kind in ("greedy", "shared") else KeyedDraw(seed, b) if kind == "keyed"
        else torch.Generator(device=device).manual_seed(seed * 1000 + b) for b, kind in enumerate(kinds)]
    return (drafts.to(device), num, p.to(device), q.to(device) if with_q else None,
            [kind == "greedy" for kind in kinds], sources)


MIXED = ["greedy", "shared", "own", "keyed", "own", "shared", "greedy", "keyed"]


def test_final_draw_is_plain_samplings_draw() -> None:
    """Same sources in the same state, same tokens as ``sample_from_probs`` (a plain decode step's
    draw): rows with their own generators, keyed rows, and rows drawn together from the global RNG;
    a distribution no sampler can draw from is flagged, not drawn silently."""
    dist = torch.softmax(torch.randn(6, 37, generator=torch.Generator().manual_seed(1)) * 3, -1)

    def sources() -> list[RandomSource]:
        own = [torch.Generator().manual_seed(50 + b) for b in range(6)]
        return [own[0], None, own[2], KeyedDraw(4, 9), None, own[5]]

    with torch.random.fork_rng():
        torch.manual_seed(9)
        drawn = rejection._draw_final(dist, list(range(6)), sources())
        torch.manual_seed(9)
        want = sample_from_probs(dist, sources()).tolist()
    assert [int(drawn[b][0]) for b in range(6)] == want
    assert not any(bool(bad) for _, bad in drawn.values())
    # The draws depend on the sources: other seeds give other tokens somewhere.
    other = [torch.Generator().manual_seed(70 + b) for b in range(6)]
    assert [int(t) for t, _ in rejection._draw_final(dist, list(range(6)), other).values()] != want
    broken = dist.clone()
    broken[2, 3] = float("nan")
    assert [bool(bad) for _, bad in rejection._draw_final(broken, [0, 2], sources()).values()] == [False, True]


@pytest.mark.parametrize("with_q", [True, False])
def test_one_host_read_per_round(with_q: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy, global-RNG, own-generator and keyed rows in one batch: verifying reads nothing back,
    ``to_host`` reads once. (Keyed rows take the path that needs no host read, as off the CPU.)"""
    monkeypatch.setattr(rejection, "host_reads_are_free", lambda device: False)
    drafts, num, p, q, greedy, sources = batch_of(MIXED, 4, 23, with_q=with_q)
    counts: dict[str, int] = {}
    with counting_host_reads(counts):
        verdict = verify_drafts(drafts, num, p, q, greedy, sources)
        assert counts == {}
        accepted, emitted = verdict.to_host()
    assert counts == {"tolist": 1}
    assert [len(row) for row in emitted] == [n + 1 for n in accepted]
    assert all(0 <= a <= n for a, n in zip(accepted, num, strict=True))
    # The counter sees reads: counts and flags given as tensors are read back.
    counts.clear()
    with counting_host_reads(counts):
        verify_drafts(drafts, torch.tensor(num), p, q, torch.tensor(greedy), sources)
    assert counts.get("tolist", 0) >= 2


def verdict_of(seed: int, lists: bool) -> tuple[list[int], list[list[int]]]:
    """A mixed batch's verdict from fresh generators and a fixed global RNG."""
    drafts, num, p, q, greedy, sources = batch_of(MIXED, 3, 11, seed=seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if lists:
            return verify_drafts(drafts, num, p, q, greedy, sources).to_host()
        return verify_drafts(drafts, torch.tensor(num), p, q, torch.tensor(greedy), sources).to_host()


def test_both_keyed_paths_and_host_lists_give_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Keyed rows stopping at their first mismatch (the CPU) and drawing every position at once (off
    the CPU) emit the same tokens; host lists and tensors give the same verdict."""
    for seed in range(6):
        lazy = verdict_of(seed, lists=True)
        assert verdict_of(seed, lists=False) == lazy
        monkeypatch.setattr(rejection, "host_reads_are_free", lambda device: False)
        assert verdict_of(seed, lists=True) == lazy
        monkeypatch.undo()


def test_a_bad_distribution_is_refused_on_the_host_read() -> None:
    drafts, num, p, q, greedy, sources = batch_of(["own", "shared"], 2, 5)
    p[1, :, 0] = float("nan")
    verdict = verify_drafts(drafts, num, p, q, greedy, sources)
    with pytest.raises(RuntimeError, match="inf, nan or a negative"):
        verdict.to_host()


# --------------------------------------------------------------------------- distribution

V = 4
P1 = torch.tensor([0.10, 0.40, 0.30, 0.20])
P2 = torch.tensor([0.25, 0.25, 0.25, 0.25])
Q1 = torch.tensor([0.40, 0.10, 0.25, 0.25])


def first_tokens(q_given: torch.Tensor, n: int = 6000, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows drafting two tokens from Q1 (each with its own generator, as unseeded requests), every
    fourth row greedy; the verifier is handed ``q_given`` as the drafts' distribution. Returns the
    sampled rows' first emitted tokens and the greedy rows'."""
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(Q1.expand(2 * n, V), 1, generator=gen).view(n, 2)
    target = torch.stack([P1, P2, P2]).expand(n, 3, V)
    greedy = [b % 4 == 0 for b in range(n)]
    sources: list[RandomSource] = [torch.Generator().manual_seed(seed * 100_000 + b) for b in range(n)]
    _, emitted = verify_drafts(drafts, [2] * n, target, q_given.expand(n, 2, V), greedy, sources).to_host()
    first = torch.tensor([row[0] for row in emitted])
    mask = torch.tensor(greedy)
    return first[~mask], first[mask]


def pvalue(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness-of-fit p-value (every cell possible), as the chi-square survival function
    Q(dof / 2, statistic / 2), so that the GPU image needs no scipy."""
    counts = torch.bincount(samples.cpu(), minlength=V).double()
    expected = probs.double() / probs.double().sum() * counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    return float(torch.special.gammaincc(torch.tensor((V - 1) / 2, dtype=torch.float64), statistic / 2))


def test_sampled_rows_follow_the_target_and_greedy_rows_its_argmax() -> None:
    sampled, greedy = first_tokens(Q1)
    assert pvalue(sampled, P1) > P_THRESHOLD
    assert bool((greedy == int(P1.argmax())).all())


def test_negative_control_misreported_q_is_detected() -> None:
    """Same harness and seeds, the verifier handed a flatter q than the drafts came from."""
    flat = Q1.sqrt() / Q1.sqrt().sum()
    sampled, _ = first_tokens(flat)
    assert pvalue(sampled, P1) < P_THRESHOLD


# --------------------------------------------------------------------------- through the runner


@pytest.fixture(scope="module")
def draft_engine(small_target: Path, small_draft: Path) -> LLM:
    return LLM(str(small_target), draft_model=str(small_draft), dtype="float32", device="cpu", spec_length=3,
               spec_length_policy="fixed", max_seq_len=32)  # type: ignore[arg-type]


def test_runner_reads_the_verdict_once_per_round(draft_engine: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unseeded sampled requests through the speculative runner: verify_drafts reads nothing back and
    each round's verdict comes back in one read."""
    from helpers import generate_unseeded  # here: helpers imports scipy, which the GPU image may lack

    inside = {"verify": False, "to_host": False}
    counts: dict[str, int] = {}
    rounds = {"verify": 0, "to_host": 0, "reads_in_to_host": 0}
    real_verify, real_to_host = rejection.verify_drafts, VerificationResult.to_host

    def verify(*args: Any) -> VerificationResult:
        rounds["verify"] += 1
        inside["verify"] = True
        try:
            return real_verify(*args)
        finally:
            inside["verify"] = False

    def to_host(self: VerificationResult) -> Any:
        rounds["to_host"] += 1
        before = sum(counts.values())
        inside["to_host"] = True
        try:
            return real_to_host(self)
        finally:
            inside["to_host"] = False
            rounds["reads_in_to_host"] += sum(counts.values()) - before

    monkeypatch.setattr(rejection, "verify_drafts", verify)
    monkeypatch.setattr(VerificationResult, "to_host", to_host)
    in_verify: dict[str, int] = {}
    with counting_host_reads(counts, lambda: inside["to_host"]), counting_host_reads(in_verify, lambda: inside["verify"]):
        outputs = generate_unseeded(draft_engine, ["a b c", "d e"], SamplingParams(temperature=1.0, max_tokens=12), 3)
    assert all(o.error is None and len(o.token_ids) > 0 for o in outputs)
    assert rounds["verify"] > 0 and rounds["to_host"] == rounds["verify"]
    assert rounds["reads_in_to_host"] == rounds["to_host"]  # one read each
    assert in_verify == {}


# --------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_q", [True, False])
def test_no_sync_before_the_read_on_cuda(with_q: bool) -> None:
    """On CUDA, verifying with host lists makes no synchronising call (the sync debug mode raises on
    one); the one read then gives valid verdicts."""
    drafts, num, p, q, greedy, sources = batch_of(MIXED * 4, 5, 1000, device="cuda", with_q=with_q)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        verdict = verify_drafts(drafts, num, p, q, greedy, sources)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    accepted, emitted = verdict.to_host()
    assert all(0 <= a <= n for a, n in zip(accepted, num, strict=True))
    assert [len(row) for row in emitted] == [a + 1 for a in accepted]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_verdicts_follow_the_target() -> None:
    """The chi-square check of the sampled rows, on the GPU's generators."""
    n = 6000
    gen = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(Q1.expand(2 * n, V), 1, generator=gen).view(n, 2).cuda()
    target = torch.stack([P1, P2, P2]).expand(n, 3, V).cuda()
    sources: list[RandomSource] = [torch.Generator(device="cuda").manual_seed(7 + b) for b in range(n)]
    _, emitted = verify_drafts(drafts, [2] * n, target, Q1.expand(n, 2, V).cuda(), [False] * n, sources).to_host()
    assert pvalue(torch.tensor([row[0] for row in emitted]), P1) > P_THRESHOLD
