"""Hostile grammars, schemas and tool fields against one live ``infer serve`` process (issue 33).

Each attack runs beside an innocent greedy stream whose tokens must equal an unattacked run; after
each, the process must be alive and /health answer. The server is a real subprocess: a crash in the
grammar library (the segmentation faults this issue found) would kill it, not the test run.
Before the fixes, the chain grammars killed the process and the rest answered 500. Then bounded
fuzzing (hypothesis) of grammar and schema inputs: every answer is a 200 or a 400 naming the field.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helpers import gbnf_chain, lark_chain, ref_chain, served_models, wait_serving
from infer.server.background import bind_socket

MODEL = "tiny"
TIMEOUT_S = 60.0
INNOCENT = {"model": MODEL, "prompt": "def add(a, b):\n    return", "max_tokens": 32, "ignore_eos": True,
            "temperature": 0, "stream": True}
C, CH = "/v1/completions", "/v1/chat/completions"
P = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
M = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "temperature": 0}


def nested_any_of(depth: int, width: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [schema] + [{"const": f"c{i}"} for i in range(width - 1)]}
    return schema


def tool(parameters: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def history(call: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [call]}]


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


# name -> (path, body, expected): a status and the error's param, or 200 and the finish reasons allowed.
FORCED_F = {"type": "function", "function": {"name": "f"}}
CASES: dict[str, tuple[str, dict[str, Any], tuple[int, Any]]] = {
    # Killed the process (stack overflow in llguidance): now compiled on a deep stack, or over a limit.
    "lark chain of 3000 rules": (C, {**P, "guided_grammar": lark_chain(3000)}, (200, {"stop", "length"})),
    "gbnf chain of 4000 rules": (C, {**P, "guided_grammar": gbnf_chain(4000)}, (200, {"stop", "length"})),
    "$ref chain of 3000": (CH, {**M, "response_format": schema_format(ref_chain(3000))}, (400, "response_format")),
    # (On the tiny model's 512-token context the tool's description alone is too long for the prompt.)
    "tool $ref chain of 3000": (CH, {**M, "tools": [tool(ref_chain(3000))], "tool_choice": FORCED_F},
                                (400, {"tools", "messages"})),
    # 500s that are now 400s naming the field.
    "tool_choice name a list": (CH, {**M, "tools": [tool({"type": "object"})],
                                     "tool_choice": {"type": "function", "function": {"name": ["f"]}}},
                                (400, "tool_choice")),
    "tool call without a name": (CH, {**M, "messages": history({"id": "1", "type": "function",
                                                                "function": {"arguments": "{}"}})}, (400, "messages")),
    "tool call with a list id": (CH, {**M, "messages": history({"id": ["1"], "type": "function",
                                                                "function": {"name": "f", "arguments": "{}"}})},
                                 (400, "messages")),
    "arguments [ x 5000": (CH, {**M, "messages": history({"id": "1", "function": {"name": "f",
                                                                                  "arguments": "[" * 5000}})},
                           (400, "messages")),
    "arguments a 5000-digit integer": (CH, {**M, "messages": history(
        {"id": "1", "function": {"name": "f", "arguments": '{"a": ' + "9" * 5000 + "}"}})}, (400, "messages")),
    "guided_json [ x 50000": (C, {**P, "guided_json": "[" * 50000}, (400, "guided_json")),
    "nested 50 x 50 anyOf": (C, {**P, "guided_json": nested_any_of(50, 50)}, (400, "guided_json")),
    "[^\\s\\S] with ignore_eos": (C, {**P, "guided_regex": r"[^\s\S]", "ignore_eos": True}, (400, "guided_regex")),
    "a pure $ref cycle": (CH, {**M, "response_format": schema_format(
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}})},
        (400, "response_format")),
    # Hit llguidance's per-step limits after the first token (a 500 dumping its state): found by the
    # compiler's walk at admission.
    "start: \"a\" start": (C, {**P, "guided_grammar": 'start: "a" start'}, (400, "guided_grammar")),
    "a{1000000}": (C, {**P, "guided_regex": "a{1000000}"}, (400, "guided_regex")),
    "a $ref that requires itself": (CH, {**M, "response_format": schema_format(
        {"$ref": "#/$defs/a", "$defs": {"a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}},
                                              "required": ["a"]}}})}, (400, "response_format")),
    # One that fails past the walk ends its request with the text so far and a clear finish reason.
    "an unproductive rule after 40 letters": (C, {**P, "max_tokens": 64, "guided_grammar":
                                                  'start: /[a-z]{40}/ loop\nloop: "a" loop'},
                                              (200, {"grammar_error"})),
    # The tool-call parser meets deep JSON (it raised RecursionError: a 500, a cut stream).
    "tools auto + \\[{300}": (CH, {**M, "max_tokens": 320, "tools": [tool({"type": "object"})], "tool_choice": "auto",
                                   "guided_regex": r"\[{300}"}, (200, {"stop", "length"})),
    "tools auto + \\[{300}, streamed": (CH, {**M, "max_tokens": 320, "stream": True, "tools": [tool({"type": "object"})],
                                             "tool_choice": "auto", "guided_regex": r"\[{300}"},
                                        (200, {"stop", "length"})),
    # Clear errors with the right param.
    "logit_bias out of the vocabulary": (C, {**P, "logit_bias": {"49152": 5}}, (400, "logit_bias")),
    "logit_bias key ²": (C, {**P, "logit_bias": {"²": 5}}, (400, "logit_bias")),
    "logit_bias key --5": (C, {**P, "logit_bias": {"--5": 5}}, (400, "logit_bias")),
    "logit_bias key ٣": (C, {**P, "logit_bias": {"٣": 5}}, (400, "logit_bias")),
    "logit_bias of every token": (C, {**P, "logit_bias": {str(i): 1 for i in range(5000)}}, (400, "logit_bias")),
    "65000 stop strings": (C, {**P, "stop": [f"s{i}" for i in range(65000)]}, (400, "stop")),
    "echo + logprobs 20 x n 8": (C, {**P, "prompt": "word " * 2000, "echo": True, "logprobs": 20, "n": 8},
                                 (400, "logprobs")),
    "a Lark grammar with ::=": (C, {**P, "guided_grammar": 'start: "a" | "::="'}, (200, {"stop", "length"})),
}


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[tuple[str, subprocess.Popen[str], str]]:
    """One ``infer serve`` process for the module: (url, process, the innocent stream's unattacked text)."""
    with bind_socket("127.0.0.1", 0) as probe:
        port = int(probe.getsockname()[1])
    cmd = [sys.executable, "-m", "infer", "serve", "--model", str(tiny_llama), "--dtype", "float32", "--device",
           "cpu", "--backend", "torch", "--port", str(port), "--served-model-name", MODEL, "--max-batch-size", "4"]
    env = {k: v for k, v in os.environ.items() if k != "INFER_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_serving(proc, port)
        url = f"http://127.0.0.1:{port}"
        yield url, proc, stream_text(url, INNOCENT)
    finally:
        proc.kill()  # nothing to drain
        proc.wait(timeout=30)


def stream_text(url: str, body: dict[str, Any]) -> str:
    pieces, lines = [], []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
            lines += [line] if line else []
    assert lines[-1] == "data: [DONE]", lines[-3:]
    return "".join(pieces)


def attack(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any] | None, list[str]]:
    """(status, JSON body or None when streamed, SSE data lines when streamed)."""
    if body.get("stream"):
        with httpx.stream("POST", f"{url}{path}", json=body, timeout=TIMEOUT_S) as r:
            data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
            return r.status_code, None, data
    r = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT_S)
    return r.status_code, r.json(), []


