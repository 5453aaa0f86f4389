"""Tool calling: prompt rendering (template ``tools``, history), the parsers, and live requests whose
``tool_choice`` (required, named) the grammar enforces, with and without speculation."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from helpers import served_models
from infer.server.tools import forced_schema, functions, parse_calls, prompt_messages

MODEL = "tiny"
WEATHER = {"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1,
                                                                                  "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
QWEN_LIKE = ("{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}"
             "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
             "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
             "<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_parsers() -> None:
    known = functions(TOOLS)
    content, calls = parse_calls('Sure.<tool_call>\n{"name": "weather", "arguments": {"city": "Rome", "days": 2}}\n'
                                 '</tool_call><tool_call>{"name": "time", "arguments": {"zone": "UTC"}}</tool_call>',
                                 QWEN_LIKE, known)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [
        ("weather", {"city": "Rome", "days": 2}), ("time", {"zone": "UTC"})]
    content, calls = parse_calls('<|python_tag|>{"name": "time", "parameters": {"zone": "CET"}}', None, known)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("time", {"zone": "CET"})]  # Llama 3
    _, calls = parse_calls('[{"name": "weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 1}"}]', None, known)
    assert [(c.name, c.arguments) for c in calls] == [("weather", {"city": "Paris", "days": 1})]
    assert parse_calls('{"name": "unknown", "arguments": {}}', None, known) == ('{"name": "unknown", "arguments": {}}', [])
    assert parse_calls("It is sunny.", None, known) == ("It is sunny.", [])


def test_prompt_rendering_keeps_tools_and_history() -> None:
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "weather",
                                                                     "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    # A template that renders tools and tool calls gets them (arguments as objects, for tojson).
    messages, tools = prompt_messages(history, TOOLS, QWEN_LIKE)
    assert tools == TOOLS and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris", "days": 1}
    # One that does not: the tools become a system message, the call and its result text.
    messages, tools = prompt_messages(history, TOOLS, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert tools is None and messages[0]["role"] == "system" and '"weather"' in messages[0]["content"]
    assert '"city": "Paris"' in messages[2]["content"] and "tool_calls" not in messages[2]
    # The result is named by its call's place in the list: the call's id (random, from the server) stays
    # out of the prompt, so a greedy answer cannot depend on it.
    assert messages[3] == {"role": "user", "content": "Tool result (call 1): sunny, 21 C"}
    renamed = [{**m, "tool_calls": [{**m["tool_calls"][0], "id": "call_2"}]} if m.get("tool_calls") else
               {**m, "tool_call_id": "call_2"} if m["role"] == "tool" else m for m in history]
    assert prompt_messages(renamed, TOOLS, "{% for m in messages %}{{ m.content }}{% endfor %}")[0] == messages


def test_forced_schema() -> None:
    fns = functions(TOOLS)
    assert forced_schema(fns, "auto", True) is None and forced_schema(fns, "none", True) is None
    required = forced_schema(fns, "required", False)
    assert required is not None and required["maxItems"] == 1 and len(required["items"]["anyOf"]) == 2
    named = forced_schema(fns, {"type": "function", "function": {"name": "time"}}, True)
    assert named is not None and named["items"]["properties"]["name"] == {"const": "time"}


@pytest.fixture(scope="module")
def urls(tiny_llama: Path) -> Iterator[dict[str, str]]:
    kinds = {"plain": {}, "ngram": {"speculator": "ngram", "spec_length": 3, "spec_length_policy": "fixed"},
             "suffix": {"speculator": "suffix", "spec_length": 3, "spec_length_policy": "fixed"}}
    with served_models(tiny_llama, kinds, max_batch_size=4, served_name=MODEL) as found:
        yield found


@pytest.mark.parametrize("kind", ["plain", "ngram"])
def test_required_and_named_tool_choice_give_calls_that_follow_the_schema(urls: dict[str, str], kind: str) -> None:
    api = OpenAI(base_url=f"{urls[kind]}/v1", api_key="x", max_retries=0, timeout=60)
    for choice, names in (("required", {"weather", "time"}),
                          ({"type": "function", "function": {"name": "weather"}}, {"weather"})):
        out = api.chat.completions.create(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice=choice,  # type: ignore[arg-type]
                                          max_tokens=80, temperature=0.7, seed=3)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls", message
        assert message.tool_calls
        for call in message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert call.function.name in names
            arguments = json.loads(call.function.arguments)
            if call.function.name == "weather":
                assert arguments["city"] in ("Paris", "Rome") and 1 <= arguments["days"] <= 7
            else:
                assert arguments == {"zone": arguments["zone"]} and arguments["zone"] in ("UTC", "CET")
    # Streamed: each call's name once, then its arguments in delta.tool_calls pieces that join to the
    # non-streamed answer's calls exactly; then finish_reason tool_calls. How many pieces depends on
    # timing (a handler that falls behind the engine reads only the newest snapshot), so that the
    # arguments come piece by piece as tokens arrive is test_tool_stream's, where the chunking is fixed.
    request: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                               "max_tokens": 80, "temperature": 0}
    whole = api.chat.completions.create(**request).choices[0].message.tool_calls
    chunks = list(api.chat.completions.create(**request, stream=True))
    joined: dict[int, tuple[str, list[str]]] = {}
    for chunk in chunks:
        for tc in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            assert tc.function is not None
            if tc.index not in joined:
                assert tc.id and tc.function.name in ("weather", "time")
                joined[tc.index] = (tc.function.name, [])
            else:
                assert tc.id is None and tc.function.name is None  # the name comes once, with the id
            joined[tc.index][1].append(tc.function.arguments or "")
    assert whole and [(name, "".join(parts)) for name, parts in joined.values()] == [
        (c.function.name, c.function.arguments) for c in whole]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_history_reaches_the_prompt(urls: dict[str, str]) -> None:
    base = {"model": MODEL, "max_tokens": 1, "temperature": 0}
    plain = httpx.post(f"{urls['plain']}/v1/chat/completions", timeout=30, json={**base, "messages": MESSAGES}).json()
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with_history = httpx.post(f"{urls['plain']}/v1/chat/completions", timeout=30,
                              json={**base, "messages": history, "tools": TOOLS}).json()
    assert with_history["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"] + 20
    bad: dict[str, Any] = {**base, "messages": MESSAGES, "tools": TOOLS,
                           "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    response = httpx.post(f"{urls['plain']}/v1/chat/completions", timeout=30, json=bad)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


def test_a_whole_call_that_ends_at_max_tokens_is_a_tool_call(urls: dict[str, str]) -> None:
    """A forced call whose JSON ends on the last token max_tokens allows (no room for EOS) is still
    a tool call; one cut inside its arguments is a call with them as far as they go (not JSON) and
    finish_reason length, as OpenAI answers."""
    api = OpenAI(base_url=f"{urls['plain']}/v1", api_key="x", max_retries=0, timeout=60)
    request: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": [TIME], "tool_choice": "required",
                               "temperature": 0}
    full = api.chat.completions.create(**request, max_tokens=80)
    assert full.choices[0].finish_reason == "tool_calls" and full.usage is not None
    whole = full.usage.completion_tokens - 1  # the call's tokens, without the EOS
    exact = api.chat.completions.create(**request, max_tokens=whole)
    assert exact.choices[0].finish_reason == "tool_calls", exact.choices[0]
    calls = exact.choices[0].message.tool_calls
    assert calls and [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls or []]
    arguments = (full.choices[0].message.tool_calls or [])[0].function.arguments
    cut = next(answer.choices[0] for n in range(whole - 1, 0, -1)
               if (answer := api.chat.completions.create(**request, max_tokens=n)).choices[0].finish_reason == "length")
    assert cut.message.tool_calls and cut.message.tool_calls[0].function.name == "time"
    assert arguments.startswith(cut.message.tool_calls[0].function.arguments) != arguments


def joined(chunks: list[Any]) -> tuple[str, list[tuple[str, str]], str | None]:
    """A streamed chat answer's content, calls (name, arguments joined) and finish_reason."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                if tc.index not in calls:
                    assert tc.id and tc.function and tc.function.name
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += (tc.function.arguments if tc.function else None) or ""
            reason = choice.finish_reason or reason
    return content, [(name, arguments) for name, arguments in calls.values()], reason


