"""Issue 54 on the dialect routes (tiny random model, in-process servers): the /v1/responses store
bounded in bytes as well as count, metadata and echoed objects bounded, lone surrogates a 400
naming the field on every route (never a 500, never stored), finish reasons mapped truthfully by
/v1/responses and /v1/messages (streamed and not), and the ``speculation`` extension validated and
honoured on both.

A request goes out as ``json.dumps`` text, so a lone surrogate travels as the escape ``\\ud800``
(httpx's own encoder cannot encode it at all).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from infer import Engine, EngineConfig
from infer.server.app import create_app
from infer.server.background import BackgroundServer

MODEL = "tiny"
LONE = "\ud800"
# A string whose first letters send llguidance's lexer past its limit: a sampled answer that starts
# on the 'a' branch ends with finish_reason grammar_error, one on the '7' branch completes.
EXPLODING = {"type": "object", "properties": {"s": {"type": "string", "pattern": "^((((a{100}){100}){100})|7)$"}},
             "required": ["s"], "additionalProperties": False}


@pytest.fixture(scope="module")
def plain(tiny_llama: Path) -> Iterator[tuple[str, Any]]:
    engine = Engine(EngineConfig.from_options(model=str(tiny_llama), dtype="float32", device="cpu", max_batch_size=4))
    app = create_app(engine, MODEL, None)
    server = BackgroundServer(app).start()
    yield server.url, app
    server.stop()


def post(url: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    return httpx.post(url, content=json.dumps(body, separators=(",", ":")), headers={"Content-Type": "application/json"},
                      timeout=timeout)


def events(text: str) -> list[dict[str, Any]]:
    """The JSON payloads of an SSE body (``[DONE]`` left out)."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def error_param(response: httpx.Response) -> str | None:
    """The field a 400 names: OpenAI's ``param``; Anthropic's shape has only a message, which starts with it."""
    error = response.json()["error"]
    return error["param"] if "param" in error else error["message"]


# -- metadata and echoed objects ------------------------------------------------------------------
RESPONSE = {"model": MODEL, "input": "x", "max_output_tokens": 1}


@pytest.mark.parametrize("metadata, problem", [
    ({f"k{i}": "v" for i in range(17)}, "17 pairs"),
    ({"k" * 65: "v"}, "64 characters"),
    ({"k": "v" * 513}, "512 characters"),
    ({"k": 1}, "string"),
    ({"k": ["v"]}, "string"),
    ({"k": None}, "string"),
    # The issue's reproduction: about 1 MB of empty lists, stored and echoed whole before.
    ({"junk": [[] for _ in range(330_000)]}, "string"),
])
def test_metadata_is_bounded_as_openai_bounds_it(plain: tuple[str, Any], metadata: dict[str, Any],
                                                 problem: str) -> None:
    url, app = plain
    before = len(app.state.responses._items)
    response = post(f"{url}/v1/responses", {**RESPONSE, "metadata": metadata})
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] == "metadata" and problem in response.json()["error"]["message"]
    assert len(app.state.responses._items) == before


def test_legal_metadata_at_the_bounds_is_stored_and_echoed(plain: tuple[str, Any]) -> None:
    url, _ = plain
    metadata = {f"{i:02d}" + "k" * 62: "v" * 512 for i in range(16)}
    created = post(f"{url}/v1/responses", {**RESPONSE, "metadata": metadata})
    assert created.status_code == 200 and created.json()["metadata"] == metadata
    assert httpx.get(f"{url}/v1/responses/{created.json()['id']}").json()["metadata"] == metadata


