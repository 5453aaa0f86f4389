"""OpenAI-style error bodies and the exception handlers that produce them."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from infer.sampling.params import short_repr

log = logging.getLogger("infer.server")
_SAMPLING_FIELD = re.compile(r"SamplingParams\.(\w+)=")
MAX_MESSAGE_CHARS = 1000
# A refusal's reason (the /metrics label) when its error has no code: by status.
_STATUS_REASONS = {400: "invalid_request", 401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed",
                   413: "request_too_large", 429: "queue_full", 503: "unavailable"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """The body of every error response (as OpenAI's API answers)."""

    error: ErrorDetail


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped: a message quoting client input (a lone surrogate included)
    always encodes, where Starlette's UTF-8 rendering would raise and turn a 400 into a 500."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


class APIError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None, refused: bool | None = None) -> None:
        if len(message) > MAX_MESSAGE_CHARS:  # a backstop: messages quote client input only cut short
            message = message[:MAX_MESSAGE_CHARS] + "…"
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})
        # A refusal: the request was not taken (every 4xx and a 503), counted by reason in /metrics.
        # A 500, or a 503 for an admitted request that shutdown cut short, is not one.
        self.refused = (status < 500 or status == 503) if refused is None else refused

    @property
    def reason(self) -> str | None:
        """The refusal's reason for /metrics (its code, else one by status); None when not a refusal.
        Codes are the server's own constants, so the label's values stay few."""
        if not self.refused:
            return None
        return self.code or _STATUS_REASONS.get(self.status, f"http_{self.status}")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {401: {"WWW-Authenticate": "Bearer"}, 429: {"Retry-After": "1"}}.get(self.status, {})
        return SafeJSONResponse(self.body(), status_code=self.status, headers={**headers, **self.headers})


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_sampling_error(err: ValueError) -> APIError:
    """A 400 for a ``SamplingParams`` ValueError, naming the offending field as ``param``."""
    match = _SAMPLING_FIELD.search(str(err))
    return bad_request(str(err), param=match.group(1) if match else None)


def server_error(message: str) -> APIError:
    return APIError(500, message, type="server_error", code="internal_error")


def shutting_down(message: str = "the server is shutting down", refused: bool = True) -> APIError:
    """503 ``server_shutting_down``: a refused request, or (``refused=False``) an admitted one cut short."""
    return APIError(503, message, type="server_error", code="server_shutting_down", refused=refused)


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than {limit} bytes (the server's --max-request-bytes)",
                    code="request_too_large", headers={"Connection": "close"})


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = list(exc.errors())
    if not errors:
        return "invalid request body", None
    if any(e.get("type") == "json_invalid" for e in errors):
        detail = next(e for e in errors if e.get("type") == "json_invalid")
        reason = (detail.get("ctx") or {}).get("error", detail.get("msg", ""))
        return f"the request body is not valid JSON ({reason})", None
    parts = []
    param: str | None = None
    for e in errors[:5]:
        loc = [_short(x) if not isinstance(x, (str, int)) else str(x)[:60] for x in e.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        where = ".".join(loc) or "body"
        got = e.get("input")
        shown = "" if isinstance(got, dict) else f" (got {_short(got)})"
        parts.append(f"{where}: {e.get('msg', 'invalid value')}{shown}")
    return "; ".join(parts), param


def _short(value: Any) -> str:
    if isinstance(value, int) and value.bit_length() > 200:  # json.dumps refuses ints over 4300 digits
        return short_repr(value)
    if isinstance(value, (list, tuple)) and len(value) > 60:  # cut first: never serialise a megabyte
        value = list(value[:60])
    elif isinstance(value, str) and len(value) > 60:
        value = value[:60]
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def count_refusal(metrics: Any, error: APIError) -> None:
    """``infer_requests_refused_total{reason}`` += 1 when ``error`` refuses a request (``metrics``: a
    ServerMetrics, or None)."""
    if metrics is not None and error.reason is not None:
        metrics.refuse(error.reason)


def install_error_handlers(app: FastAPI) -> None:
    """APIError as is; FastAPI's 422 validation errors become 400; every HTTP error gets the shape.
    Refusals are counted by reason in ``app.state.metrics`` (a ``ServerMetrics``) when the app has one."""

    def answer(request: Request, error: APIError) -> JSONResponse:
        count_refusal(getattr(request.app.state, "metrics", None), error)
        return error.response()

    async def on_api_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return answer(request, exc)

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        message, param = _describe_validation(exc)
        return answer(request, bad_request(message, param=param))

    async def on_http_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        code = "not_found" if exc.status_code == 404 else None
        # Keep the exception's headers: a 405 must say which methods are allowed (Allow).
        return answer(request, APIError(exc.status_code, str(exc.detail), type=kind, code=code, headers=exc.headers))

    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled error", exc_info=exc)
        return server_error(f"internal error: {type(exc).__name__}").response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected)
