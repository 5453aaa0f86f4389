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
Both read calls with one partial-JSON parser (server/partial_json.py), so an answer cut short by
``max_tokens`` anywhere is parsed to the calls its stream has announced, the one cut inside its
arguments as far as it goes. Only an answer that turns out malformed after a call was announced
(invalid JSON, text after a JSON call) has no call when parsed, only text.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from infer.server.partial_json import WS as _WS
from infer.server.tools import PYTHON_TAG as _PYTHON_TAG
from infer.server.tools import QWEN_CLOSE as _CLOSE
from infer.server.tools import QWEN_OPEN as _OPEN
from infer.server.tools import ToolCall, calls_in, open_block


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
        return self._diff(content or "", _sent(calls))

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
            calls = calls_in(body, self.known)
            if calls is not None:
                return "", _sent(calls)
            # not a JSON call: text, perhaps with <tool_call> blocks
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
            # Not a call (None): the block is left out all the same.
            calls += _sent(calls_in(inner.strip(_WS) if end != -1 else open_block(inner), self.known) or [])
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


def _sent(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments_json) for c in calls]