FN = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}, "strict": False}


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{**FN, "junk": "x" * 1000}]}, "tools"),
    ({"tools": [FN], "tool_choice": {"type": "function", "name": "f", "junk": [1]}}, "tool_choice"),
    ({"text": {"format": {"type": "json_object", "junk": {}}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}, "junk": 1}}}, "text.format"),
    ({"text": {"format": {"type": "text", "junk": 1}}}, "text.format"),
])
def test_unknown_keys_in_echoed_objects_are_refused(plain: tuple[str, Any], extra: dict[str, Any],
                                                    param: str) -> None:
    url, _ = plain
    response = post(f"{url}/v1/responses", {**RESPONSE, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert "junk" in response.json()["error"]["message"]


def test_the_known_keys_of_echoed_objects_still_work(plain: tuple[str, Any]) -> None:
    url, _ = plain
    fmt = {"type": "json_schema", "name": "x", "description": "d", "schema": {"type": "string"}, "strict": True}
    for extra in ({"tools": [FN], "tool_choice": {"type": "function", "name": "f"}}, {"text": {"format": fmt}}):
        response = post(f"{url}/v1/responses", {**RESPONSE, "max_output_tokens": 4, **extra})
        assert response.status_code == 200, response.text


# -- the store's byte budget --------------------------------------------------------------------------
def test_the_store_is_bounded_in_bytes_and_drops_the_oldest(tiny_llama: Path) -> None:
    """Responses with large-but-legal metadata (16 values of 512 characters): the store's bytes stay
    under its budget, the oldest go (404), the newest stay; one larger than the whole budget is not
    stored (the answer says ``store: false``), and nothing crashes."""
    budget = 64 * 1024
    engine = Engine(EngineConfig.from_options(model=str(tiny_llama), dtype="float32", device="cpu", max_batch_size=2))
    app = create_app(engine, MODEL, None, max_stored_responses=1000, max_stored_response_bytes=budget)
    server = BackgroundServer(app).start()
    store = app.state.responses
    try:
        ids = []
        for i in range(24):
            metadata = {f"k{j}": f"{i:04d}" + "v" * 508 for j in range(16)}
            body = {**RESPONSE, "metadata": metadata, "stream": i % 3 == 2}
            response = post(f"{server.url}/v1/responses", body)
            assert response.status_code == 200
            created = response.json() if not body["stream"] else events(response.text)[-1]["response"]
            assert created["store"] is True
            ids.append(created["id"])
            assert store.bytes <= budget
        assert 0 < len(store) < len(ids)
        assert httpx.get(f"{server.url}/v1/responses/{ids[0]}").status_code == 404
        assert httpx.get(f"{server.url}/v1/responses/{ids[-1]}").status_code == 200
        kept = [i for i in ids if httpx.get(f"{server.url}/v1/responses/{i}").status_code == 200]
        assert kept == ids[-len(kept):]  # the newest, in order
        # What is measured: the JSON of each stored response and its conversation.
        assert store.bytes == sum(len(item.raw_response) + len(item.raw_conversation) for item in store._items.values())
        deleted = httpx.delete(f"{server.url}/v1/responses/{ids[-1]}")
        assert deleted.status_code == 200 and store.bytes <= budget
    finally:
        server.stop()
    small = create_app(Engine(EngineConfig.from_options(model=str(tiny_llama), dtype="float32", device="cpu",
                                                        max_batch_size=2)),
                       MODEL, None, max_stored_response_bytes=4096)
    server = BackgroundServer(small).start()
    try:
        metadata = {f"k{j}": "v" * 512 for j in range(16)}
        for stream in (False, True):
            response = post(f"{server.url}/v1/responses", {**RESPONSE, "metadata": metadata, "stream": stream})
            assert response.status_code == 200
            created = events(response.text)[-1]["response"] if stream else response.json()
            assert created["store"] is False
            assert httpx.get(f"{server.url}/v1/responses/{created['id']}").status_code == 404
        assert len(small.state.responses) == 0 and small.state.responses.bytes == 0
        fits = post(f"{server.url}/v1/responses", RESPONSE).json()
        assert fits["store"] is True and httpx.get(f"{server.url}/v1/responses/{fits['id']}").status_code == 200
    finally:
        server.stop()


def test_the_store_byte_budget_has_one_default() -> None:
    """`infer serve --help` does not import the app (it is slow to), so the CLI repeats the default."""
    from infer.server import cli, responses

    assert cli.DEFAULT_MAX_STORED_RESPONSE_BYTES == responses.DEFAULT_MAX_STORED_RESPONSE_BYTES
    parser = cli.argparse.ArgumentParser()
    cli.add_subparser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--max-stored-response-bytes", "1000"])
    assert args.max_stored_response_bytes == 1000


# -- lone surrogates ------------------------------------------------------------------------------
MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": MSG, "max_tokens": 1}
MESSAGES = {"model": MODEL, "messages": MSG, "max_tokens": 1}
SURROGATE_CASES = [
    ("/v1/responses", {**RESPONSE, "metadata": {"a": LONE}}, "metadata"),
    ("/v1/responses", {**RESPONSE, "metadata": {LONE: "a"}}, "metadata"),
    ("/v1/responses", {**RESPONSE, "tools": [{**FN, "description": LONE}]}, "tools"),
    ("/v1/responses", {**RESPONSE, "tools": [{**FN, "parameters": {"type": "object", "title": LONE}}]}, "tools"),
    ("/v1/responses", {**RESPONSE, "tools": [FN], "tool_choice": {"type": "function", "name": LONE}}, "tool_choice"),
    ("/v1/responses", {**RESPONSE, "text": {"format": {"type": "json_schema", "name": LONE, "schema": {}}}}, "text"),
    ("/v1/responses", {**RESPONSE, "instructions": LONE}, "instructions"),
    ("/v1/responses", {**RESPONSE, "input": LONE}, "input"),
    ("/v1/responses", {**RESPONSE, "input": [{"role": "user", "content": [{"type": "input_text", "text": LONE}]}]},
     "input"),
    ("/v1/responses", {**RESPONSE, "previous_response_id": LONE}, "previous_response_id"),
    ("/v1/responses", {**RESPONSE, "user": LONE}, "user"),  # an ignored field is no excuse
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": LONE}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a\udfffb"}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "description": LONE}}]},
     "tools"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": [LONE]}}}}, "response_format"),
    ("/v1/chat/completions", {**CHAT, "stop": [LONE]}, "stop"),
    ("/v1/chat/completions", {**CHAT, "cache_salt": LONE}, "cache_salt"),
    ("/v1/completions", {"model": MODEL, "prompt": LONE, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1, "stop": LONE}, "stop"),
    ("/v1/messages", {**MESSAGES, "system": LONE}, "system"),
    ("/v1/messages", {**MESSAGES, "messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages"),
    ("/v1/messages", {**MESSAGES, "tools": [{"name": "f", "description": LONE, "input_schema": {}}]}, "tools"),
    ("/v1/messages", {**MESSAGES, "metadata": {"user_id": LONE}}, "metadata"),
    ("/v1/messages", {**MESSAGES, "stop_sequences": [LONE]}, "stop_sequences"),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": [{"role": "user", "content": LONE}]}, "messages"),
    ("/tokenize", {"model": MODEL, "prompt": LONE}, "prompt"),
]