def check_alive(url: str, proc: subprocess.Popen[str]) -> None:
    assert proc.poll() is None, f"the server died: {proc.stderr.read()[-2000:] if proc.stderr else ''}"
    assert httpx.get(f"{url}/health", timeout=10).json() == {"status": "ok"}


@pytest.mark.parametrize("name", list(CASES))
def test_attack_gets_a_clear_answer_and_hurts_no_one(server: tuple[str, subprocess.Popen[str], str],
                                                     name: str) -> None:
    url, proc, expected = server
    path, body, (status, allowed) = CASES[name]
    innocent: list[str] = []
    runner = threading.Thread(target=lambda: innocent.append(stream_text(url, INNOCENT)))
    runner.start()
    got, answer, events = attack(url, path, body)
    runner.join(timeout=TIMEOUT_S)
    check_alive(url, proc)
    assert innocent == [expected], "the innocent stream changed"
    if status == 400:
        assert got == 400 and answer is not None, (got, answer)
        error = answer["error"]
        params = allowed if isinstance(allowed, set) else {allowed}
        assert error["param"] in params and error["message"] and "<state>" not in error["message"], error
        return
    assert got == 200, (got, answer, events[-2:])
    if events:  # streamed: whole, then [DONE]
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events), events[-3:]
        finishes = [c["finish_reason"] for e in events[:-1] for c in json.loads(e)["choices"] if c["finish_reason"]]
    else:
        assert answer is not None
        finishes = [c["finish_reason"] for c in answer["choices"]]
    assert finishes and set(finishes) <= allowed, finishes


# -- bounded fuzzing ----------------------------------------------------------------------------------
GRAMMAR_PIECES = ["start", ":", "::=", "root", "a", "b", "r1", " ", "\n", '"x"', '"', "|", "(", ")", "*", "+", "?",
                  "{2,3}", "/[a-z]/", "[", "]", "%ignore", "#", "\\", "%llguidance {}", "::"]
SCHEMA_KEYS = ["type", "properties", "items", "anyOf", "allOf", "oneOf", "$ref", "$defs", "enum", "const",
               "required", "pattern", "minItems", "maxItems", "minLength", "additionalProperties", "not", "format"]
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.sampled_from(
        ["string", "integer", "object", "array", "null", "#", "#/$defs/a", "#/properties/a", "a", "^a+$", "date"]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.sampled_from(SCHEMA_KEYS + ["a"]), children,
                                                                      max_size=3),
    max_leaves=12)
