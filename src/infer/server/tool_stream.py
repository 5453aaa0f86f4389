"""Tool calls streamed as they are generated: each call's name once it is known, then its
arguments piece by piece, for the same formats ``tools.parse_calls`` reads (Qwen's
``<tool_call>`` blocks, and JSON calls: an object or a list, optionally after ``<|python_tag|>``).

Arguments are sent as the text ``json.dumps`` gives the finished call's arguments, so the pieces
join to exactly the ``arguments`` of the non-streamed answer: the model's partial JSON is parsed
as far as it goes and re-written canonically (a string's characters as they come, a number or
literal once it is whole). At the end the finished answer is parsed as the non-streamed path
parses it and only what is missing is sent. A call is announced once its function's name is whole
and known; text that may still turn out to be a call (a JSON answer, a ``<tool_call>`` block whose
call is not yet known) is held back until that is settled, at the latest when the answer is done.
An answer whose call breaks off or turns out malformed (cut by ``max_tokens``, invalid JSON) may
have announced it already: the non-streamed answer has no call there, only text.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from infer.sampling.grammar import json_depth
from infer.server.tools import MAX_JSON_DEPTH, ToolCall

_OPEN, _CLOSE, _PYTHON_TAG = "<tool_call>", "</tool_call>", "<|python_tag|>"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # what json.loads accepts
_WS = " \t\n\r"


class _Invalid(Exception):
    """The text is not (a prefix of) JSON."""


@dataclass
class _Node:
    """A JSON value parsed from a prefix: ``kind`` obj/arr/str/atom, ``complete`` once it is closed."""

    kind: str
    complete: bool = False
    text: str = ""  # str: the characters decoded so far; atom: its raw text
    members: list[tuple[_Node, _Node | None]] = field(default_factory=list)  # obj: (key, value) pairs
    items: list[_Node] = field(default_factory=list)  # arr

    def member(self, name: str) -> _Node | None:
        found = None
        for key, value in self.members:
            if key.complete and key.text == name:
                found = value
        return found


def _parse(text: str, i: int) -> tuple[_Node | None, int]:
    """The value starting at ``text[i]`` (None when nothing of it is there yet) and where it ends."""
    while i < len(text) and text[i] in _WS:
        i += 1
    if i == len(text):
        return None, i
    c = text[i]
    if c == '"':
        return _string(text, i)
    if c == "{":
        return _container(text, i + 1, _Node("obj"), "}")
    if c == "[":
        return _container(text, i + 1, _Node("arr"), "]")
    for literal in _LITERALS:
        if text.startswith(literal, i):
            return _Node("atom", True, literal), i + len(literal)
        if literal.startswith(text[i:i + len(literal)]) and i + len(literal) > len(text):
            return _Node("atom"), len(text)  # a literal still being written
    j = i
    while j < len(text) and text[j] in "0123456789+-.eE":
        j += 1
    if j == len(text):  # a number that may go on
        return _Node("atom"), j
    if not _NUMBER.fullmatch(text, i, j):
        raise _Invalid
    return _Node("atom", True, text[i:j]), j


def _string(text: str, i: int) -> tuple[_Node, int]:
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == '"':
            return _Node("str", True, json.loads(text[i:j + 1])), j + 1
        if c == "\\":
            j += 2
        elif c < " ":
            raise _Invalid  # json.loads refuses control characters in strings
        else:
            j += 1
    # Unfinished: the characters decoded so far (an escape sequence only once it is whole).
    body = text[i + 1:]
    for cut in range(0, 7):
        try:
            return _Node("str", False, json.loads('"' + body[:len(body) - cut] + '"')), len(text)
        except json.JSONDecodeError:
            continue
    raise _Invalid


def _container(text: str, i: int, node: _Node, close: str) -> tuple[_Node, int]:
    first = True
    while True:
        while i < len(text) and text[i] in _WS:
            i += 1
        if i == len(text):
            return node, i
        if text[i] == close and first:
            node.complete = True
            return node, i + 1
        if not first:
            if text[i] == close:
                node.complete = True
                return node, i + 1
            if text[i] != ",":
                raise _Invalid
            i += 1
        first = False
        if node.kind == "arr":
            value, i = _parse(text, i)
            if value is None:
                return node, i
            node.items.append(value)
            if not value.complete:
                return node, i
            continue
        while i < len(text) and text[i] in _WS:
            i += 1
        if i == len(text):
            return node, i
        if text[i] != '"':
            raise _Invalid
        key, i = _string(text, i)
        if not key.complete:
            node.members.append((key, None))
            return node, i
        while i < len(text) and text[i] in _WS:
            i += 1
        if i == len(text):
            node.members.append((key, None))
            return node, i
        if text[i] != ":":
            raise _Invalid
        value, i = _parse(text, i + 1)
        node.members.append((key, value))
        if value is None or not value.complete:
            return node, i


def _canonical(node: _Node) -> str:
    """The prefix of ``json.dumps`` of the finished value that ``node`` (a parsed prefix) settles."""
    if node.kind == "str":
        return json.dumps(node.text)[: None if node.complete else -1]
    if node.kind == "atom":
        return json.dumps(json.loads(node.text)) if node.complete else ""
    if node.kind == "arr":
        inner = ", ".join(_canonical(item) for item in node.items)
        return "[" + inner + ("]" if node.complete else "")
    parts = []
    for key, value in node.members:
        if not key.complete or value is None:
            parts.append(_canonical(key))
        else:
            parts.append(f"{_canonical(key)}: {_canonical(value)}")
    return "{" + ", ".join(parts) + ("}" if node.complete else "")


def _value(text: str) -> _Node | None:
    """The JSON value ``text`` begins (None: nothing yet); _Invalid if it is not JSON or goes on after it,
    or nests deeper than a call's JSON may (the parser recurses once per level)."""
    if json_depth(text) > MAX_JSON_DEPTH:
        raise _Invalid
    node, end = _parse(text, 0)
    if node is not None and node.complete and text[end:].strip(_WS):
        raise _Invalid
    return node