@pytest.mark.parametrize("path, body, field", SURROGATE_CASES, ids=[f"{p} {f}" for p, _, f in SURROGATE_CASES])
def test_a_lone_surrogate_is_a_400_naming_the_field(plain: tuple[str, Any], path: str, body: dict[str, Any],
                                                    field: str) -> None:
    url, app = plain
    before = len(app.state.responses._items)
    response = post(f"{url}{path}", body)
    assert response.status_code == 400, response.text
    assert error_param(response) == field if not path.startswith("/v1/messages") else \
        response.json()["error"]["message"].startswith(field)
    assert "surrogate" in response.json()["error"]["message"]
    assert len(app.state.responses._items) == before  # never stored
    ok = post(f"{url}/v1/responses", {**RESPONSE, "metadata": {"a": "\U0001f600 é"}})  # a surrogate pair is fine
    assert ok.status_code == 200 and ok.json()["metadata"] == {"a": "\U0001f600 é"}
    assert httpx.get(f"{url}/v1/responses/{ok.json()['id']}").json()["metadata"] == {"a": "\U0001f600 é"}


# -- finish reasons -------------------------------------------------------------------------------
def seed_where(url: str, body: dict[str, Any], finish: str) -> int:
    """A seed whose sampled chat answer to ``body`` ends with ``finish`` (the dialects route the same
    chat request, so the same seed gives them the same answer); "stop" means EOS, not a stop string."""
    for seed in range(64):
        choice = post(f"{url}/v1/chat/completions", {**body, "temperature": 1.0, "seed": seed}).json()["choices"][0]
        if choice["finish_reason"] == finish and choice.get("stop_reason") is None:
            return seed
    raise AssertionError(f"no seed in 64 ends with {finish}")


