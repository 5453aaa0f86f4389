"""OpenAI's Responses API (``POST /v1/responses``) over the chat-completions machinery.

A request's ``input`` (text, or message / ``function_call`` / ``function_call_output`` items),
``instructions``, function ``tools``, ``tool_choice``, ``text.format`` (json_schema, json_object),
``max_output_tokens`` and sampling fields become a chat request; its answer (message text and
function calls) becomes the Response object, or with ``stream: true`` the typed events the openai
SDK parses (``response.created``, ``response.output_item.added``, ``response.output_text.delta``,
``response.function_call_arguments.delta``, ``response.completed``, ...).

With ``store`` (OpenAI's default: true) the response and the conversation that led to it are kept
in an in-memory store bounded by count and by bytes (their JSON), oldest first out, so a later
request can continue it with ``previous_response_id`` (an id not, or no longer, stored is a 404
naming it) and ``GET /v1/responses/{id}`` reads it back. The store is this process's: it is lost
on restart and not shared between replicas. What a response echoes is bounded too: ``metadata`` as
OpenAI bounds it, and ``tools``, ``tool_choice`` and ``text.format`` without keys this route does
not know.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, field_validator

from infer.sampling.params import SamplingParams, short_repr
from infer.server.bridge import ChatHandler, chat_body, chat_request, chunks, documented, run_chat
from infer.server.errors import APIError, bad_request
from infer.server.protocol import SpeculationOptions, _Body, check_model

# The stored responses an `infer serve` keeps for previous_response_id (oldest dropped first), and
# the bytes they may take in all (each response's JSON and its conversation's).
DEFAULT_MAX_STORED_RESPONSES = 1024
DEFAULT_MAX_STORED_RESPONSE_BYTES = 256 << 20
# OpenAI's bounds on metadata: at most 16 pairs, keys of at most 64 characters, string values of at most 512.
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# The keys of the objects a response echoes that this route knows (OpenAI's, for what it supports).
# Any other is a 400 rather than kept: these objects are stored and echoed whole, so an unknown key
# would be unbounded storage that does nothing, and OpenAI refuses unknown parameters too; a
# misspelt "strict" or "parameters" would otherwise be silently ignored.
_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
_TOOL_CHOICE_KEYS = frozenset({"type", "name"})
_FORMAT_KEYS = {"text": frozenset({"type"}), "json_object": frozenset({"type"}),
                "json_schema": frozenset({"type", "name", "description", "schema", "strict"})}
GRAMMAR_ERROR = ("the output could not follow its format to the end: the grammar engine hit one of its limits "
                 "mid-answer; the output so far is kept, and does not match the format")
# Chat request field -> the Responses field a client set, for the `param` of an error.
_PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
           "response_format": "text.format"}


class ResponsesRequest(_Body):
    """The fields /v1/responses honours (others are ignored, as by the chat route)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    truncation: Literal["disabled", "auto"] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    # Extensions, as on the chat route.
    top_k: int | None = Field(default=None, description="extension; 0 or -1 disables it")
    min_p: float | None = Field(default=None, description="extension")
    repetition_penalty: float | None = Field(default=None, description="extension")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = Field(default=None, description="extension")
    stop: str | list[str] | None = Field(default=None, description="extension")
    cache_salt: str | None = Field(default=None, min_length=1, description="extension: see /v1/chat/completions")
    speculation: SpeculationOptions | None = Field(default=None, description="extension: see /v1/chat/completions")

    @field_validator("metadata")
    @classmethod
    def _bounded_metadata(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_PAIRS:
            raise ValueError(f"{len(value)} pairs; at most {MAX_METADATA_PAIRS}")
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY:
                raise ValueError(f"key {short_repr(key, 40)} is longer than {MAX_METADATA_KEY} characters")
            if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE:
                shown = f"a {type(item).__name__}" if not isinstance(item, str) else f"{len(item)} characters"
                raise ValueError(f"the value of {short_repr(key, 40)} must be a string of at most "
                                 f"{MAX_METADATA_VALUE} characters (got {shown})")
        return value


def _json(value: Any) -> bytes:
    # As Starlette's JSONResponse renders, so a stored response reads back as it was answered.
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")


@dataclass
class _Stored:
    """A stored response and its conversation (chat messages: the inputs, without instructions, and
    the answer), kept as their JSON: what the store's byte budget counts is what it holds, and what
    GET answers is the response as it was answered."""

    raw_response: bytes
    raw_conversation: bytes

    @property
    def size(self) -> int:
        return len(self.raw_response) + len(self.raw_conversation)

    @property
    def conversation(self) -> list[dict[str, Any]]:
        return json.loads(self.raw_conversation)  # type: ignore[no-any-return]


class ResponseStore:
    """At most ``capacity`` stored responses by id, of at most ``max_bytes`` in all (least recently
    stored or read dropped first)."""

    def __init__(self, capacity: int, max_bytes: int = DEFAULT_MAX_STORED_RESPONSE_BYTES) -> None:
        if capacity < 0:
            raise ValueError(f"max_stored_responses={capacity} must be >= 0")
        if max_bytes < 0:
            raise ValueError(f"max_stored_response_bytes={max_bytes} must be >= 0")
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.bytes = 0  # the JSON of everything stored
        self._items: OrderedDict[str, _Stored] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> bool:
        """Store ``response``, dropping the oldest until both caps hold; False (nothing stored, nothing
        dropped) when the store keeps none or this one alone is larger than the whole byte budget."""
        if self.capacity == 0:
            return False
        stored = _Stored(_json(response), _json(conversation))
        if stored.size > self.max_bytes:
            return False
        self._remove(response["id"])
        self._items[response["id"]] = stored
        self.bytes += stored.size
        while len(self._items) > self.capacity or self.bytes > self.max_bytes:
            self._remove(next(iter(self._items)))
        return True

    def get(self, response_id: str, param: str | None = None) -> _Stored:
        stored = self._items.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response with id {short_repr(response_id)} (never stored, or dropped: "
                                f"the server keeps the last {self.capacity}, {self.max_bytes} bytes in all)",
                           param=param, code="not_found")
        self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        self.get(response_id, "response_id")
        self._remove(response_id)

    def _remove(self, response_id: str) -> None:
        stored = self._items.pop(response_id, None)
        if stored is not None:
            self.bytes -= stored.size


def install(app: FastAPI, chat: ChatHandler, model_name: str, max_stored: int = DEFAULT_MAX_STORED_RESPONSES,
            auth: bool = False, max_stored_bytes: int = DEFAULT_MAX_STORED_RESPONSE_BYTES) -> None:
    """Add /v1/responses (and GET/DELETE /v1/responses/{id}) to ``app``; ``chat`` is the chat
    route's handler; ``auth``: the app requires an API key (documented as a 401)."""
    store = ResponseStore(max_stored, max_stored_bytes)
    app.state.responses = store

    @app.post("/v1/responses", response_model=None, tags=["responses"],
              responses=documented((400, 401, 404, 413, 429, 500, 503), auth, stream=True))
    async def create(body: ResponsesRequest, http: Request) -> Response:
        check_model(body.model, model_name)
        history = store.get(body.previous_response_id, "previous_response_id").conversation \
            if body.previous_response_id is not None else []
        conversation = history + _messages(body.input)
        request = chat_request(_chat_body(body, conversation), _PARAMS)
        answer = await run_chat(chat, request, http, _PARAMS)
        shell = _shell(body, model_name)
        if isinstance(answer, dict):
            response = _complete(shell, answer)
            if body.store and not store.put(response, conversation + [_assistant(response["output"])]):
                response["store"] = False  # too large for the store (or it keeps none): say so
            return JSONResponse(response)
        if isinstance(answer, StreamingResponse):
            answer.body_iterator = _events(shell, chunks(answer.body_iterator), store if body.store else None, conversation)
        return answer

    @app.get("/v1/responses/{response_id}", response_model=None, tags=["responses"],
             responses=documented((401, 404), auth))
    async def retrieve(response_id: str) -> Response:
        return Response(store.get(response_id, "response_id").raw_response, media_type="application/json")

    @app.delete("/v1/responses/{response_id}", response_model=None, tags=["responses"],
                responses=documented((401, 404), auth))
    async def delete(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}


# -- request -> chat ------------------------------------------------------------------------------
def _chat_body(body: ResponsesRequest, conversation: list[dict[str, Any]]) -> dict[str, Any]:
    if body.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses (use /v1/chat/completions)",
                          param="top_logprobs", code="unsupported_parameter")
    if body.truncation == "auto":
        raise bad_request("truncation 'auto' is not supported: a conversation longer than the context is a 400",
                          param="truncation", code="unsupported_parameter")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    if not messages:
        raise bad_request("input is empty", param="input")
    out = chat_body(body, messages, ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                     "presence_penalty", "frequency_penalty", "seed", "stop", "cache_salt",
                                     "parallel_tool_calls"))
    if body.max_output_tokens is not None:
        out["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        out["tools"] = [_tool(t) for t in body.tools]
    if body.tool_choice is not None:
        out["tool_choice"] = _tool_choice(body.tool_choice)
    fmt = (body.text or {}).get("format")
    if fmt is not None:
        out["response_format"] = _format(fmt)
    return out


def _known_keys(given: dict[str, Any], known: frozenset[str], where: str, param: str) -> None:
    unknown = sorted(set(given) - known)
    if unknown:
        raise bad_request(f"{where} has unknown keys {short_repr(unknown, 80)} (it takes {', '.join(sorted(known))})",
                          param=param, code="unknown_parameter")


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        raise bad_request(f"tool of type {short_repr(tool.get('type'))} is not supported: only function tools "
                          "({\"type\": \"function\", \"name\": ..., \"parameters\": ...})", param="tools",
                          code="unsupported_parameter")
    _known_keys(tool, _TOOL_KEYS, "a function tool", "tools")
    fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any]) -> Any:
    if isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        _known_keys(choice, _TOOL_CHOICE_KEYS, "tool_choice", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                      param="tool_choice")


