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
* An answer that ends inside a call (cut by ``max_tokens``) keeps it: a call whose arguments object
  is whole is a whole call, though its wrapper (``}``, ``]``, ``</tool_call>``) is missing; one cut
  inside its arguments is a cut call (``ToolCall.cut``: its arguments as far as they go, not JSON,
  as OpenAI returns such a call with ``finish_reason: "length"``). The calls are read with the
  partial-JSON parser the stream reads them with (server/partial_json.py), so a streamed answer's
  pieces join to exactly these calls wherever the answer was cut.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from infer.sampling.grammar import json_depth
from infer.server import partial_json
from infer.server.errors import bad_request

_QWEN_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
QWEN_OPEN, QWEN_CLOSE, PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
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
    """A call of a known function. ``cut``: the answer ended inside its arguments, which are then
    ``cut`` (their ``json.dumps`` text as far as it was generated, not JSON) and ``arguments`` the
    members settled so far (as a partial-JSON reader gives them)."""

    name: str
    arguments: dict[str, Any]
    cut: str | None = None

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments) if self.cut is None else self.cut

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments_json}}
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
    """The answer's content outside tool calls (None when empty) and the calls of known functions,
    a call the answer ends inside included (see the module docstring)."""
    parsers = [_qwen, _json] if QWEN_OPEN in (template or "") else [_json, _qwen]
    for parse in parsers:
        content, calls = parse(text, known)
        if calls:
            # Only trailing whitespace goes: what came before a call was streamed as it came.
            return (content.rstrip(partial_json.WS) or None) if content is not None else None, calls
    return text, []


def finish_reason(calls: list[ToolCall], reason: str | None) -> str | None:
    """The answer's finish_reason: ``tool_calls`` when it made calls and all are whole, else the
    engine's (``length`` for a call cut short by max_tokens, as OpenAI answers)."""
    return "tool_calls" if calls and all(c.cut is None for c in calls) else reason


def arguments_object(arguments: str) -> dict[str, Any]:
    """A call's arguments string as an object; a cut call's (not JSON) as far as they go, as a
    partial-JSON reader gives them (the anthropic SDK's, reading a streamed tool input: the same
    object streamed and not); {} for none."""
    return partial_json.partial_object(arguments, MAX_JSON_DEPTH)


def calls_in(body: str, known: dict[str, dict[str, Any]]) -> list[ToolCall] | None:
    """The known calls that ``body``, the start of a JSON call (an object or a list of them), settles
    so far, in order; None when it is not the start of JSON."""
    try:
        return _node_calls(partial_json.value(body, MAX_JSON_DEPTH), known)
    except ValueError:  # not JSON, or a number json.loads refuses (over 4300 digits)
        return None


def open_block(inner: str) -> str:
    """The JSON of a ``<tool_call>`` block not closed (yet): what follows the tag, without the
    whitespace before it or the start of a closing tag after it (``</tool_ca`` that may become one,
    so it is never read as the JSON's own characters)."""
    for k in range(min(len(inner), len(QWEN_CLOSE) - 1), 0, -1):
        if QWEN_CLOSE.startswith(inner[-k:]):
            inner = inner[:-k]
            break
    return inner.lstrip(partial_json.WS)


def _node_calls(node: partial_json.Node | None, known: dict[str, dict[str, Any]]) -> list[ToolCall]:
    """The known calls a parsed call object or list settles, up to the first whose name is not yet
    whole (an unknown function's call is skipped once it is whole)."""
    if node is None:
        return []
    calls = []
    for item in node.items if node.kind == "arr" else [node]:
        name = item.member("name") if item.kind == "obj" else None
        if name is None or name.kind != "str" or not name.complete:
            break
        if name.text not in known:
            if item.complete:
                continue
            break
        arguments = item.member("arguments") or item.member("parameters")
        if arguments is not None and arguments.kind == "obj":
            written = partial_json.canonical(arguments)
            calls.append(ToolCall(name.text, json.loads(written)) if arguments.complete else
                         ToolCall(name.text, partial_json.partial_value(arguments), cut=written))
        elif arguments is None and item.complete:
            calls.append(ToolCall(name.text, {}))
        else:
            # Arguments as a JSON string (read once whole), or not yet begun.
            loaded = _loads(arguments.text) if arguments is not None and arguments.kind == "str" and \
                arguments.complete else None
            calls.append(ToolCall(name.text, loaded) if isinstance(loaded, dict) else ToolCall(name.text, {}, cut=""))
    return calls


def _qwen(text: str, known: dict[str, dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    calls, end = [], 0
    for match in _QWEN_CALL.finditer(text):
        calls += [c for c in _calls_of(_loads(match.group(1))) if c.name in known]
        end = match.end()
    # A block still open at the end: the answer was cut inside it.
    start = text.find(QWEN_OPEN, end)
    cut = calls_in(open_block(text[start + len(QWEN_OPEN):]), known) if start != -1 else None
    if cut:
        return _QWEN_CALL.sub("", text[:start]), calls + cut
    return _QWEN_CALL.sub("", text), calls


def _json(text: str, known: dict[str, dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    body = text.strip().removeprefix(PYTHON_TAG).strip()
    calls = [c for c in _calls_of(_loads(body)) if c.name in known]
    if calls:
        return None, calls
    # Cut short inside its JSON: the calls settled so far (whitespace at the end may be a string's).
    body = text.lstrip().removeprefix(PYTHON_TAG).lstrip()
    try:
        node = partial_json.value(body, MAX_JSON_DEPTH) if body[:1] in ("{", "[") else None
        return None, [] if node is None or node.complete else _node_calls(node, known)
    except ValueError:  # not JSON, or a number json.loads refuses (over 4300 digits)
        return None, []


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