def forced_tool(schema: dict[str, Any]) -> dict[str, Any]:
    return {"tools": [{"type": "function", "function": {"name": "f", "parameters": schema}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}}


def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": False}}}


def test_responses_finish_reasons_streamed_and_not(plain: tuple[str, Any]) -> None:
    """stop -> completed, length -> incomplete (max_output_tokens), a stop string -> completed, a
    forced call -> completed with a function_call, grammar_error -> failed with error.code
    grammar_error; the stream ends with the matching terminal event carrying the same response."""
    url, _ = plain
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 48}
    base = {"model": MODEL, "input": "a", "max_output_tokens": 48}
    stop_seed = seed_where(url, chat, "stop")
    grammar_seed = seed_where(url, {**chat, **json_schema(EXPLODING)}, "grammar_error")
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {"n": {"enum": [1, 2]}},
                                                           "required": ["n"], "additionalProperties": False}}
    cases: list[tuple[dict[str, Any], str, str | None]] = [
        ({"temperature": 1.0, "seed": stop_seed}, "completed", None),
        ({"temperature": 0, "max_output_tokens": 3}, "incomplete", None),
        ({"temperature": 0, "stop": [post(f"{url}/v1/responses", {**base, "temperature": 0, "max_output_tokens": 4})
                                     .json()["output"][0]["content"][0]["text"][2:4]]}, "completed", None),
        ({"temperature": 0, "tools": [tool], "tool_choice": "required"}, "completed", "function_call"),
        ({"temperature": 1.0, "seed": grammar_seed, "text": {"format": {"type": "json_schema", "name": "x",
                                                                         "schema": EXPLODING}}}, "failed", None),
    ]
    for extra, status, item in cases:
        whole = post(f"{url}/v1/responses", {**base, **extra}).json()
        assert whole["status"] == status, (extra, whole)
        assert whole["incomplete_details"] == ({"reason": "max_output_tokens"} if status == "incomplete" else None)
        if status == "failed":
            assert whole["error"]["code"] == "grammar_error" and whole["error"]["message"]
            assert whole["output"][0]["content"][0]["text"].startswith('{"s": "a')  # the text so far
        else:
            assert whole["error"] is None
        if item is not None:
            assert any(o["type"] == item for o in whole["output"]), whole["output"]
        streamed = events(post(f"{url}/v1/responses", {**base, **extra, "stream": True}).text)
        last = streamed[-1]
        assert last["type"] == f"response.{status}", (extra, last)
        assert {k: last["response"][k] for k in ("status", "incomplete_details", "error")} == \
            {k: whole[k] for k in ("status", "incomplete_details", "error")}
        assert httpx.get(f"{url}/v1/responses/{whole['id']}").json()["status"] == status  # stored as answered