@dataclass
class _Sent:
    id: str
    name: str
    arguments: str = ""


class ToolCallStream:
    """The deltas of one streamed answer with tools on: ``step`` with the text so far, ``finish``
    with the non-streamed parse of the whole answer (``tools.parse_calls``)."""

    def __init__(self, known: dict[str, dict[str, Any]]) -> None:
        self.known = known
        self.content = ""  # content sent so far
        self.calls: list[_Sent] = []  # calls announced so far

    def step(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """The new content and tool-call deltas (OpenAI ``delta.tool_calls`` entries) for ``text``."""
        content, calls = self._view(text)
        return self._diff(content, calls)

    def finish(self, text: str, parsed: tuple[str | None, list[ToolCall]]) -> tuple[str, list[dict[str, Any]]]:
        content, calls = parsed
        if not calls:
            return self._diff(text, [])
        return self._diff(content or "", [(c.name, json.dumps(c.arguments)) for c in calls])

    def _diff(self, content: str, calls: list[tuple[str, str]]) -> tuple[str, list[dict[str, Any]]]:
        new_content = ""
        if content.startswith(self.content):
            new_content, self.content = content[len(self.content):], content
        deltas: list[dict[str, Any]] = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self.calls):
                sent = _Sent(f"call_{uuid.uuid4().hex[:24]}", name)
                self.calls.append(sent)
                deltas.append({"index": index, "id": sent.id, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            sent = self.calls[index]
            if sent.name == name and arguments.startswith(sent.arguments) and len(arguments) > len(sent.arguments):
                piece, sent.arguments = arguments[len(sent.arguments):], arguments
                if deltas and deltas[-1]["index"] == index and not deltas[-1]["function"]["arguments"]:
                    deltas[-1]["function"]["arguments"] = piece
                else:
                    deltas.append({"index": index, "function": {"arguments": piece}})
        return new_content, deltas

    def _view(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """The content and calls (name, arguments so far) ``text`` settles."""
        stripped = text.lstrip()
        if not stripped or _PYTHON_TAG.startswith(stripped):
            return "", []  # may still become a call
        body = stripped.removeprefix(_PYTHON_TAG).lstrip()
        if not body:
            return "", []
        if body[0] in "{[":
            try:
                node = _value(body)
            except _Invalid:
                pass  # not a JSON call: text, perhaps with <tool_call> blocks
            else:
                return "", self._calls(node)
        return self._qwen_view(text)

    def _qwen_view(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        parts: list[str] = []
        calls: list[tuple[str, str]] = []
        pos, first_block = 0, None
        while True:
            start = text.find(_OPEN, pos)
            if start == -1:
                break
            first_block = start if first_block is None else first_block
            parts.append(text[pos:start])
            end = text.find(_CLOSE, start)
            inner = text[start + len(_OPEN): len(text) if end == -1 else end]
            with contextlib.suppress(_Invalid):  # not a call: the block is left out all the same
                calls += self._calls(_value(inner.strip(_WS) if end != -1 else inner.lstrip(_WS)))
            if end == -1:
                pos = len(text)
                break
            pos = end + len(_CLOSE)
        tail = text[pos:]
        for k in range(min(len(tail), len(_OPEN) - 1), 0, -1):  # the start of a block to come
            if _OPEN.startswith(tail[-k:]):
                tail = tail[:-k]
                break
        if not calls:
            # No call yet: text so far, up to a block whose call is not known yet.
            return (text[:first_block] if first_block is not None else tail).rstrip(_WS), []
        parts.append(tail)
        return "".join(parts).rstrip(_WS), calls

    def _calls(self, node: _Node | None) -> list[tuple[str, str]]:
        """The known calls ``node`` (a call object or a list of them) settles, in order, up to the
        first whose name is not yet whole."""
        if node is None:
            return []
        items = node.items if node.kind == "arr" else [node]
        out = []
        for item in items:
            name = item.member("name") if item.kind == "obj" else None
            if name is None or name.kind != "str" or not name.complete:
                break
            if name.text not in self.known:
                if item.complete:
                    continue
                break
            arguments = item.member("arguments") or item.member("parameters")
            out.append((name.text, _canonical(arguments) if arguments is not None and arguments.kind == "obj" else ""))
        return out
