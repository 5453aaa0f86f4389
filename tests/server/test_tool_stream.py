"""Tool calls streamed as they are generated (server/tool_stream.py): whatever the chunking, and
wherever max_tokens cuts the answer, the streamed calls join to exactly what the non-streamed parser
(tools.parse_calls) returns."""

from __future__ import annotations

import json
import random
from typing import Any

import jiter
import pytest

from infer.server.tool_stream import ToolCallStream
from infer.server.tools import arguments_object, finish_reason, parse_calls

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
    return content or "", [(c.name, c.to_openai()["function"]["arguments"]) for c in calls]


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
    # The same answer cut short (max_tokens) anywhere: the stream still joins to the parse.
    for cut in sorted(rng.sample(range(len(text)), min(8, len(text)))):
        content, streamed = stream(text[:cut], template, rng)
        assert (content, [(name, "".join(pieces)) for name, pieces in streamed]) == expected(text[:cut], template)


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


# Real answers in each format the parsers read: nested arguments, strings with escapes and
# whitespace, several calls, text around them, an unknown function's call, arguments as a string.
ANSWERS: list[tuple[str, str | None]] = [
    ('<tool_call>\n{"name": "weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_call>', QWEN_TEMPLATE),
    ('Let me check.\n<tool_call>\n{"name": "search", "arguments": {"query": "caf\u00e9 \\"best\\" a\\\\b \U0001F600", '
     '"filters": {"tags": ["x", "y z"], "limit": 10, "exact": true, "near": null}}}\n</tool_call>\n'
     '<tool_call>\n{"name": "add", "arguments": {"a": -1.5e3, "b": 20}}\n</tool_call>', QWEN_TEMPLATE),
    ('\nSure.  <tool_call>{"name": "unknown", "arguments": {}}</tool_call> <tool_call>{"name": "search", '
     '"arguments": {"query": "  two  spaces  "}}</tool_call>', QWEN_TEMPLATE),
    ('{"name": "weather", "parameters": {"city": "Rome", "days": 3}}', None),  # Llama 3
    ('<|python_tag|>{"name": "search", "parameters": {"query": "a\\nb\\u00e9", "filters": {"tags": []}}}', None),
    ('[{"name": "weather", "arguments": {"city": "Rome", "days": 3}}, {"name": "add", "arguments": '
     '{"a": 1, "b": [1, 2.5, {"c": "x}]"}]}}]', None),  # the forced (tool_choice required) format
    ('[{"name": "unknown", "arguments": {"x": 1}}, {"name": "add", "arguments": {"a": 12345, "b": false}}]', None),
    ('{"name": "weather", "arguments": "{\\"city\\": \\"Rome\\", \\"days\\": 3}"}', None),
]


def joined_stream(text: str, template: str | None, steps: list[int]) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls (name, arguments) the deltas of ``text`` join to, streamed as
    ``text[:steps[0]]``, ``text[:steps[1]]``, ... and then finished."""
    calls_stream = ToolCallStream(KNOWN)
    content = ""
    calls: dict[int, list[str]] = {}

    def take(new: str, deltas: list[dict[str, Any]]) -> None:
        nonlocal content
        content += new
        for delta in deltas:
            if "id" in delta:
                assert delta["index"] == len(calls) and delta["function"]["name"] in KNOWN
                calls[delta["index"]] = [delta["function"]["name"], ""]
            calls[delta["index"]][1] += delta["function"]["arguments"]

    for end in steps:
        take(*calls_stream.step(text[:end]))
    take(*calls_stream.finish(text, parse_calls(text, template, KNOWN)))
    return content, [(name, arguments) for name, arguments in calls.values()]


def not_streamed(text: str, template: str | None) -> tuple[str, list[tuple[str, str]]]:
    """What the non-streamed answer has: its content and each call's name and arguments string."""
    content, calls = parse_calls(text, template, KNOWN)
    if not calls:
        return text, []
    return content or "", [(c.name, c.to_openai()["function"]["arguments"]) for c in calls]


def chunkings(n: int) -> dict[str, list[int]]:
    """Where a stream of ``n`` characters may stand at each step: one character a step, several
    (as a drafter's accepted tokens come), or all at once."""
    out = {"one": list(range(1, n + 1)), "whole": [n]}
    for seed in (0, 1):
        rng, steps, end = random.Random(seed), [], 0
        while end < n:
            end = min(n, end + rng.randint(1, 9))
            steps.append(end)
        out[f"random{seed}"] = steps
    return out


@pytest.mark.parametrize("answer", range(len(ANSWERS)))
def test_every_cut_streams_what_the_cut_answer_parses_to(answer: int) -> None:
    """The answer cut after any character (max_tokens), streamed in any chunking: the deltas join to
    exactly the non-streamed answer of the same text."""
    full, template = ANSWERS[answer]
    whole_calls = not_streamed(full, template)[1]
    assert whole_calls, full
    for cut in range(len(full) + 1):
        text = full[:cut]
        want = not_streamed(text, template)
        for name, steps in chunkings(cut).items():
            assert joined_stream(text, template, steps) == want, (cut, name, text)


