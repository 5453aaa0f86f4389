"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the
chat-completions machinery.

``system`` (text or text blocks), ``messages`` with text, ``tool_use`` and ``tool_result`` content
blocks, ``tools`` (``input_schema``), ``tool_choice`` (auto, any, tool, none), ``stop_sequences``,
``max_tokens`` and the sampling fields become a chat request; its answer becomes a ``message`` with
text and ``tool_use`` blocks and Anthropic's ``stop_reason`` (end_turn, max_tokens, stop_sequence,
tool_use; a forced tool call whose grammar failed mid-answer is an error, see ``GRAMMAR_ERROR``),
or with ``stream: true`` Anthropic's events (``message_start``, ``content_block_start``,
``content_block_delta`` with ``text_delta`` / ``input_json_delta``, ``content_block_stop``,
``message_delta``, ``message_stop``). Errors on these paths, those of the API key and size checks
included, come in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from infer.sampling.params import short_repr
from infer.server.bridge import ChatHandler, chat_body, chat_request, chunks, documented, run_chat
from infer.server.errors import APIError, bad_request
from infer.server.protocol import SpeculationOptions, _Body, check_model
from infer.server.tools import arguments_object, prompt_messages

PATH = "/v1/messages"
_PARAMS = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "response_format": "tools"}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
# A forced tool call (the only grammar on this route) whose grammar could not go on mid-answer
# (finish_reason grammar_error): the input is cut off and matches no schema. Anthropic has no stop
# reason that says so (end_turn would pass it off as a finished call; refusal and pause_turn mean
# other things), so it is an invalid_request_error: a 400 whole, an `error` event in a stream.
GRAMMAR_ERROR = ("the forced tool call could not follow its input_schema to the end: the grammar engine hit one "
                 "of its limits mid-answer (simplify the tool's input_schema)")
# HTTP status -> Anthropic's error type.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """The body of every error on /v1/messages* (Anthropic's shape)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class MessagesRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    max_tokens: int
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    seed: int | None = Field(default=None, description="extension")
    speculation: SpeculationOptions | None = Field(default=None, description="extension: see /v1/chat/completions")


class CountTokensRequest(_Body):
    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None


def install(app: FastAPI, chat: ChatHandler, model_name: str, engine: Any, auth: bool = False) -> None:
    """Add /v1/messages and /v1/messages/count_tokens to ``app`` (and the middleware that gives
    their errors Anthropic's shape: call this after the app's other middleware is added)."""

    @app.post(PATH, response_model=None, tags=["anthropic"],
              responses=documented((400, 401, 404, 413, 429, 500, 503), auth, stream=True, error_model=AnthropicError))
    async def messages(body: MessagesRequest, http: Request) -> Response:
        check_model(body.model, model_name)
        request = chat_request(_chat_body(body), _PARAMS)
        answer = await run_chat(chat, request, http, _PARAMS)
        message_id = f"msg_{uuid.uuid4().hex}"
        if isinstance(answer, dict):
            if answer["choices"][0]["finish_reason"] == "grammar_error":
                # Not a refusal: the request ran (its finish reason is counted in /metrics).
                raise APIError(400, GRAMMAR_ERROR, param="tools", code="grammar_error", refused=False)
            return JSONResponse(_message(message_id, model_name, answer))
        if isinstance(answer, StreamingResponse):
            answer.body_iterator = _events(message_id, model_name, chunks(answer.body_iterator))
        return answer

    @app.post(f"{PATH}/count_tokens", response_model=None, tags=["anthropic"],
              responses=documented((400, 401, 404, 413), auth, error_model=AnthropicError))
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        check_model(body.model, model_name)
        chat_body = _chat_body(MessagesRequest(messages=body.messages, system=body.system, tools=body.tools,
                                               max_tokens=1))
        request = chat_request(chat_body, _PARAMS)
        fns = request.tool_functions()
        template = engine.tokenizer.chat_template
        rendered, tools = prompt_messages(request.template_messages(), request.tool_list() if fns else None, template)
        try:
            ids = await asyncio.to_thread(engine.encode_chat, rendered, False, tools)
        except ValueError as err:
            raise bad_request(str(err), param="messages") from None
        return {"input_tokens": len(ids)}

    app.add_middleware(AnthropicErrors)


# -- request -> chat ------------------------------------------------------------------------------
def _chat_body(body: MessagesRequest) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if body.system:
        messages.append({"role": "system", "content": body.system if isinstance(body.system, str)
                         else _texts(body.system, "system")})
    for message in body.messages:
        messages += _messages(message)
    out = chat_body(body, messages, ("temperature", "top_p", "top_k", "seed"))
    out["max_completion_tokens"] = body.max_tokens
    if body.stop_sequences:
        out["stop"] = body.stop_sequences
    if body.tools:
        out["tools"] = [_tool(t) for t in body.tools]
    if body.tool_choice is not None:
        out.update(_tool_choice(body.tool_choice))
    return out


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(tool.get("name"), str) or tool.get("type") not in (None, "custom"):
        raise bad_request(f"tool {short_repr(tool.get('name') or tool.get('type'))}: only client tools "
                          "({\"name\": ..., \"input_schema\": ...}) are supported", param="tools")
    fn = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: dict[str, Any]) -> dict[str, Any]:
    kind = choice.get("type")
    parallel = {} if choice.get("disable_parallel_tool_use") is None else \
        {"parallel_tool_calls": not choice["disable_parallel_tool_use"]}
    if kind in ("auto", "none"):
        return {"tool_choice": kind, **parallel}
    if kind == "any":
        return {"tool_choice": "required", **parallel}
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"tool_choice": {"type": "function", "function": {"name": choice["name"]}}}
    raise bad_request("tool_choice must be {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                      "\"name\": ...}", param="tool_choice")


