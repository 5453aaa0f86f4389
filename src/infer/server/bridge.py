"""What the Responses and Anthropic routes share: a request run through /v1/chat/completions's
handler, its answer read back as the chat API's JSON or stream of chunks.

The dialects translate to and from the chat API's wire format rather than reaching into the
engine, so every check, limit, grammar, tool parser and speculation path the chat route has is
theirs too, and a greedy answer is the chat route's answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from infer.server.errors import APIError, ErrorResponse, bad_request
from infer.server.protocol import ChatCompletionRequest

ChatHandler = Callable[[ChatCompletionRequest, Request], Awaitable[Response]]

_DESCRIPTIONS = {
    400: "Invalid request: the error names the offending field",
    401: "Missing or invalid API key",
    404: "No such model, or no such stored response",
    413: "Request body larger than the server's limit",
    429: "The request queue is full; retry later",
    500: "The request failed in the engine",
    503: "The server is shutting down (draining) or its engine is not running",
}


def documented(statuses: tuple[int, ...], auth: bool, *, stream: bool = False,
               error_model: type = ErrorResponse) -> dict[int | str, dict[str, Any]]:
    """The responses a route documents in /openapi.json: 200 (JSON, or with ``stream`` also
    server-sent events) and the error statuses it answers (401 when the server has a key)."""
    ok: dict[str, Any] = {"description": "The answer (JSON)" + (", or with `stream: true` server-sent events"
                                                                 if stream else "")}
    if stream:
        ok["content"] = {"application/json": {"schema": {"type": "object"}},
                         "text/event-stream": {"schema": {"type": "string"}}}
    errors: dict[int | str, dict[str, Any]] = {s: {"model": error_model, "description": _DESCRIPTIONS[s]} for s in statuses if s != 401 or auth}
    return {200: ok, **errors}


def chat_body(body: Any, messages: list[dict[str, Any]], copied: tuple[str, ...]) -> dict[str, Any]:
    """The chat API's body for a dialect's ``body`` (which has ``model``, ``stream`` and the
    ``speculation`` extension): its ``messages``, streaming with usage when it streams, and the
    fields named in ``copied`` (spelt as the chat API spells them) that the body set."""
    out: dict[str, Any] = {"model": body.model, "messages": messages, "stream": bool(body.stream)}
    if body.stream:
        out["stream_options"] = {"include_usage": True}
    for name in copied:
        value = getattr(body, name)
        if value is not None:
            out[name] = value
    if body.speculation is not None:
        out["speculation"] = body.speculation.model_dump()
    return out


def chat_request(body: dict[str, Any], params: Mapping[str, str]) -> ChatCompletionRequest:
    """The chat request a dialect's body translates to; a 400 naming the dialect's field
    (``params`` maps chat field -> dialect field) if it does not validate."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = str(first["loc"][0]) if first.get("loc") else None
        message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()[:3])
        raise bad_request(message, param=params.get(where or "", where)) from None


async def run_chat(chat: ChatHandler, body: ChatCompletionRequest, http: Request,
                   params: Mapping[str, str]) -> dict[str, Any] | StreamingResponse | Response:
    """The chat handler's answer: its JSON body (``stream: false``), its streaming response (whose
    ``body_iterator`` the caller replaces with ``chunks(...)`` translated), or any other response
    as is (the client went away). An error names the dialect's field, not the chat API's."""
    try:
        response = await chat(body, http)
    except APIError as err:
        if err.param is not None:
            err.param = params.get(err.param, err.param)
        raise
    if isinstance(response, StreamingResponse):
        return response
    if response.status_code == 200 and response.media_type == "application/json":
        return json.loads(bytes(response.body))  # type: ignore[no-any-return]
    return response


async def chunks(events: AsyncIterable[Any]) -> AsyncIterator[dict[str, Any]]:
    """The chat chunks (and ``{"error": ...}`` items) of a streaming chat response's body (its
    ``body_iterator``, taken before it is replaced), until [DONE]."""
    async for event in events:
        text = event if isinstance(event, str) else bytes(event).decode()
        for line in text.splitlines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                if data == "[DONE]":
                    return
                yield json.loads(data)
