"""The request models' limits and tool validation (issue 33), on the models alone: each limit hit is a
400 naming its field, just under it passes."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
from pydantic import ValidationError

from infer.server.errors import APIError
from infer.server.protocol import ChatCompletionRequest, CompletionRequest, RequestLimits
from infer.server.tools import forced_schema, functions, parse_calls

LIMITS = RequestLimits(max_logit_bias=3, max_stop=2, max_logprob_entries=1000)


def refused(body: dict[str, Any], param: str, limits: RequestLimits = LIMITS) -> str:
    with pytest.raises(APIError) as err:
        request = CompletionRequest.model_validate({"prompt": "x", **body})
        request.check_supported(limits)
        request.sampling_params(16)
    assert err.value.status == 400 and err.value.param == param, (err.value.param, err.value.message)
    return err.value.message


def test_caps_refuse_past_the_limit_and_admit_at_it() -> None:
    CompletionRequest.model_validate({"prompt": "x", "logit_bias": {"1": 1, "2": 1, "3": 1},
                                      "stop": ["a", "b"]}).check_supported(LIMITS)
    assert "--max-logit-bias" in refused({"logit_bias": {"1": 1, "2": 1, "3": 1, "4": 1}}, "logit_bias")
    assert "--max-stop" in refused({"stop": ["a", "b", "c"]}, "stop")
    refused({"stop": ["x" * 1001]}, "stop")
    request = CompletionRequest.model_validate({"prompt": "x", "logprobs": 9, "max_tokens": 100})
    request.check_logprob_entries(request.sampling_params(16), 100, LIMITS)  # 100 x 10 = 1000: at the limit
    with pytest.raises(APIError, match="--max-logprob-entries") as err:
        request.check_logprob_entries(request.sampling_params(16), 101, LIMITS)
    assert err.value.param == "logprobs"


@pytest.mark.parametrize("key", ["²", "--5", "٣", "-1", "1.0", " 1", "99999999999"])
def test_logit_bias_keys_are_ascii_decimal_token_ids(key: str) -> None:
    assert "not a token id" in refused({"logit_bias": {key: 1}}, "logit_bias", RequestLimits())


def test_request_limit_flags_default_to_the_models_defaults() -> None:
    from infer.server.cli import REQUEST_LIMIT_DEFAULTS

    assert {f.name: getattr(RequestLimits(), f.name) for f in fields(RequestLimits)} == REQUEST_LIMIT_DEFAULTS


def chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(("body", "where"), [
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": ["f"]}}}, "tool_choice"),
    ({"tools": [TOOL], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"arguments": "{}"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": ["1"], "function": {"name": "f"}}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[" * 5000}}]}]},
     "messages"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "9" * 5000}}]}]},
     "messages"),
])
def test_tool_fields_are_validated_by_the_model(body: dict[str, Any], where: str) -> None:
    with pytest.raises(ValidationError) as err:
        chat(**body)
    assert err.value.errors()[0]["loc"][0] == where


def test_a_valid_tool_history_passes_and_forced_refs_are_moved_with_their_defs() -> None:
    request = chat(messages=[{"role": "user", "content": "hi"},
                             {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{}"}}]}],
                   tools=[TOOL], tool_choice={"type": "function", "function": {"name": "f"}})
    assert request.template_messages()[1]["tool_calls"][0]["function"]["name"] == "f"
    parameters = {"$ref": "#/$defs/p", "$defs": {"p": {"type": "object", "properties": {"x": {"$ref": "#/$defs/q"}}},
                                                 "q": {"type": "integer"}}}
    tools = [{"type": "function", "function": {"name": "g", "parameters": parameters}}]
    schema = forced_schema(functions(tools), "required", True)
    assert schema is not None and schema["$defs"]["g"]["$defs"]["p"]["properties"]["x"] == {"$ref": "#/$defs/g/$defs/q"}
    assert schema["items"]["properties"]["arguments"] == {"$ref": "#/$defs/g"}


def test_the_tool_call_parser_reads_no_deep_json() -> None:
    known = {"f": {"name": "f"}}
    assert parse_calls("[" * 5000, None, known) == ("[" * 5000, [])
    assert parse_calls('{"name": "f", "arguments": ' + "[" * 100 + "]" * 100 + "}", None, known)[1] == []
    assert parse_calls('{"name": "f", "arguments": {"a": 1}}', None, known)[1][0].arguments == {"a": 1}