def _format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in _FORMAT_KEYS:
        _known_keys(fmt, _FORMAT_KEYS[kind], f"text.format {kind}", "text.format")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format json_schema needs a 'schema' object", param="text.format")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name") or "output", "schema": fmt["schema"],
                                                       "strict": bool(fmt.get("strict"))}}
    raise bad_request(f"text.format type {short_repr(kind)} is not supported (text, json_object, json_schema)",
                      param="text.format")


def _messages(given: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``input`` as chat messages: consecutive function calls join one assistant message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    out: list[dict[str, Any]] = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"input message role {short_repr(role)} is not one of user, system, developer, "
                                  "assistant", param="input")
            out.append({"role": role, "content": _text(item.get("content"))})
        elif kind == "function_call" and item.get("status") == "incomplete":
            # A call cut short, replayed from an output: text, as a stored one continues (_assistant).
            text = _cut_call_text(_field(item, "name"), _field(item, "arguments"))
            out.append({"role": "assistant", "content": text})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id"), "type": "function",
                    "function": {"name": _field(item, "name"), "arguments": _field(item, "arguments")}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not last["content"]):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id"),
                        "content": output if isinstance(output, str) else _text(output)})
        elif kind == "reasoning":
            continue  # another model's reasoning summary: nothing this model can read
        else:
            raise bad_request(f"input item of type {short_repr(kind)} is not supported (message, function_call, "
                              "function_call_output)", param="input", code="unsupported_parameter")
    return out


