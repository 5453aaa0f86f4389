"""Tool calling for /v1/chat/completions: tools into the prompt, tool calls out of the answer.

* The prompt: ``tools`` go to the chat template's ``tools`` variable. A template that does not use
  it gets the tools as a system message describing them and the JSON a call is written as. Earlier
  assistant ``tool_calls`` and ``role: "tool"`` messages go through the template when it renders
  them (it mentions ``tool_calls``); otherwise they are folded into text (a call as its JSON in the
  assistant's content, a result as a user message), never dropped.
* ``tool_choice``: ``none`` leaves the answer alone; ``required`` and a named function constrain it
  with the grammar engine to a JSON list of calls ``[{"name": ..., "arguments": {...}}]`` whose
  arguments follow each function's ``parameters`` schema (one call when ``parallel_tool_calls`` is
  false, or the function named); ``auto`` parses the answer afterwards.
* Parsers: Qwen2.5/Qwen3's ``<tool_call>{...}</tool_call>`` blocks, and JSON (Llama 3.x's
  ``{"name": ..., "parameters": ...}``, optionally after ``<|python_tag|>``, or ``"arguments"``; an
  object or a list of them) as the fallback. Which is tried first follows the template (one that
  writes ``<tool_call>`` is Qwen's).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from infer.sampling.grammar import json_depth
from infer.server.errors import bad_request

_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
MAX_JSON_DEPTH = 64  # tool call arguments, in a request or in the model's answer


def loads_bounded(text: str) -> Any:
    """``json.loads`` that refuses (ValueError) what would make it recurse deeply or work hard:
    nesting deeper than MAX_JSON_DEPTH, and (as Python does) integers of more than 4300 digits."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise ValueError(f"nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("nested too deeply") from None


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}
        if index is not None:
            out["index"] = index
        return out


def functions(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """name -> function definition; 400 naming ``tools`` for anything but well-formed functions."""
    found: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type", "function") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}",
                              param="tools")
        parameters = fn.get("parameters", {"type": "object"})
        if not isinstance(parameters, dict):
            raise bad_request(f"tool {fn['name']!r}: parameters must be a JSON Schema object", param="tools")
        found[fn["name"]] = {**fn, "parameters": parameters}
    return found


def forced_schema(fns: dict[str, dict[str, Any]], choice: Any, parallel: bool) -> dict[str, Any] | None:
    """The JSON Schema an answer must follow for ``tool_choice`` (None: not constrained)."""
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        names = list(fns)
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in fns:
            raise bad_request(f"tool_choice names {name!r}, which is not in tools", param="tool_choice")
        names, parallel = [name], False
    else:
        raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                          "{\"name\": ...}}", param="tool_choice")
    # A function's parameters that use $refs ("#/$defs/x", relative to the parameters) move under the
    # list's $defs, their references rewritten to point there.
    defs: dict[str, Any] = {}
    arguments = {}
    for n in names:
        text = json.dumps(fns[n]["parameters"])
        if _LOCAL_REF not in text:
            arguments[n] = fns[n]["parameters"]
            continue
        pointer = n.replace("~", "~0").replace("/", "~1")
        defs[n] = json.loads(text.replace(_LOCAL_REF, f'"$ref": "#/$defs/{pointer}'))
        arguments[n] = {"$ref": f"#/$defs/{pointer}"}
    calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": arguments[n]},
              "required": ["name", "arguments"], "additionalProperties": False} for n in names]
    item = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {"type": "array", "items": item, "minItems": 1, **({} if parallel else {"maxItems": 1}),
            **({"$defs": defs} if defs else {})}


# A local reference in json.dumps output ("$ref" as a key: inside a string its quotes are escaped).
_LOCAL_REF = '"$ref": "#'


def prompt_messages(messages: list[dict[str, Any]], tools: list[Any] | None, template: str | None) -> tuple[
        list[dict[str, Any]], list[Any] | None]:
    """Messages and tools as the template gets them (see the module docstring)."""
    template = template or ""
    out = []
    called: dict[Any, str] = {}  # tool call id -> "call N", its place in its assistant message's list
    for message in messages:
        message = dict(message)
        calls = message.get("tool_calls")
        if calls:
            message["tool_calls"] = [_template_call(c) for c in calls]
            called |= {c.get("id"): f"call {i}" for i, c in enumerate(message["tool_calls"], 1)}
            if "tool_calls" not in template:
                listed = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                          for c in message.pop("tool_calls")]
                message["content"] = ((message.get("content") or "") + "\n" + json.dumps(listed)).strip()
        if message.get("role") == "tool" and "tool_calls" not in template:
            # Named by its call's place in the folded list, not by its id: the server's ids are random,
            # and an id in the prompt changes a greedy answer from run to run (SmolLM2 answered another
            # tool call instead of the result for 4 of 40 random ids).
            label = called.get(message.get("tool_call_id"), "call")
            message = {"role": "user", "content": f"Tool result ({label}): {message.get('content') or ''}"}
        out.append(message)
    if tools and "tools" not in template:
        described = "\n".join(json.dumps(t.get("function", t)) for t in tools)
        system = ("You may call these functions:\n" + described + "\nTo call functions, answer with only a JSON "
                  'list: [{"name": <function name>, "arguments": <arguments object>}].')
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}"}
        else:
            out.insert(0, {"role": "system", "content": system})
        return out, None
    return out, tools or None


def _template_call(call: Any) -> dict[str, Any]:
    """An OpenAI tool call with its arguments as an object (templates write them with tojson)."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise bad_request("an assistant message's tool_calls must be OpenAI tool calls", param="messages")
    fn = dict(call["function"])
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = loads_bounded(arguments) if arguments.strip() else {}
        except ValueError as err:
            raise bad_request(f"tool call {fn.get('name')!r}: arguments are not JSON ({err})"[:300],
                              param="messages") from None
    return {**call, "function": {**fn, "arguments": arguments}}


def parse_calls(text: str, template: str | None, known: dict[str, dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    """The answer's content outside tool calls (None when empty) and the calls of known functions."""
    parsers = [_qwen, _json] if "<tool_call>" in (template or "") else [_json, _qwen]
    for parse in parsers:
        content, calls = parse(text)
        calls = [c for c in calls if c.name in known]
        if calls:
            return (content.strip() or None) if content is not None else None, calls
    return text, []


def _qwen(text: str) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for block in _QWEN_CALL.findall(text):
        calls += _calls_of(_loads(block))
    return _QWEN_CALL.sub("", text), calls


def _json(text: str) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    return None, _calls_of(_loads(body))


def _loads(text: str) -> Any:
    try:
        return loads_bounded(text)
    except ValueError:  # not JSON, or too deep or long to read: not a call
        return None


def _calls_of(value: Any) -> list[ToolCall]:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = _loads(arguments)
        if not isinstance(arguments, dict):
            return []
        calls.append(ToolCall(item["name"], arguments))
    return calls
