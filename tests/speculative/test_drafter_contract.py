"""The drafter contract and the budget controller, through the engine.

A drafter written against ``infer.speculative.drafter`` alone plugs into the speculative runner;
the runner hands it the target's hidden states, releases every request, and asks one budget
controller how much to draft; a round that verified nothing counts as a plain step.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from checkpoints import make_medusa_heads
from infer import LLM, EngineConfig, SamplingParams
from infer.core.request import Request
from infer.engine.speculative_runner import SpeculativeRunner
from infer.speculative.budget import BudgetController
from infer.speculative.drafter import Drafter, DrafterInfo, Proposal, pad_proposals

PROMPTS = ["def foo(x):", "import os\nimport sys\n", "a"]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


class RepeatLast(Drafter):
    """Guesses that the newest token repeats; records what the runner hands it."""

    def __init__(self, uses_hidden_states: bool) -> None:
        self.info = DrafterInfo(uses_hidden_states=uses_hidden_states)
        self.hidden: list[tuple[list[list[int]], torch.Tensor | None]] = []
        self.released: list[str] = []
        self.budgets: list[list[int]] = []

    def propose(self, requests: list[Request], budgets: list[int], hidden_states: torch.Tensor | None) -> Proposal:
        self.budgets.append(list(budgets))
        self.hidden.append(([r.all_token_ids for r in requests], hidden_states))
        return pad_proposals([[r.all_token_ids[-1]] * n for r, n in zip(requests, budgets, strict=True)],
                             torch.device("cpu"))

    def release(self, request: Request) -> None:
        self.released.append(request.request_id)


def with_drafter(llm: LLM, drafter: Drafter, budget: BudgetController) -> None:
    """Replace the plain runner of ``llm``'s engine with a speculative one around it."""
    runner = SpeculativeRunner(llm.engine.runner, drafter, budget)  # type: ignore[arg-type]
    llm.engine.runner = llm.engine.scheduler.runner = runner


@pytest.mark.parametrize("uses_hidden_states", [False, True])
def test_a_new_drafter_plugs_in_through_the_contract(tiny_llama: Path, uses_hidden_states: bool) -> None:
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu").generate(PROMPTS, GREEDY)
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", grammar_drafting=False)  # a plain runner to wrap
    drafter = RepeatLast(uses_hidden_states)
    with_drafter(llm, drafter, BudgetController(3))
    spec = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.proposed_tokens for o in spec) > 0
    assert sorted(drafter.released) == sorted(o.request_id for o in spec)  # one release per request
    assert all(max(b) <= 3 for b in drafter.budgets)
    if not uses_hidden_states:
        assert all(hidden is None for _, hidden in drafter.hidden)
        return
    # The hidden state handed over is the target's at the position that produced the newest token
    # (after prefill, a plain step or a verification, whichever came last).
    model = llm.engine.model
    for tokens, hidden in drafter.hidden[:6]:
        assert hidden is not None and hidden.shape == (len(tokens), model.config.hidden_size)
        for row, ids in zip(hidden, tokens, strict=True):
            with torch.inference_mode():
                fresh = model(torch.tensor([ids[:-1]]))[0, -1]
            torch.testing.assert_close(row, fresh, atol=1e-4, rtol=1e-4)


def test_a_request_without_a_hidden_state_takes_a_plain_step(tiny_llama: Path) -> None:
    """A drafter that reads hidden states cannot draft for a request whose state is gone (say, after a
    failed step was rolled back): that request's round is a plain step, and drafting resumes."""
    plain = LLM(str(tiny_llama), dtype="float32", device="cpu").generate(PROMPTS[:1], GREEDY)[0]
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", grammar_drafting=False)  # a plain runner to wrap
    drafter = RepeatLast(uses_hidden_states=True)
    with_drafter(llm, drafter, BudgetController(3))
    engine = llm.engine
    request = engine.add_request(PROMPTS[0], GREEDY)
    engine.step()  # prefill: the first token and the hidden state that produced it
    engine.runner.states.hidden.clear()  # type: ignore[attr-defined]
    proposals = len(drafter.budgets)
    assert [len(u.new_token_ids) for u in engine.step()] == [1]  # no draft: one plain token
    assert len(drafter.budgets) == proposals
    engine.run_until_done()
    assert len(drafter.budgets) > proposals  # drafting resumed with the next hidden state
    assert request.output_token_ids == plain.token_ids