def _field(item: dict[str, Any], name: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise bad_request(f"input item of type {item.get('type')!r} needs a string {name!r}", param="input")
    return value


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request("a message's content must be a string or a list of text parts", param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
            raise bad_request(f"content part of type {short_repr(kind)} is not supported (only text)", param="input",
                              code="unsupported_parameter")
        texts.append(part["text"])
    return "\n".join(texts)


# -- chat -> response -----------------------------------------------------------------------------
def _shell(body: ResponsesRequest, model: str) -> dict[str, Any]:
    """The Response object before its output: what the request asked for."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "model": model, "output": [], "error": None, "incomplete_details": None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": bool(body.store),
            # What the request samples with: its own values, else SamplingParams' defaults.
            "temperature": SamplingParams.temperature if body.temperature is None else body.temperature,
            "top_p": SamplingParams.top_p if body.top_p is None else body.top_p, "text": {"format": fmt},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
            "metadata": body.metadata or {}, "usage": None}


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [] if status == "in_progress" else [_text_part(text)]}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(call: dict[str, Any], arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call['id'].removeprefix('call_')}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": arguments, "status": status}


def _finish(response: dict[str, Any], finish_reason: str | None, usage: dict[str, Any] | None,
            speculative: dict[str, Any] | None) -> dict[str, Any]:
    """The response's status from the chat answer's finish reason: ``length`` is incomplete
    (max_output_tokens), ``grammar_error`` failed (the output does not match its format, so it is
    not a completed answer, and no other reason a client parses says so) with the text so far."""
    cut = finish_reason == "length"
    response["status"] = "incomplete" if cut else "failed" if finish_reason == "grammar_error" else "completed"
    response["incomplete_details"] = {"reason": "max_output_tokens"} if cut else None
    if finish_reason == "grammar_error":
        response["error"] = {"code": "grammar_error", "message": GRAMMAR_ERROR}
    response["usage"] = None if usage is None else _usage(usage)
    if speculative is not None:
        response["speculative"] = speculative  # extension, as on the chat route
    return response


def _complete(shell: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    choice = answer["choices"][0]
    message = choice["message"]
    output = []
    if message.get("content"):
        output.append(_message_item(message["content"]))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call, call["function"]["arguments"], _call_status(call["function"]["arguments"])))
    response = {**shell, "output": output}
    return _finish(response, choice["finish_reason"], answer.get("usage"), answer.get("speculative"))


def _call_status(arguments: str) -> str:
    """A call cut short by max_output_tokens is incomplete: its arguments, as far as they were
    generated, are not JSON (server/tools.py)."""
    try:
        json.loads(arguments)
    except ValueError:
        return "incomplete"
    return "completed"


def _cut_call_text(name: str, arguments: str) -> str:
    # An incomplete call as the text it was written as: no template renders arguments that are not JSON.
    return f'{{"name": {json.dumps(name)}, "arguments": {arguments}'


def _assistant(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the chat message that continues its conversation (an incomplete
    call, cut short, as text: a continuation renders it as the model wrote it)."""
    text = "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
    cut = [_cut_call_text(item["name"], item["arguments"]) for item in output
           if item["type"] == "function_call" and item["status"] == "incomplete"]
    text = "\n".join(([text] if text else []) + cut)
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call" and item["status"] != "incomplete"]
    return {"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}


class _EventWriter:
    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"


async def _events(shell: dict[str, Any], source: AsyncIterator[dict[str, Any]], store: ResponseStore | None,
                  conversation: list[dict[str, Any]]) -> AsyncIterator[str]:
    """The chat chunks of one answer as Responses stream events."""
    emit = _EventWriter()
    yield emit("response.created", response=shell)
    yield emit("response.in_progress", response=shell)
    output: list[dict[str, Any]] = []
    text_item: dict[str, Any] | None = None  # the message being streamed
    calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> its function_call item
    open_call: dict[str, Any] | None = None
    finish_reason: str | None = None

    def close_text() -> list[str]:
        nonlocal text_item
        if text_item is None:
            return []
        index, text = output.index(text_item), text_item["content"][0]["text"]
        item_id, text_item = text_item["id"], None
        done = _message_item(text, item_id=item_id)
        output[index] = done
        return [emit("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
                     logprobs=[]),
                emit("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                     part=_text_part(text)),
                emit("response.output_item.done", output_index=index, item=done)]

    def close_call() -> list[str]:
        nonlocal open_call
        if open_call is None:
            return []
        item, open_call = open_call, None
        item["status"] = _call_status(item["arguments"])
        index = output.index(item)
        return [emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                     name=item["name"], arguments=item["arguments"]),
                emit("response.output_item.done", output_index=index, item=item)]

    async for chunk in source:
        if "error" in chunk:
            for event in close_text() + close_call():
                yield event
            error = chunk["error"]
            shell.update(status="failed", output=output,
                         error={"code": error.get("code") or "server_error", "message": error.get("message", "")})
            yield emit("response.failed", response=shell)
            return
        if not chunk.get("choices"):  # the usage chunk: the last
            response = _finish({**shell, "output": output}, finish_reason, chunk.get("usage"),
                               chunk.get("speculative"))
            if store is not None and not store.put(response, conversation + [_assistant(output)]):
                response["store"] = False  # too large for the store (or it keeps none): say so
            yield emit(f"response.{response['status']}", response=response)
            return
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        if delta.get("content"):
            for event in close_call():
                yield event
            if text_item is None:
                text_item = _message_item("", status="in_progress")
                output.append(text_item)
                index = len(output) - 1
                yield emit("response.output_item.added", output_index=index, item=text_item)
                text_item["content"] = [_text_part("")]
                yield emit("response.content_part.added", item_id=text_item["id"], output_index=index,
                           content_index=0, part=_text_part(""))
            text_item["content"][0]["text"] += delta["content"]
            yield emit("response.output_text.delta", item_id=text_item["id"], output_index=output.index(text_item),
                       content_index=0, delta=delta["content"], logprobs=[])
        for call in delta.get("tool_calls") or []:
            item = calls.get(call["index"])
            if item is None:
                for event in close_text() + close_call():
                    yield event
                item = _call_item(call, "", status="in_progress")
                calls[call["index"]] = open_call = item
                output.append(item)
                yield emit("response.output_item.added", output_index=len(output) - 1, item=item)
            piece = (call.get("function") or {}).get("arguments") or ""
            if piece:
                item["arguments"] += piece
                yield emit("response.function_call_arguments.delta", item_id=item["id"],
                           output_index=output.index(item), delta=piece)
        if choice.get("finish_reason") is not None:
            finish_reason = choice["finish_reason"]
            for event in close_text() + close_call():
                yield event