@pytest.mark.parametrize("kind", ["plain", "ngram", "suffix"])
def test_a_forced_call_cut_at_every_max_tokens_streams_what_it_answers(urls: dict[str, str], kind: str) -> None:
    """Issue 54: a forced call (several, with required) cut by every max_tokens from 1 token to whole,
    on every drafter (which changes how many tokens a step brings): the streamed pieces join to the
    non-streamed calls, each call as far as the full answer's goes, finish_reason tool_calls only
    when every call's arguments are whole."""
    api = OpenAI(base_url=f"{urls[kind]}/v1", api_key="x", max_retries=0, timeout=60)
    request: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
                               "temperature": 0}
    full = api.chat.completions.create(**request, max_tokens=100)
    assert full.choices[0].finish_reason == "tool_calls" and full.usage is not None
    final = [(c.function.name, c.function.arguments) for c in full.choices[0].message.tool_calls or []]
    reasons = set()
    for max_tokens in range(1, full.usage.completion_tokens + 1):
        choice = api.chat.completions.create(**request, max_tokens=max_tokens).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        streamed = joined(list(api.chat.completions.create(**request, max_tokens=max_tokens, stream=True)))
        assert streamed == ((choice.message.content or "") if not calls else choice.message.content or "", calls,
                            choice.finish_reason), max_tokens
        for (name, arguments), (final_name, final_arguments) in zip(calls, final, strict=False):
            assert name == final_name and final_arguments.startswith(arguments), max_tokens
        whole = bool(calls) and all(arguments == final[i][1] for i, (_, arguments) in enumerate(calls))
        assert choice.finish_reason == ("tool_calls" if whole else "length"), (max_tokens, choice)
        reasons.add(choice.finish_reason)
    assert reasons == {"length", "tool_calls"}