def test_messages_stop_reasons_streamed_and_not(plain: tuple[str, Any]) -> None:
    """stop -> end_turn, length -> max_tokens, a stop string -> stop_sequence naming it, a forced call
    -> tool_use, a forced call whose grammar failed mid-answer -> an invalid_request_error (a 400, or
    an ``error`` event in a stream), never end_turn."""
    url, _ = plain
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 48}
    stop_seed = seed_where(url, chat, "stop")
    grammar_seed = seed_where(url, {**chat, **forced_tool(EXPLODING)}, "grammar_error")
    text = post(f"{url}/v1/messages", {**chat, "temperature": 0, "max_tokens": 4}).json()["content"][0]["text"]
    small = {"type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"], "additionalProperties": False}
    forced = {"tool_choice": {"type": "tool", "name": "f"}}
    cases: list[tuple[dict[str, Any], str | None, str | None]] = [
        ({"temperature": 1.0, "seed": stop_seed}, "end_turn", None),
        ({"temperature": 0, "max_tokens": 3}, "max_tokens", None),
        ({"temperature": 0, "stop_sequences": [text[2:4]]}, "stop_sequence", text[2:4]),
        ({"temperature": 0, "tools": [{"name": "f", "input_schema": small}], **forced}, "tool_use", None),
        ({"temperature": 1.0, "seed": grammar_seed, "tools": [{"name": "f", "input_schema": EXPLODING}], **forced},
         None, None),
    ]
    for extra, reason, sequence in cases:
        whole = post(f"{url}/v1/messages", {**chat, **extra})
        streamed = events(post(f"{url}/v1/messages", {**chat, **extra, "stream": True}).text)
        if reason is None:  # grammar_error
            assert whole.status_code == 400, whole.text
            assert whole.json()["error"]["type"] == "invalid_request_error"
            assert "grammar" in whole.json()["error"]["message"]
            assert streamed[-1]["type"] == "error" and streamed[-1]["error"]["type"] == "invalid_request_error"
            assert not any(e["type"] == "message_delta" for e in streamed)
            continue
        assert whole.status_code == 200
        assert (whole.json()["stop_reason"], whole.json()["stop_sequence"]) == (reason, sequence), extra
        if reason == "tool_use":
            assert whole.json()["content"][-1]["type"] == "tool_use"
        delta = next(e for e in streamed if e["type"] == "message_delta")["delta"]
        assert (delta["stop_reason"], delta["stop_sequence"]) == (reason, sequence), extra
        assert streamed[-1]["type"] == "message_stop"


# -- the speculation extension --------------------------------------------------------------------
@pytest.fixture(scope="module")
def drafted(tiny_llama: Path, tiny_draft: Path) -> Iterator[str]:
    engine = Engine(EngineConfig.from_options(model=str(tiny_llama), dtype="float32", device="cpu", max_batch_size=2,
                                              draft_model=str(tiny_draft), spec_length=3))
    server = BackgroundServer(create_app(engine, MODEL, None)).start()
    yield server.url
    server.stop()


def test_speculation_is_validated_and_honoured_on_the_dialects(drafted: str) -> None:
    bodies = {"/v1/responses": {"model": MODEL, "input": "def fib(n):", "max_output_tokens": 16, "temperature": 0},
              "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "def fib(n):"}],
                               "max_tokens": 16, "temperature": 0}}
    for path, body in bodies.items():
        for bad, where in (({"enabled": "nope"}, "speculation.enabled"), ({"enabled": 1}, "speculation.enabled"),
                           ({"max_draft_tokens": 0}, "speculation.max_draft_tokens"),
                           ({"enabeld": False}, "speculation.enabeld")):
            refused = post(f"{drafted}{path}", {**body, "speculation": bad})
            assert refused.status_code == 400 and where in refused.json()["error"]["message"], (path, refused.text)
        default = post(f"{drafted}{path}", body).json()
        assert default["speculative"]["proposed_tokens"] > 0, path
        off = post(f"{drafted}{path}", {**body, "speculation": {"enabled": False}}).json()
        assert off.get("speculative") is None or off["speculative"]["proposed_tokens"] == 0, (path, off)
        capped = post(f"{drafted}{path}", {**body, "speculation": {"max_draft_tokens": 1}}).json()
        spec = capped["speculative"]
        assert 0 < spec["proposed_tokens"] <= spec["num_rounds"], (path, spec)
        # The output is the same either way.
        text = (lambda r: r["output"][0]["content"][0]["text"]) if path == "/v1/responses" else \
            (lambda r: r["content"][0]["text"])
        assert text(default) == text(off) == text(capped)