def _messages(message: dict[str, Any]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user's tool_result blocks become tool messages, an
    assistant's tool_use blocks its tool_calls."""
    role, content = message.get("role"), message.get("content")
    if role not in ("user", "assistant"):
        raise bad_request(f"message role {short_repr(role)} must be user or assistant", param="messages")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise bad_request("a message's content must be a string or a list of content blocks", param="messages")
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise bad_request("a tool_use block needs a string id and name", param="messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
        elif kind == "tool_result" and role == "user":
            result = block.get("content")
            if not isinstance(result, (str, list, type(None))):
                raise bad_request("a tool_result's content must be a string or text blocks", param="messages")
            text = result if isinstance(result, str) else _texts(result or [], "messages")
            if block.get("is_error"):
                text = f"Error: {text}"
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # another model's reasoning: nothing this model can read
        else:
            raise bad_request(f"content block of type {short_repr(kind)} is not supported in a {role} message "
                              "(text, tool_use from the assistant, tool_result from the user)", param="messages")
    if texts or calls or not out:
        out.append({"role": role, "content": "\n".join(texts) or (None if calls else ""),
                    **({"tool_calls": calls} if calls else {})})
    return out


def _texts(blocks: list[Any], param: str) -> str:
    texts = []
    for block in blocks:
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request("only text blocks are supported here", param=param)
        texts.append(block["text"])
    return "\n".join(texts)


# -- chat -> message ------------------------------------------------------------------------------
def _usage(usage: dict[str, Any] | None) -> dict[str, Any]:
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    # Anthropic counts cache reads apart from input_tokens; creation is not billed here.
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    # A call cut short by max_tokens (stop_reason max_tokens) has arguments that are not JSON: its
    # input is what they settle, as the SDK reads the same call streamed.
    return {"type": "tool_use", "id": f"toolu_{call['id'].removeprefix('call_')}", "name": call["function"]["name"],
            "input": arguments_object(call["function"]["arguments"])}


def _stop(choice: dict[str, Any]) -> tuple[str, str | None]:
    reason = choice.get("finish_reason")
    if reason == "stop" and choice.get("stop_reason") is not None:
        return "stop_sequence", choice["stop_reason"]
    return _STOP_REASONS.get(reason or "", "end_turn"), None


def _message(message_id: str, model: str, answer: dict[str, Any]) -> dict[str, Any]:
    choice = answer["choices"][0]
    content: list[dict[str, Any]] = []
    if choice["message"].get("content"):
        content.append({"type": "text", "text": choice["message"]["content"]})
    content += [_tool_use(call) for call in choice["message"].get("tool_calls") or []]
    stop_reason, stop_sequence = _stop(choice)
    out = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
           "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(answer.get("usage"))}
    if answer.get("speculative") is not None:
        out["speculative"] = answer["speculative"]  # extension, as on the chat route
    return out


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


async def _events(message_id: str, model: str, source: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The chat chunks of one answer as Anthropic's stream events."""
    start: dict[str, Any] = {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": _usage(None)}
    yield _sse("message_start", {"message": start})
    blocks = -1  # the index of the open block
    open_kind: str | None = None  # "text" or a tool call's chat index
    stop: tuple[str, str | None] = ("end_turn", None)
    async for chunk in source:
        if "error" in chunk:
            error = chunk["error"]
            yield _sse("error", {"error": {"type": "api_error", "message": error.get("message", "")}})
            return
        if not chunk.get("choices"):  # the usage chunk: the last
            if open_kind is not None:
                yield _sse("content_block_stop", {"index": blocks})
            yield _sse("message_delta", {"delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                                         "usage": _usage(chunk.get("usage"))})
            yield _sse("message_stop", {})
            return
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        if delta.get("content"):
            if open_kind != "text":
                if open_kind is not None:
                    yield _sse("content_block_stop", {"index": blocks})
                blocks, open_kind = blocks + 1, "text"
                yield _sse("content_block_start", {"index": blocks, "content_block": {"type": "text", "text": ""}})
            yield _sse("content_block_delta", {"index": blocks, "delta": {"type": "text_delta",
                                                                          "text": delta["content"]}})
        for call in delta.get("tool_calls") or []:
            key = f"call {call['index']}"
            if open_kind != key:
                if open_kind is not None:
                    yield _sse("content_block_stop", {"index": blocks})
                blocks, open_kind = blocks + 1, key
                block = {**_tool_use({**call, "function": {**call["function"], "arguments": "{}"}}), "input": {}}
                yield _sse("content_block_start", {"index": blocks, "content_block": block})
            piece = (call.get("function") or {}).get("arguments") or ""
            if piece:
                yield _sse("content_block_delta", {"index": blocks, "delta": {"type": "input_json_delta",
                                                                              "partial_json": piece}})
        if choice.get("finish_reason") == "grammar_error":
            yield _sse("error", {"error": {"type": "invalid_request_error", "message": GRAMMAR_ERROR}})
            return
        if choice.get("finish_reason") is not None:
            stop = _stop(choice)


class AnthropicErrors:
    """ASGI middleware: an error answered on /v1/messages* (by the route, or by the API key, size
    and content-type checks outside it) gets Anthropic's error shape instead of OpenAI's."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(PATH):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        parts: list[bytes] = []

        async def rewrite(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None:
                await send(message)
                return
            parts.append(message.get("body", b""))
            if message.get("more_body"):
                return
            body = _anthropic_error(start["status"], b"".join(parts))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewrite)


def _anthropic_error(status: int, body: bytes) -> bytes:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace")
    kind = _ERROR_TYPES.get(status, "api_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": message}}).encode()