@pytest.mark.parametrize("answer", range(len(ANSWERS)))
def test_a_cut_answer_keeps_its_calls_as_far_as_they_go(answer: int) -> None:
    """What is truthful at a cut: each call so far is the full answer's call, its arguments as far as
    they were generated; whole (valid JSON, finish_reason tool_calls) once its arguments object is,
    even without the wrapper's end (``}``, ``]``, ``</tool_call>``)."""
    full, template = ANSWERS[answer]
    whole = parse_calls(full, template, KNOWN)[1]
    for cut in range(len(full) + 1):
        calls = parse_calls(full[:cut], template, KNOWN)[1]
        assert len(calls) <= len(whole)
        for call, final in zip(calls, whole, strict=False):
            assert call.name == final.name and final.arguments_json.startswith(call.arguments_json), full[:cut]
            assert (call.cut is None) == (call.arguments_json == final.arguments_json), full[:cut]
            if call.cut is not None:
                # Anthropic's tool_use input: the members settled so far, read from the arguments (whole,
                # from the chat answer) as the SDK reads them joined from a stream.
                sdk = jiter.from_json(call.cut.encode(), partial_mode=True) if call.cut else {}
                assert call.arguments == arguments_object(call.cut) == sdk, full[:cut]
        reason = finish_reason(calls, "length")
        assert reason == ("tool_calls" if calls and all(c.cut is None for c in calls) else "length")


def test_a_call_whose_arguments_are_whole_is_a_call_though_its_end_is_cut() -> None:
    """The defect's own cut (max_tokens 22): the arguments object is whole, the call's "}" is not."""
    for text, template in (('{"name": "weather", "arguments": {"city": "Rome", "days": 3}', None),
                           ('[{"name": "weather", "arguments": {"city": "Rome", "days": 3}}', None),
                           ('<tool_call>\n{"name": "weather", "arguments": {"city": "Rome", "days": 3}}\n</tool_',
                            QWEN_TEMPLATE)):
        content, calls = parse_calls(text, template, KNOWN)
        assert content is None and [(c.name, c.arguments, c.cut) for c in calls] == [
            ("weather", {"city": "Rome", "days": 3}, None)], text
        assert joined_stream(text, template, list(range(1, len(text) + 1)))[1] == [
            ("weather", '{"city": "Rome", "days": 3}')]
        assert finish_reason(calls, "length") == "tool_calls"


def test_a_call_cut_inside_its_arguments_is_a_cut_call() -> None:
    """Cut inside the arguments: the call as far as it goes (OpenAI's truncated arguments, finish_reason
    length), streamed and not; a number at the very end is not settled (it might have gone on)."""
    text = '[{"name": "weather", "arguments": {"city": "Ro\\u00e9", "days": 3'
    content, calls = parse_calls(text, None, KNOWN)
    assert [(c.name, c.arguments, c.cut) for c in calls] == [
        ("weather", {"city": "Ro\u00e9"}, '{"city": "Ro\\u00e9", "days": ')]
    assert finish_reason(calls, "length") == "length"
    assert joined_stream(text, None, list(range(1, len(text) + 1))) == ("", [("weather", '{"city": "Ro\\u00e9", "days": ')])
    # A number the text goes on after is settled, in the call and in its input read back from its arguments.
    calls = parse_calls('{"name": "add", "arguments": {"a": 1, ', None, KNOWN)[1]
    assert [(c.arguments, c.cut) for c in calls] == [({"a": 1}, '{"a": 1')] and arguments_object('{"a": 1') == {"a": 1}
    # Cut before the function's name is whole: no call was announced, the answer is its text.
    assert joined_stream('{"name": "wea', None, [5, 13]) == not_streamed('{"name": "wea', None) == ('{"name": "wea', [])


def test_calls_cut_at_each_token_stream_as_they_parse(tokenizer_dir: Any) -> None:
    """As the engine makes them: the shared test tokenizer's tokens detokenized incrementally,
    delivered 1..5 at a time (a drafter's accepted run) and cut after every token (max_tokens)."""
    from tokenizers import Tokenizer

    from infer.core.detokenizer import IncrementalDetokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    for full, template in ANSWERS:
        ids = tokenizer.encode(full, add_special_tokens=False).ids
        assert tokenizer.decode(ids) == full
        for cut in range(len(ids) + 1):
            for seed in (0, 1):
                rng, detok, steps, done = random.Random(seed), IncrementalDetokenizer(tokenizer, []), [], 0
                while done < cut:
                    for token in ids[done:min(cut, done + rng.randint(1, 5))]:
                        detok.append(token, [])
                        done += 1
                    steps.append(len(detok.text))
                detok.flush()
                assert joined_stream(detok.text, template, steps) == not_streamed(detok.text, template), detok.text