def test_budget_is_clamped_to_the_request(tiny_llama: Path) -> None:
    """Budgets reach the drafter clamped to the tokens a request may still emit."""
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu", grammar_drafting=False)  # a plain runner to wrap
    drafter = RepeatLast(False)
    with_drafter(llm, drafter, BudgetController(5))
    llm.generate(["def f"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert drafter.budgets[0] == [2]  # after the prefill token: 4 - 1 - 1 may still follow the pending one


def test_a_plain_round_is_not_credited_to_the_tree_size_chosen(tiny_llama: Path, tmp_path: Path) -> None:
    """With max_tokens=2 the only decode round cannot draft (the tree is cut to depth 0) and runs as a
    plain step: the controller must credit it to size 0, not to the size it had chosen."""
    heads = make_medusa_heads(tiny_llama, tmp_path / "heads", tree_size=8)
    llm = LLM(str(tiny_llama), device="cpu", speculator="medusa", medusa_heads=str(heads))
    budget = llm.engine.runner.budget  # type: ignore[attr-defined]
    assert budget.adaptive and budget.sizes[-1] == 8
    out = llm.generate(["def f(x):"], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert out.metrics.num_rounds == 1 and out.metrics.proposed_tokens == 0
    assert budget.counts == [1] + [0] * (len(budget.sizes) - 1)


def test_controller_credits_each_request_to_the_size_it_verified() -> None:
    budget = BudgetController(8, adaptive=True, tree=True, cost_per_token=False)
    requests: Any = [SimpleNamespace(request_id=str(i)) for i in range(3)]
    assert budget.budgets(requests) == [0, 0, 0]  # the climb starts from plain decoding
    budget.observe_round(requests, verified=[8, 8, 5], judged=[3, 2, 2], accepted=[3, 1, 2])
    assert budget.tokens[budget.sizes.index(8)] == pytest.approx(3.0)  # (4 + 2) / 2; 5 is off the ladder
    assert sum(budget.counts) == 1
    budget.observe_round(requests, verified=[0, 0, 0], judged=[0, 0, 0], accepted=[0, 0, 0])
    assert budget.counts[0] == 1 and budget.tokens[0] == 1.0


def test_round_cost_model() -> None:
    """Per-token drafting (a draft model) pays the draft step per node; one-call drafting once a round."""
    for cost_per_token in (True, False):
        budget = BudgetController(4, adaptive=True, cost_per_token=cost_per_token, prior_cost=0.5)
        assert budget.round_cost(2) == ((0.5, 0.0) if cost_per_token else (0.0, 0.5))  # the prior, unmeasured
        for tokens in (2, 4, 6, 10):
            budget.observe_target(tokens, 1.0 + 0.1 * tokens)  # a = 1, b = 0.1
        budget.observe_draft_step(2, 0.3)
        per_node, overhead = budget.round_cost(2)
        plain = 1.0 + 0.1 * 2
        if cost_per_token:
            assert per_node == pytest.approx((0.3 + 0.2) / plain) and overhead == 0.0
        else:
            assert per_node == pytest.approx(0.2 / plain) and overhead == pytest.approx(0.3 / plain)
        # A chain round's parts: each verified row costs b (the pass is ragged), a draft model's
        # step or a one-call drafter's call D, all over a plain step.
        per_row, per_step, overhead = budget.chain_cost(2)
        assert per_row == pytest.approx(0.1 / plain)
        assert (per_step, overhead) == pytest.approx((0.3 / plain, 0.0) if cost_per_token else (0.0, 0.3 / plain))


def test_fixed_controller_and_entropy_with_medusa_refused() -> None:
    assert BudgetController(4).budgets([SimpleNamespace(request_id="a")]) == [4]  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max_draft_tokens"):
        BudgetController(0)
    with pytest.raises(ValueError, match="entropy.*Medusa"):
        EngineConfig.from_options(model="m", speculator="medusa", spec_length_policy="entropy")
