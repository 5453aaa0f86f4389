"""Tool calls streamed as they are generated (server/tool_stream.py): whatever the chunking, the
streamed calls join to exactly what the non-streamed parser (tools.parse_calls) returns."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from infer.server.tool_stream import ToolCallStream
from infer.server.tools import parse_calls

KNOWN: dict[str, dict[str, Any]] = {"weather": {}, "add": {}, "search": {}}
QWEN_TEMPLATE = "{{ '<tool_call>' }}"


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["str", "int", "float", "bool", "null"] + (["obj", "arr"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "str":
        return "".join(rng.choice(['a', 'Z', ' ', '"', '\\', '/', '\n', 'é', '😀', '\u2028', '{', ']', ',', ':'])
                       for _ in range(rng.randint(0, 8)))
    if kind == "int":
        return rng.choice([0, -1, 7, 123456789012345678901234567890, rng.randint(-1000, 1000)])
    if kind == "float":
        return rng.choice([0.5, -2.25e-7, 1e21, 3.0, rng.uniform(-100, 100)])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "arr":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    return {"k" + str(i) + rng.choice(["", "é", '"']): random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}


def dump(value: Any, rng: random.Random) -> str:
    """JSON as a model might write it: any whitespace, escapes or not, numbers in other spellings."""
    space = lambda: rng.choice(["", "", " ", "\n  "])  # noqa: E731
    if isinstance(value, dict):
        members = [f"{space()}{json.dumps(k, ensure_ascii=rng.random() < 0.5)}{space()}:{space()}{dump(v, rng)}"
                   for k, v in value.items()]
        return "{" + ",".join(members) + space() + "}"
    if isinstance(value, list):
        return "[" + ",".join(space() + dump(v, rng) for v in value) + space() + "]"
    if isinstance(value, float) and value == 3.0 and rng.random() < 0.5:
        return "3.000e0"
    return json.dumps(value, ensure_ascii=rng.random() < 0.5)


def stream(text: str, template: str | None, rng: random.Random) -> tuple[str, list[tuple[str, list[str]]]]:
    """Feed ``text`` in random pieces, then finish; the content and each call's (name, pieces)."""
    calls_stream = ToolCallStream(KNOWN)
    content = ""
    calls: dict[int, tuple[str, list[str]]] = {}

    def take(new: str, deltas: list[dict[str, Any]]) -> None:
        nonlocal content
        content += new
        for delta in deltas:
            if "id" in delta:
                assert delta["index"] not in calls and delta["function"]["name"] in KNOWN
                calls[delta["index"]] = (delta["function"]["name"], [])
            calls[delta["index"]][1].append(delta["function"]["arguments"])

    end = 0
    while end < len(text):
        end = min(len(text), end + rng.choice([1, 1, 2, 3, 7]))
        take(*calls_stream.step(text[:end]))
    take(*calls_stream.finish(text, parse_calls(text, template, KNOWN)))
    return content, [calls[i] for i in sorted(calls)]


def expected(text: str, template: str | None) -> tuple[str, list[tuple[str, str]]]:
    content, calls = parse_calls(text, template, KNOWN)
    if not calls:
        return text, []
    return content or "", [(c.name, json.dumps(c.arguments)) for c in calls]


@pytest.mark.parametrize("seed", range(60))
def test_streamed_calls_join_to_the_parsed_calls(seed: int) -> None:
    rng = random.Random(seed)
    calls = []
    for _ in range(rng.randint(1, 3)):
        name = rng.choice(["weather", "add", "search", "unknown"])
        arguments = {f"a{i}": random_value(rng) for i in range(rng.randint(0, 4))}
        key = rng.choice(["arguments", "arguments", "parameters"])
        calls.append("{" + f'"name": "{name}", "{key}": {dump(arguments, rng)}' + "}")
    form = rng.choice(["list", "object", "python_tag", "qwen"])
    if form == "qwen":
        text = rng.choice(["", "Let me look.\n", "Sure <tool> "]) + "\n".join(
            f"<tool_call>\n{call}\n</tool_call>" for call in calls)
        template: str | None = QWEN_TEMPLATE
    else:
        body = calls[0] if form != "list" else "[" + ", ".join(calls) + "]"
        text = ("<|python_tag|>" if form == "python_tag" else rng.choice(["", " "])) + body
        template = None
    content, streamed = stream(text, template, rng)
    want_content, want_calls = expected(text, template)
    assert [(name, "".join(pieces)) for name, pieces in streamed] == want_calls, text
    assert content == want_content, text


def test_arguments_arrive_in_pieces_as_they_are_generated() -> None:
    text = '[{"name": "weather", "arguments": {"city": "Paris", "days": 3, "units": "metric"}}]'
    content, calls = stream(text, None, random.Random(0))
    assert content == "" and calls[0][0] == "weather"
    pieces = [p for p in calls[0][1] if p]
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Paris", "days": 3, "units": "metric"}'


def test_text_that_is_not_a_call_is_content() -> None:
    for text in ("Hello there.", '{"answer": 42}', "[1, 2, 3]", "I would call <tool_call> but no.",
                 '<tool_call>{"name": "nope", "arguments": {}}</tool_call>', "   "):
        content, calls = stream(text, None, random.Random(1))
        assert (content, calls) == (text, []), text


def test_a_call_broken_off_was_announced_but_is_text_when_parsed() -> None:
    """The documented limit: a call cut short (max_tokens) is announced as it streams; the parser
    then finds no call, so the non-streamed answer has only text (the stream cannot take it back)."""
    text = '[{"name": "weather", "arguments": {"city": "Par'
    content, calls = stream(text, None, random.Random(2))
    assert expected(text, None) == (text, [])
    assert calls and calls[0][0] == "weather" and "".join(calls[0][1]) == '{"city": "Par'