FUZZ = settings(max_examples=15, deadline=None, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def assert_clear(url: str, proc: subprocess.Popen[str], path: str, body: dict[str, Any], field: str) -> None:
    r = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT_S)
    check_alive(url, proc)
    assert r.status_code in (200, 400), (r.status_code, r.text[:300], body)
    if r.status_code == 400:
        error = r.json()["error"]
        assert error["param"] == field and "<state>" not in error["message"], (error, body)
    else:
        assert all(c["finish_reason"] in ("stop", "length", "grammar_error") for c in r.json()["choices"])


def test_fuzzed_grammars_get_200_or_a_400_naming_the_field(server: tuple[str, subprocess.Popen[str], str]) -> None:
    url, proc, _ = server

    @FUZZ
    @given(st.lists(st.sampled_from(GRAMMAR_PIECES), min_size=1, max_size=24).map("".join))
    def run(grammar: str) -> None:
        assert_clear(url, proc, C, {**P, "max_tokens": 4, "guided_grammar": grammar}, "guided_grammar")

    run()


def test_fuzzed_schemas_get_200_or_a_400_naming_the_field(server: tuple[str, subprocess.Popen[str], str]) -> None:
    url, proc, _ = server

    @FUZZ
    @given(st.dictionaries(st.sampled_from(SCHEMA_KEYS), JSON_VALUES, min_size=1, max_size=4))
    def run(schema: dict[str, Any]) -> None:
        assert_clear(url, proc, C, {**P, "max_tokens": 4, "guided_json": schema}, "guided_json")

    run()


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done(tiny_llama: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever fails while a stream's chunks are built (here the tool-call parser), the client gets an
    error event and [DONE], not a cut connection."""
    import infer.server.app as app_module

    def broken(*_args: Any) -> Any:
        raise RecursionError("a parser that recursed too deeply")

    monkeypatch.setattr(app_module, "parse_calls", broken)
    with served_models(tiny_llama, {"plain": {}}, max_batch_size=2) as urls:
        body = {**M, "stream": True, "tools": [tool({"type": "object"})], "tool_choice": "auto"}
        status, _, events = attack(urls["plain"], CH, body)
        assert status == 200 and events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert error["code"] == "internal_error" and "RecursionError" in error["message"], error
        assert httpx.get(f"{urls['plain']}/health", timeout=10).status_code == 200


# -- under speculation (issue 33 parts 2 and 3: the specgrammar branch) -------------------------------
def start_server(model: Path, *flags: str) -> tuple[str, subprocess.Popen[str]]:
    with bind_socket("127.0.0.1", 0) as probe:
        port = int(probe.getsockname()[1])
    cmd = [sys.executable, "-m", "infer", "serve", "--model", str(model), "--dtype", "float32", "--device", "cpu",
           "--backend", "torch", "--port", str(port), "--served-model-name", MODEL, *flags]
    env = {k: v for k, v in os.environ.items() if k != "INFER_API_KEY"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    wait_serving(proc, port)
    return f"http://127.0.0.1:{port}", proc


@pytest.mark.parametrize("speculator", ["ngram", "suffix"])
def test_speculative_servers_keep_grammars_and_seeds(server: tuple[str, subprocess.Popen[str], str],
                                                     tiny_llama: Path, speculator: str) -> None:
    plain_url = server[0]
    url, proc = start_server(tiny_llama, "--speculator", speculator)
    try:
        # Grammar + ignore_eos: was a 500 (rollback: 1 > 0) under speculation, 200 on plain.
        body = {**P, "ignore_eos": True, "guided_regex": "ab"}
        plain = httpx.post(f"{plain_url}{C}", json=body, timeout=TIMEOUT_S)
        spec = httpx.post(f"{url}{C}", json=body, timeout=TIMEOUT_S)
        assert plain.status_code == spec.status_code == 200, spec.text[:300]
        assert spec.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
        # A seeded request gives one text however often it is sent (the suffix tree grows between them).
        seeded = {**P, "max_tokens": 24, "temperature": 1, "seed": 7}
        texts = {httpx.post(f"{url}{C}", json=seeded, timeout=TIMEOUT_S).json()["choices"][0]["text"] for _ in range(4)}
        assert len(texts) == 1, texts
        # Sampled json_schema with n = 16: valid JSON every time.
        person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
                  "required": ["name", "age"], "additionalProperties": False}
        r = httpx.post(f"{url}{CH}", json={**M, "max_tokens": 64, "temperature": 1, "n": 16,
                                           "response_format": schema_format(person)}, timeout=TIMEOUT_S)
        assert r.status_code == 200, r.text[:300]
        for choice in r.json()["choices"]:
            if choice["finish_reason"] == "stop":
                assert set(json.loads(choice["message"]["content"])) == {"name", "age"}
        check_alive(url, proc)
    finally:
        proc.kill()
        proc.wait(timeout=30)