def responses_events(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    text = httpx.post(f"{url}/v1/responses", timeout=60, json={**body, "stream": True}).text
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def test_a_response_cut_inside_a_call_is_one_a_continuation_can_use(urls: dict[str, str]) -> None:
    """Issue 54: /v1/responses cut by max_output_tokens inside a call's arguments answers the call as
    far as it goes with status incomplete (streamed and not, alike); a continuation from it by
    previous_response_id, or with its output sent back as input, is answered (it was a 400)."""
    url = urls["plain"]
    tool = {"type": "function", "name": WEATHER["function"]["name"], "parameters": WEATHER["function"]["parameters"]}
    body: dict[str, Any] = {"model": MODEL, "input": "Weather in Paris?", "tools": [tool], "tool_choice": "required",
                            "temperature": 0}
    full = httpx.post(f"{url}/v1/responses", timeout=60, json={**body, "max_output_tokens": 80}).json()
    call = next(item for item in full["output"] if item["type"] == "function_call")
    assert call["status"] == "completed" and json.loads(call["arguments"])
    for n in range(full["usage"]["output_tokens"] - 2, 0, -1):
        cut = httpx.post(f"{url}/v1/responses", timeout=60, json={**body, "max_output_tokens": n}).json()
        calls = [item for item in cut["output"] if item["type"] == "function_call"]
        if calls and calls[0]["arguments"] and calls[0]["arguments"] != call["arguments"]:
            break
    else:
        pytest.fail("no cut inside the call's arguments")
    assert cut["status"] == "incomplete" and calls[0]["status"] == "incomplete"
    assert call["arguments"].startswith(calls[0]["arguments"])
    events = responses_events(url, {**body, "max_output_tokens": n})
    done = events[-1]["response"]
    assert events[-1]["type"] == "response.incomplete"
    assert [(i["type"], i.get("status"), i.get("arguments")) for i in done["output"]] == [
        (i["type"], i.get("status"), i.get("arguments")) for i in cut["output"]]
    for previous in (cut["id"], done["id"]):
        follow = httpx.post(f"{url}/v1/responses", timeout=60, json={
            "model": MODEL, "previous_response_id": previous, "input": "Go on.", "max_output_tokens": 4})
        assert follow.status_code == 200, follow.text
    replayed = httpx.post(f"{url}/v1/responses", timeout=60, json={
        "model": MODEL, "input": [{"role": "user", "content": "Weather in Paris?"}, *cut["output"],
                                  {"role": "user", "content": "Go on."}], "max_output_tokens": 4})
    assert replayed.status_code == 200, replayed.text


def test_a_message_cut_inside_a_tool_use_has_its_input_as_far_as_it_goes(urls: dict[str, str]) -> None:
    """Issue 54: /v1/messages cut by max_tokens inside a tool_use's input: stop_reason max_tokens and
    the input settled so far (it was {} in the SDK's streamed message, a 500 whole), the same
    whole and through the anthropic SDK's stream."""
    from anthropic import Anthropic

    client = Anthropic(base_url=urls["plain"], api_key="x", max_retries=0, timeout=60)
    tool = {"name": "weather", "input_schema": WEATHER["function"]["parameters"]}
    request: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "tools": [tool], "tool_choice": {"type": "any"},
                               "extra_body": {"temperature": 0}}
    full = client.messages.create(**request, max_tokens=80)
    assert full.stop_reason == "tool_use"
    want = full.content[-1].input  # type: ignore[union-attr]
    seen = set()
    for n in range(full.usage.output_tokens - 1, 0, -1):
        whole = client.messages.create(**request, max_tokens=n)
        with client.messages.stream(**request, max_tokens=n) as stream:
            streamed = stream.get_final_message()
        def blocks(message: Any) -> list[dict[str, Any]]:
            return [b.model_dump(exclude={"id"}) for b in message.content]

        assert blocks(streamed) == blocks(whole) and streamed.stop_reason == whole.stop_reason, n
        uses = [b for b in whole.content if b.type == "tool_use"]
        if uses:
            given = uses[0].input  # type: ignore[union-attr]
            assert all(want[k] == v for k, v in given.items()), n
            assert whole.stop_reason == ("tool_use" if given == want else "max_tokens"), n
            seen.add(len(given))
    assert len(seen) > 1, seen  # cuts with some of the input and with less
