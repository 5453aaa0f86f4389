"""Draft length and per-request control: long model-free drafts when a match is confident, the default
policy backing off where drafts do not pay, and a request turning speculation off or capping its drafts.
Every case is also checked to decode exactly as plain decoding does."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from infer import LLM, SamplingParams
from infer.core.request import Request
from infer.engine.config import MODEL_FREE_MAX_DRAFT, EngineConfig
from infer.speculative.budget import BudgetController, PassTimes
from infer.speculative.tree import tree_attention_mask
from infer.speculative.verification import greedy_verdict, verify_tree

# The tiny model's greedy output settles into a short cycle: n-gram lookup then copies it.
PROMPT = "one two three four five six seven eight nine ten " * 6
GREEDY = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)


def steady_costs(llm: LLM) -> None:
    """A fixed cost model instead of measured times (a shared CPU's noise must not decide the test):
    a target pass over n rows takes 1 ms + 20 µs·n, a drafter call 10 µs."""
    budget = llm.engine.runner.budget  # type: ignore[attr-defined]
    target, draft = budget.observe_target, budget.observe_draft_step
    budget.observe_target = lambda rows, _s: target(rows, 1e-3 + 2e-5 * rows)
    budget.observe_draft_step = lambda batch, _s: draft(batch, 1e-5)


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> list[int]:
    return LLM(str(tiny_llama), dtype="float32", device="cpu").generate([PROMPT], GREEDY)[0].token_ids


@pytest.mark.parametrize("speculator", ["ngram", "suffix"])
def test_default_policy_drafts_long_when_the_match_holds(tiny_llama: Path, plain: list[int], speculator: str) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator=speculator, suffix_scope="request")
    steady_costs(llm)
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == plain
    m = out.metrics
    # A round drafted (and verification judged) 32 positions, and long runs were accepted.
    assert len(m.proposed_per_position) == MODEL_FREE_MAX_DRAFT, m.proposed_per_position
    assert m.accepted_per_position[3 * MODEL_FREE_MAX_DRAFT // 4 - 1] > 0  # 24 drafts of a round kept


def test_defaults() -> None:
    ngram = EngineConfig.from_options(model="m", speculator="ngram").speculative
    draft = EngineConfig.from_options(model="m", draft_model="d", spec_length=4).speculative
    fixed = EngineConfig.from_options(model="m", speculator="ngram", spec_length_policy="fixed").speculative
    assert ngram is not None and draft is not None and fixed is not None
    assert ngram.spec_length_policy == draft.spec_length_policy == "goodput"
    assert ngram.spec_length_limit == MODEL_FREE_MAX_DRAFT and draft.spec_length_limit == 8
    assert fixed.spec_length_limit == fixed.spec_length


def fake(rid: str, draft_room: int = 1 << 30) -> Request:
    return SimpleNamespace(request_id=rid, draft_room=draft_room)  # type: ignore[return-value]


def test_goodput_backs_off_a_request_within_a_few_rounds() -> None:
    """A request whose drafts fail stops drafting after a few rounds (a verification row costing a
    fifteenth of a decode step, as on a small CPU model), while its batch mate copying a passage
    keeps long drafts; the failing one probes again later."""
    policy = BudgetController(32, adaptive=True, probe_every=4)
    bad, good = fake("bad"), fake("good")
    rounds = []
    for _ in range(8):
        k_bad, k_good = policy.chain_lengths([bad, good], per_row=1 / 15)
        rounds.append(k_bad)
        policy.update(bad, k_bad, 0)
        policy.update(good, k_good, k_good)
    assert rounds[0] > 0 and rounds.index(0) <= 4, rounds
    assert policy.chain_lengths([bad, good], per_row=1 / 15)[1] >= 24
    later = [policy.chain_lengths([bad, good], per_row=1 / 15)[0] for _ in range(8)]
    assert 2 in later  # a probe: its text may turn predictable


def test_goodput_learns_acceptance_per_match_class() -> None:
    """A drafter that classes its drafts (prompt lookup's matched length): acceptance is learned per
    class over every request, so a request drafts long the round its match turns long, while its
    short matches stay plain; a class never seen starts from the prior; release forgets the request."""
    policy = BudgetController(32, adaptive=True, probe_every=1 << 20, first_probe=1 << 20)
    per_row = 1 / 15
    for i in range(40):  # earlier requests: one-token matches fail, four-token matches hold
        request = fake(f"old{i}")
        for cls, holds in ((1, False), (4, True)):
            policy.budgets([request], [cls])  # (the round's class)
            policy.update(request, 4, 4 if holds else 0)
        policy.release(request)
    assert policy.class_alpha[1] < 0.1 and policy.class_alpha[4] > 0.9
    assert not any(isinstance(key, tuple) and str(key[0]).startswith("old") for key in policy.alpha)
    new = fake("new")
    lengths = []
    for cls in (1, 1, 4, 1):
        policy.budgets([new], [cls])
        lengths.append(policy.chain_lengths([new], per_row)[0])
    assert lengths[0] == lengths[1] == lengths[3] == 0 and lengths[2] >= 16, lengths
    # the same policy without classes goes by the request's own (here: the prior's) acceptance
    policy.budgets([new])
    assert policy.request_alpha(new) == policy.recent_alpha
    policy.budgets([new], [7])  # a class never seen: the prior
    assert policy.request_alpha(new) == policy.prior_alpha
    # Class 0 (the drafter found nothing to draft from) drafts nothing, not even a probe, where the
    # same request without classes probes within a few rounds.
    eager = BudgetController(32, adaptive=True, probe_every=1, first_probe=1)
    idle = fake("idle")
    eager.alpha["idle"] = 0.0
    assert not any(eager.budgets([idle], [0])[0] for _ in range(20))
    assert any(eager.budgets([idle])[0] for _ in range(4))


def test_goodput_learns_the_first_draft_apart_from_the_drafts_after_it() -> None:
    """Copying: the first draft after a match is mostly wrong, but once it is right the copy goes on.
    The policy learns the first draft's acceptance and the continuation's apart, so such a request
    drafts long (a 30% first draft whose copies then hold is worth 1.8 tokens for a 12-row chain),
    where one α for every draft (these rounds' accepted over judged drafts, about 0.77) would stop at
    a short chain; and a request whose drafts after the first always fail drafts just the one."""
    per_row = 0.05

    def lengths(holds_after_first: bool) -> tuple[float, float, int]:
        policy = BudgetController(32, adaptive=True, probe_every=1 << 20, first_probe=1 << 20)
        request = fake("r")
        for i in range(40):  # 3 of 10 rounds keep their first draft; then all 8, or none after it
            kept = (8 if holds_after_first else 1) if i % 10 in (2, 5, 8) else 0
            policy.update(request, 8, kept)
        first, cont = policy.request_alphas(request)
        return first, cont, policy.chain_lengths([request], per_row)[0]

    first, cont, k = lengths(holds_after_first=True)
    assert 0.15 < first < 0.5 and cont > 0.9 and k >= 12, (first, cont, k)
    geometric = BudgetController(32, adaptive=True, probe_every=1 << 20, first_probe=1 << 20)
    geometric.alpha["r"] = geometric.cont["r"] = 0.77  # the negative control: one α for every draft
    assert geometric.chain_lengths([fake("r")], per_row)[0] < k
    first, cont, k = lengths(holds_after_first=False)
    assert 0.15 < first < 0.5 and cont < 0.1 and k == 1, (first, cont, k)


def test_pass_times_by_row_count_interpolate_between_measured_counts() -> None:
    """A row count measured twice is its own mean; between measured counts a straight line; past
    the last, the fit's slope; a count measured once is not yet trusted."""
    times = PassTimes()
    for rows, ms in ((1, 3.0), (5, 4.0), (21, 12.0), (33, 15.0)):
        for _ in range(2):
            times.observe(rows, ms * 1e-3)
    times.observe(9, 1.0)  # once: an outlier must not price 9 rows
    assert times.predict(5) == pytest.approx(4e-3)
    assert times.predict(3) == pytest.approx(3.5e-3)
    assert times.predict(9) == pytest.approx(6e-3)
    slope = times.fit.coefficients()[1]
    assert times.predict(41) == pytest.approx(15e-3 + 8 * slope)


def test_goodput_prices_a_chain_by_the_passes_of_its_row_count() -> None:
    """Passes whose rows cost little up to 8 and much past it (a kernel's few-row tiles, say): the
    policy drafts a chain that fits the cheap rows, where one straight line through every pass (the
    negative control) prices a short chain too high and stays plain."""
    def chosen(by_row_count: bool) -> int:
        policy = BudgetController(32, adaptive=True, probe_every=1 << 20, first_probe=1 << 20)
        for _ in range(6):
            for rows in (1, 3, 6, 9, 17, 33):
                policy.observe_target(rows, 1e-3 * (1 + 0.04 * min(rows, 8) + 0.3 * max(rows - 8, 0)))
            policy.observe_draft_step(1, 1e-6)
        if not by_row_count:
            policy.passes.predict = policy.target.predict  # type: ignore[method-assign]
        policy.alpha["r"], policy.cont["r"] = 0.5, 0.8
        return policy.budgets([fake("r")])[0]

    assert 3 <= chosen(by_row_count=True) <= 7
    assert chosen(by_row_count=False) == 0


@pytest.mark.parametrize("speculator", ["ngram", "suffix", "suffix-salt"])
def test_model_free_drafters_class_a_round_by_its_matched_length(speculator: str) -> None:
    """A round's class is the length of the context that matched (0: nothing to draft from), for
    n-gram lookup and for suffix decoding over the request's own trie or its tenant's."""
    from infer.speculative.ngram import NgramDrafter
    from infer.speculative.suffix import LONG_MATCH, SuffixDrafter

    drafter: Any = (NgramDrafter() if speculator == "ngram" else
                    SuffixDrafter(max_depth=8, scope="salt" if speculator == "suffix-salt" else "request"))
    longest = 4 if speculator == "ngram" else LONG_MATCH

    def request(prompt: list[int], output: list[int]) -> Any:
        return SimpleNamespace(request_id=str(prompt + output), prompt_token_ids=prompt, output_token_ids=output,
                               cache_salt=None, is_finished=False, draft_room=64,
                               num_tokens=len(prompt) + len(output))

    text = list(range(100, 120))
    assert drafter.match_classes([request(text, [])]) == [0]  # nothing repeats: no match
    cases = [request(text + [200, 105], []), request(text, [300, 110, 111, 112]), request(text + [7] + text, [])]
    assert drafter.match_classes(cases) == [1, 3, longest]
    proposal = drafter.propose(cases, [4, 4, 4], None)
    assert proposal.tokens[1, 0].item() == 113  # the classed match is the one drafted from


def test_classed_rounds_probe_each_request_on_its_own_wait() -> None:
    """A request left at K = 0 probes on its own wait whether its round is classed or not: a wait
    shared by a class over every request (tried, with four times the wait) starved each request's
    own learning on code edits. Three requests taking turns each probe on their own."""
    def probes(classed: bool) -> int:
        policy = BudgetController(32, adaptive=True, probe_every=2, max_probe_every=2, first_probe=2)
        policy.class_alpha[1] = 0.0
        count = 0
        for i in range(12):
            request = fake(f"r{i % 3}")
            policy.alpha[request.request_id] = 0.0
            count += policy.budgets([request], [1] if classed else None)[0] > 0
        return count

    assert probes(classed=True) == probes(classed=False) == 6


def test_goodput_leaves_a_chain_near_break_even_plain() -> None:
    """A round whose best drafts promise less than min_gain over plain decoding drafts nothing (a
    one-token draft of α 0.25 with rows at a fifth of a step: 1.04x), one promising more drafts."""
    for min_gain, alpha, expected in ((0.05, 0.25, 0), (0.0, 0.25, 1), (0.05, 0.3, 1)):
        policy = BudgetController(8, adaptive=True, min_gain=min_gain, first_probe=1 << 20, probe_every=1 << 20)
        policy.alpha["r"] = alpha
        assert policy.chain_lengths([fake("r")], per_row=0.2) == [expected], (min_gain, alpha)


def test_goodput_respects_each_request_cap() -> None:
    policy = BudgetController(32, adaptive=True, probe_every=2)
    off, capped, free = fake("off", draft_room=0), fake("capped", draft_room=3), fake("free")
    for request in (off, capped, free):
        policy.alpha[request.request_id] = 0.99
    assert policy.chain_lengths([off, capped, free], per_row=0.01) == [0, 3, 32]
    # A request with speculation off is never probed either.
    policy.alpha["capped"] = policy.alpha["free"] = 0.0
    assert all(ks[0] == 0 for ks in (policy.chain_lengths([off, capped, free], per_row=0.5) for _ in range(10)))


@pytest.mark.parametrize("drafter", ["ngram", "suffix", "draft"])
def test_batch_mixing_speculation_on_and_off_is_exact(tiny_llama: Path, plain: list[int], drafter: str) -> None:
    options: dict[str, Any] = ({"draft_model": str(tiny_llama)} if drafter == "draft"
                               else {"speculator": drafter, "suffix_scope": "request"})
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", spec_length_policy="fixed", spec_length=6, **options)
    settings = [dict(speculate=False), dict(max_draft_tokens=2), {}, dict(speculate=False, max_draft_tokens=4)]
    params = [SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, **s) for s in settings]
    outs = llm.generate([PROMPT] * len(params), params)
    for out in outs:
        assert out.token_ids == plain[:64]
    off, capped, free, off_too = (o.metrics for o in outs)
    assert off.proposed_tokens == off_too.proposed_tokens == 0
    assert capped.proposed_tokens > 0 and len(capped.proposed_per_position) <= 2
    assert len(free.proposed_per_position) > 2


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_rounds_that_cannot_draft_skip_matching_and_the_budget(tiny_llama: Path, plain: list[int], drafter: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A round where every request turned speculation off never asks the drafter for a match, and one
    where the drafter matched nothing (class 0) never asks the budget: they cost a plain step. Rounds
    with a match still ask both (the negative control), and every output is plain decoding's."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator=drafter, suffix_scope="request")
    runner = llm.engine.runner  # type: ignore[attr-defined]
    calls = {"match": 0, "nothing matched": 0, "budget": 0}
    match, budgets = runner.drafter.match_classes, runner.budget.budgets

    def counted_match(requests: list[Request]) -> list[int]:
        classes = match(requests)
        calls["match"] += 1
        calls["nothing matched"] += not any(classes)
        return classes

    def counted_budgets(requests: list[Request], classes: list[int] | None = None) -> list[int]:
        calls["budget"] += 1
        return budgets(requests, classes)

    monkeypatch.setattr(runner.drafter, "match_classes", counted_match)
    monkeypatch.setattr(runner.budget, "budgets", counted_budgets)
    off = llm.generate([PROMPT], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, speculate=False))[0]
    assert off.token_ids == plain[:64] and calls == {"match": 0, "nothing matched": 0, "budget": 0}
    # Distinct prompt tokens: the first rounds find no earlier copy of their last token.
    fresh, params = list(range(10, 40)), SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    out = llm.generate([fresh], params)[0]
    assert out.token_ids == LLM(str(tiny_llama), dtype="float32", device="cpu").generate([fresh], params)[0].token_ids
    assert calls["nothing matched"] > 0 and calls["match"] > calls["nothing matched"]
    assert calls["budget"] == calls["match"] - calls["nothing matched"]


def test_chain_shaped_trees_are_verified_on_the_chain_path(tiny_llama: Path, plain: list[int],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Suffix decoding's trees are mostly chains: a round whose trees are all chains skips the tree
    path (its mask, positions and compaction), greedy or sampled, and gives the same tokens: plain
    decoding's when greedy, and when sampled with a seed the keyed draws' (plain sampling's)."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", speculator="suffix", suffix_scope="request")
    runner = llm.engine.runner  # type: ignore[attr-defined]
    shapes = {"chains": 0, "trees": 0, "tree path": 0}
    propose, tree_masks = runner.drafter.propose, runner.tree_masks

    def watched_propose(*args: Any) -> Any:
        proposal = propose(*args)
        if any(proposal.num_tokens):
            chains = all(proposal.parents[b, :n].tolist() == list(range(-1, n - 1))
                         for b, n in enumerate(proposal.num_tokens))
            shapes["chains" if chains else "trees"] += 1
        return proposal

    def watched_tree_masks(*args: Any) -> Any:  # the tree path's mask: made for trees only
        shapes["tree path"] += 1
        return tree_masks(*args)

    monkeypatch.setattr(runner.drafter, "propose", watched_propose)
    monkeypatch.setattr(runner, "tree_masks", watched_tree_masks)
    assert llm.generate([PROMPT], GREEDY)[0].token_ids == plain
    assert shapes["chains"] > 0 and shapes["tree path"] == shapes["trees"]
    shapes.update(chains=0, trees=0)
    shapes["tree path"] = 0
    sampled = SamplingParams(max_tokens=64, temperature=0.8, seed=1, ignore_eos=True)
    out = llm.generate([PROMPT], sampled)[0].token_ids
    assert out == LLM(str(tiny_llama), dtype="float32", device="cpu").generate([PROMPT], sampled)[0].token_ids
    assert shapes["chains"] > 0 and shapes["tree path"] == shapes["trees"]


def test_sampling_params_validate_speculation_fields() -> None:
    with pytest.raises(ValueError, match="max_draft_tokens"):
        SamplingParams(max_draft_tokens=0)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        SamplingParams(max_draft_tokens=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="speculate"):
        SamplingParams(speculate="no")  # type: ignore[arg-type]


def tensor_greedy_paths(tokens: torch.Tensor, counts: list[int], parents: torch.Tensor,
                        choices: torch.Tensor) -> list[list[int]]:
    """An independent formulation of the greedy tree verdict, on tensors: a node is good if it and
    every ancestor match the argmax at its parent; the path ends at the deepest good node (the first
    on a tie: ``max`` returns the first maximum)."""
    batch, n = tokens.shape
    mask = tree_attention_mask(parents, counts)
    valid = torch.arange(n).unsqueeze(0) < torch.tensor(counts).unsqueeze(1)
    parent_row = torch.where(valid, parents + 1, torch.zeros_like(parents))
    ok = (tokens == choices.gather(1, parent_row)) & valid
    among = mask[:, 1:, 1:]  # ancestor-or-self among nodes
    path_ok = ~(among & ~ok.unsqueeze(1)).any(dim=2) & ok
    score = torch.where(path_ok, among.sum(dim=2), torch.zeros(batch, n, dtype=torch.long))
    best_depth, best = score.max(dim=1) if n else (torch.zeros(batch, dtype=torch.long),) * 2
    paths = []
    for b in range(batch):
        path, node = [], int(best[b]) if int(best_depth[b]) > 0 else -1
        while node >= 0:
            path.append(node)
            node = int(parents[b, node])
        paths.append(path[::-1])
    return paths


def test_greedy_tree_walk_matches_the_tree_verifier() -> None:
    """The argmax-only greedy tree verdict (greedy_verdict) is an independent tensor formulation's and
    verify_tree's on one-hot target distributions, on random trees with small vocabularies (so
    siblings often share a token and ties between paths occur)."""
    gen = torch.Generator().manual_seed(0)
    depths = set()
    for _ in range(200):
        batch, width, vocab = 3, 7, 3
        counts = torch.randint(0, width + 1, (batch,), generator=gen).tolist()
        parents = torch.full((batch, width), -1, dtype=torch.long)
        for b in range(batch):
            for i in range(1, counts[b]):
                parents[b, i] = int(torch.randint(-1, i, (1,), generator=gen))
        tokens = torch.randint(0, vocab, (batch, width), generator=gen)
        choices = torch.randint(0, vocab, (batch, width + 1), generator=gen)
        probs = torch.zeros(batch, width + 1, vocab).scatter_(2, choices.unsqueeze(2), 1.0)
        expected = verify_tree(tokens, counts, parents, probs, torch.ones(batch, dtype=torch.bool), [None] * batch)
        got = greedy_verdict(tokens.tolist(), counts, parents.tolist(), choices.tolist())
        assert (got.paths, got.tokens, got.last_rows) == (expected.paths, expected.tokens, expected.last_rows)
        assert got.paths == tensor_greedy_paths(tokens, counts, parents, choices)
        depths.update(len(path) for path in got.paths)
    assert {0, 1, 2, 3} <= depths  # rejections at the root and paths of several depths were exercised
