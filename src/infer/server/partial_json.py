"""JSON read as far as it goes: the parse tree of a prefix of a JSON text, for tool calls that are
still being generated (server/tool_stream.py) or were cut short by ``max_tokens`` (server/tools.py).

Both read a call through this one parser so they cannot disagree: what a stream has sent of a call
is always a prefix of what the finished (or cut) answer is parsed to. A number at the end of the
text is not settled even when the text has ended (``3`` in a cut ``{"days": 3`` might have gone on
to ``30`` or ``3.5``), so a cut call's arguments are a prefix of what the whole call's would be;
``canonical`` writes only settled numbers, so in its output (``ended``) a number at the end is whole.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from infer.sampling.grammar import json_depth

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][-+]?\d+)?")
_LITERALS = ("true", "false", "null", "NaN", "Infinity", "-Infinity")  # what json.loads accepts
WS = " \t\n\r"


class Invalid(ValueError):
    """The text is not (a prefix of) JSON."""


@dataclass
class Node:
    """A JSON value parsed from a prefix: ``kind`` obj/arr/str/atom, ``complete`` once it is closed."""

    kind: str
    complete: bool = False
    text: str = ""  # str: the characters decoded so far; atom: its raw text
    members: list[tuple[Node, Node | None]] = field(default_factory=list)  # obj: (key, value) pairs
    items: list[Node] = field(default_factory=list)  # arr

    def member(self, name: str) -> Node | None:
        found = None
        for key, value in self.members:
            if key.complete and key.text == name:
                found = value
        return found


def _parse(text: str, i: int, ended: bool) -> tuple[Node | None, int]:
    """The value starting at ``text[i]`` (None when nothing of it is there yet) and where it ends."""
    while i < len(text) and text[i] in WS:
        i += 1
    if i == len(text):
        return None, i
    c = text[i]
    if c == '"':
        return _string(text, i)
    if c == "{":
        return _container(text, i + 1, Node("obj"), "}", ended)
    if c == "[":
        return _container(text, i + 1, Node("arr"), "]", ended)
    for literal in _LITERALS:
        if text.startswith(literal, i):
            return Node("atom", True, literal), i + len(literal)
        if literal.startswith(text[i:i + len(literal)]) and i + len(literal) > len(text):
            return Node("atom"), len(text)  # a literal still being written
    j = i
    while j < len(text) and text[j] in "0123456789+-.eE":
        j += 1
    if j == len(text):  # a number that may go on, unless written whole (ended)
        whole = ended and _NUMBER.fullmatch(text, i, j) is not None
        return Node("atom", whole, text[i:j] if whole else ""), j
    if not _NUMBER.fullmatch(text, i, j):
        raise Invalid
    return Node("atom", True, text[i:j]), j


def _string(text: str, i: int) -> tuple[Node, int]:
    j = i + 1
    while j < len(text):
        c = text[j]
        if c == '"':
            return Node("str", True, json.loads(text[i:j + 1])), j + 1
        if c == "\\":
            j += 2
        elif c < " ":
            raise Invalid  # json.loads refuses control characters in strings
        else:
            j += 1
    # Unfinished: the characters decoded so far (an escape sequence only once it is whole).
    body = text[i + 1:]
    for cut in range(0, 7):
        try:
            return Node("str", False, json.loads('"' + body[:len(body) - cut] + '"')), len(text)
        except json.JSONDecodeError:
            continue
    raise Invalid


def _container(text: str, i: int, node: Node, close: str, ended: bool) -> tuple[Node, int]:
    first = True
    while True:
        while i < len(text) and text[i] in WS:
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
                raise Invalid
            i += 1
        first = False
        if node.kind == "arr":
            value, i = _parse(text, i, ended)
            if value is None:
                return node, i
            node.items.append(value)
            if not value.complete:
                return node, i
            continue
        while i < len(text) and text[i] in WS:
            i += 1
        if i == len(text):
            return node, i
        if text[i] != '"':
            raise Invalid
        key, i = _string(text, i)
        if not key.complete:
            node.members.append((key, None))
            return node, i
        while i < len(text) and text[i] in WS:
            i += 1
        if i == len(text):
            node.members.append((key, None))
            return node, i
        if text[i] != ":":
            raise Invalid
        value, i = _parse(text, i + 1, ended)
        node.members.append((key, value))
        if value is None or not value.complete:
            return node, i


def canonical(node: Node) -> str:
    """The prefix of ``json.dumps`` of the finished value that ``node`` (a parsed prefix) settles."""
    if node.kind == "str":
        return json.dumps(node.text)[: None if node.complete else -1]
    if node.kind == "atom":
        return json.dumps(json.loads(node.text)) if node.complete else ""
    if node.kind == "arr":
        inner = ", ".join(canonical(item) for item in node.items)
        return "[" + inner + ("]" if node.complete else "")
    parts = []
    for key, value in node.members:
        if not key.complete or value is None:
            parts.append(canonical(key))
        else:
            parts.append(f"{canonical(key)}: {canonical(value)}")
    return "{" + ", ".join(parts) + ("}" if node.complete else "")


def partial_value(node: Node) -> Any:
    """The value as far as ``node`` settles it, as a partial-JSON reader gives it (jiter's partial
    mode, which the anthropic SDK applies to a streamed tool input): unfinished containers with
    what they hold so far, unfinished strings, numbers and literals left out."""
    if node.kind == "obj":
        return {key.text: partial_value(value) for key, value in node.members
                if key.complete and value is not None and _settled(value)}
    if node.kind == "arr":
        return [partial_value(item) for item in node.items if _settled(item)]
    return node.text if node.kind == "str" else json.loads(node.text)


def _settled(node: Node) -> bool:
    return node.complete or node.kind in ("obj", "arr")


def value(text: str, max_depth: int, ended: bool = False) -> Node | None:
    """The JSON value ``text`` begins (None: nothing yet); Invalid if it is not JSON or goes on after it,
    or nests deeper than ``max_depth`` (the parser recurses once per level). ``ended``: a number at
    the end is whole (``text`` was written by ``canonical``)."""
    if json_depth(text) > max_depth:
        raise Invalid
    node, end = _parse(text, 0, ended)
    if node is not None and node.complete and text[end:].strip(WS):
        raise Invalid
    return node


def partial_object(text: str, max_depth: int) -> dict[str, Any]:
    """The members of the JSON object that ``text`` (``canonical``'s, perhaps cut short) begins, as
    far as it goes ({} for nothing or what is not an object's start)."""
    try:
        node = value(text, max_depth, ended=True)
        return partial_value(node) if node is not None and node.kind == "obj" else {}
    except ValueError:  # not JSON, or a number json.loads refuses (over 4300 digits)
        return {}
