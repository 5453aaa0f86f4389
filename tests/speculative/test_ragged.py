"""Ragged verification: a chain round computes the rows its requests drafted, sum_b (1 + k_b),
not the widest request's times the batch, and the budget controller is told those rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from infer import LLM, SamplingParams
from infer.core.request import Request
from infer.speculative.drafter import Proposal

PROMPTS = ["def add(a, b):", "Once upon a time"]


def _llm(model: Path, stack: bool) -> LLM:
    llm = LLM(str(model), dtype="float32", device="cpu", speculator="ngram", spec_length=5, spec_length_policy="fixed", max_batch_size=2)
    if not stack:
        llm.engine.runner.target.runner.model.backend.cpu_stack = None  # type: ignore[attr-defined]
    return llm


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
@pytest.mark.parametrize("stack", [True, False], ids=["stack", "layers"])
def test_a_round_drafting_5_and_0_computes_7_rows_not_12(tiny_llama: Path, stack: bool, sampled: bool) -> None:
    """One request drafts 5 tokens and its batch mate none: the target forward and the LM head see
    7 token rows (6 + 1), where a pass padded to the widest request computed 2 x 6 = 12; the budget
    controller is costed 7 rows; and the output is still plain decoding's."""
    llm = _llm(tiny_llama, stack)
    runner = llm.engine.runner
    model = runner.target.runner.model  # type: ignore[attr-defined]
    seen: dict[str, list[int]] = {"forward": [], "lm_head": [], "costed": []}
    armed = [False]
    propose = runner.drafter.propose  # type: ignore[attr-defined]

    def drafts(requests: list[Request], budgets: list[int], hidden: torch.Tensor | None) -> Proposal:
        if armed[0] or len(requests) != 2:
            return propose(requests, budgets, hidden)  # type: ignore[no-any-return]
        armed[0] = True
        assert budgets[0] == 5
        return Proposal(torch.tensor([[11, 12, 13, 14, 15], [0] * 5]), [5, 0], None)

    def count_forward(_module: Any, args: tuple[Any, ...]) -> None:
        if armed[0] and not seen["lm_head"]:
            seen["forward"].append(args[0].numel())

    def count_head(_module: Any, args: tuple[Any, ...]) -> None:
        if armed[0] and not seen["lm_head"]:
            seen["lm_head"].append(args[0].numel() // args[0].shape[-1])

    observe = runner.budget.observe_target  # type: ignore[attr-defined]

    def costed(num_tokens: int, seconds: float) -> None:
        if armed[0] and not seen["costed"]:
            seen["costed"].append(num_tokens)
        observe(num_tokens, seconds)

    runner.drafter.propose = drafts  # type: ignore[attr-defined]
    # Every round "matched", so the round asks for drafts (one that matched nothing is a plain step).
    runner.drafter.match_classes = lambda requests: [1] * len(requests)  # type: ignore[attr-defined]
    runner.budget.observe_target = costed  # type: ignore[attr-defined]
    model.model.embed_tokens.register_forward_pre_hook(count_forward)  # every pass embeds its tokens, stack or not
    model.lm_head.register_forward_pre_hook(count_head)
    params = SamplingParams(max_tokens=8, temperature=0.8 if sampled else 0.0, seed=3, ignore_eos=True)
    out = llm.generate(PROMPTS, params)
    assert seen == {"forward": [7], "lm_head": [7], "costed": [7]}
    if not sampled:  # greedy: token-identical to plain decoding
        plain = LLM(str(tiny_llama), dtype="float32", device="cpu", max_batch_size=2).generate(PROMPTS, params)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]
    assert all(len(o.token_ids) == 8 for o in out)
