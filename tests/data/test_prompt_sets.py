"""The shipped prompt sets: every kind loads, is distinct, and is a generation-benchmark workload."""

from __future__ import annotations

import re
from fractions import Fraction

import pytest

from infer.data.prompt_sets import DEMO_KINDS, MATH_WORKED, PROMPT_SETS
from infer.data.workloads import CHAT_WORKLOADS, WORKLOADS, workload_prompts

NEW_KINDS = ("qa", "math", "translation", "rag", "extract-json")


def test_every_kind_ships_distinct_prompts_and_is_a_workload() -> None:
    assert set(NEW_KINDS) <= set(PROMPT_SETS) and set(DEMO_KINDS) <= set(PROMPT_SETS)
    every = [p for prompts in PROMPT_SETS.values() for p in prompts]
    assert len(set(every)) == len(every)  # no prompt in two sets, nor twice in one
    for kind, prompts in PROMPT_SETS.items():
        assert len(prompts) >= 6 and all(p.strip() == p and len(p) > 20 for p in prompts), kind
        assert kind in WORKLOADS and kind in CHAT_WORKLOADS  # sent through the chat template
        assert workload_prompts(kind, 6) == list(prompts[:6])
        with pytest.raises(ValueError, match="ships"):
            workload_prompts(kind, len(prompts) + 1)


def test_each_new_kind_carries_what_its_answer_draws_on() -> None:
    assert all(p.endswith("Answer in one sentence.") for p in PROMPT_SETS["qa"])
    assert all("'Answer: <number>'" in p for p in PROMPT_SETS["math"])
    assert all(re.match(r"Translate the following text into (French|Spanish|German)\.", p)
               for p in PROMPT_SETS["translation"])
    for prompt in PROMPT_SETS["rag"]:
        document = prompt.split("Document:\n", 1)[1].split("\n\nQuestion: ", 1)[0]
        assert len(document) > 400 and prompt.rstrip().endswith("?")
    for prompt in PROMPT_SETS["extract-json"]:
        keys = re.findall(r'"(\w+)"', prompt.split(". Use a list", 1)[0])
        assert len(keys) >= 4 and len(set(keys)) == len(keys)


def _value(expression: str) -> Fraction:
    """An arithmetic expression of the worked answers (numbers, + - * /, parentheses), exactly."""
    tokens = re.findall(r"\d+(?:\.\d+)?|[-+*/()]", expression)
    assert "".join(tokens) == re.sub(r"\s", "", expression), expression
    return Fraction(eval("".join(f"Fraction('{t}')" if t[0].isdigit() else t for t in tokens)))  # noqa: S307


def test_math_worked_answers_add_up() -> None:
    assert [p for p, _, _ in MATH_WORKED] == [p.split("\n\n", 1)[1] for p in PROMPT_SETS["math"]]
    for problem, worked, final in MATH_WORKED:
        last = None
        for line in worked.splitlines():
            sides = [re.sub(r"[a-z .]*$", "", s.strip()) for s in line.split(":", 1)[1].split("=")]
            values = {_value(side) for side in sides}
            assert len(values) == 1, (problem, line)  # every side of each step is the same number
            last = values.pop()
        assert last == Fraction(final), problem
